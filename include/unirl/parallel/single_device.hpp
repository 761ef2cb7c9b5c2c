#pragma once
/// \file single_device.hpp
/// One process, one device: every collective is the identity.
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/parallel.hpp>

namespace unirl::parallel {

/// The default parallelism: nothing to reduce, nothing to sync.
struct single_device {
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_reduce_gradients(const std::vector<torch::Tensor>&) {}
  void broadcast(const std::vector<torch::Tensor>&, int) {}
  torch::Tensor all_reduce_mean(const torch::Tensor& v) { return v; }
  torch::Tensor all_reduce_max(const torch::Tensor& v) { return v; }
  double all_reduce_mean(double v) { return v; }
  bool all_agree(bool ok) { return ok; }
  void sync_weights(const std::vector<torch::Tensor>&) {}
};
static_assert(ParallelStrategy<single_device>);

}  // namespace unirl::parallel

namespace unirl {
/// The former name of `unirl::parallel`, kept so that existing code compiles.
namespace par = parallel;
}  // namespace unirl
