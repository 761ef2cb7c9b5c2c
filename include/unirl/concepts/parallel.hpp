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
/// - `double all_reduce_mean(double value)` — the mean of a scalar over ranks (statistics);
/// - `bool all_agree(bool ok)` — true only if every rank says true (the stability guard);
/// - `void sync_weights(const std::vector<torch::Tensor>& params)` — learner to rollout workers.
template <class P>
concept ParallelStrategy = requires(P& p, const P& cp, const std::vector<torch::Tensor>& ts, double v, bool b) {
  { cp.rank() } -> std::convertible_to<int>;
  { cp.world_size() } -> std::convertible_to<int>;
  p.all_reduce_gradients(ts);
  p.broadcast(ts, 0);
  { p.all_reduce_mean(v) } -> std::convertible_to<double>;
  { p.all_agree(b) } -> std::convertible_to<bool>;
  p.sync_weights(ts);
};

}  // namespace unirl
