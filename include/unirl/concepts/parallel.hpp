#pragma once
/// \file parallel.hpp
/// Parallelism strategies: how gradients are reduced and how rollout weights are synced.
#include <concepts>
#include <vector>

#include <torch/torch.h>

namespace unirl {

/// A parallelism strategy.
///
/// Minimal complete definition:
/// - `int rank() const`, `int world_size() const`;
/// - `void all_reduce_gradients(const std::vector<torch::Tensor>& params)` — averages `.grad()`;
/// - `void broadcast(const std::vector<torch::Tensor>& tensors, int root)` — in place;
/// - `torch::Tensor all_reduce_mean(const torch::Tensor& values)` — the element-wise mean over
///   ranks of a 1-D float64 tensor (every rank passes the same length): the trainer reduces its
///   step statistics through it, once per step;
/// - `bool all_agree(bool ok)` — true only if every rank says true (the stability guard);
/// - `void sync_weights(const std::vector<torch::Tensor>& params)` — learner to rollout workers.
/// Optional: `torch::Tensor all_reduce_max(const torch::Tensor& values)` (element-wise maximum;
/// the trainer then reports the reward range over all ranks, else rank 0's own).
template <class P>
concept ParallelStrategy = requires(P& p, const P& cp, const std::vector<torch::Tensor>& ts, const torch::Tensor& v,
                                    bool b) {
  { cp.rank() } -> std::convertible_to<int>;
  { cp.world_size() } -> std::convertible_to<int>;
  p.all_reduce_gradients(ts);
  p.broadcast(ts, 0);
  { p.all_reduce_mean(v) } -> std::same_as<torch::Tensor>;
  { p.all_agree(b) } -> std::convertible_to<bool>;
  p.sync_weights(ts);
};

}  // namespace unirl
