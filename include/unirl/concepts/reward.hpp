#pragma once
/// \file reward.hpp
/// Rewards: a scorer maps a rollout batch to one float per sample.
#include <concepts>
#include <map>
#include <string>

#include <torch/torch.h>

namespace unirl {

/// A reward (or reward composer) for rollout batches of type `Batch`.
///
/// Minimal complete definition: `torch::Tensor operator()(const Batch&)` returning a (B,)
/// floating tensor, one score per sample. Optional: `std::map<std::string, double>
/// last_components() const` — per-component means of the last call, reported in the step
/// statistics as `reward/<name>`.
template <class R, class Batch>
concept RewardFor = requires(R& r, const Batch& b) {
  { r(b) } -> std::same_as<torch::Tensor>;
};

/// A reward that reports per-component statistics.
template <class R>
concept ReportsComponents = requires(const R& r) {
  { r.last_components() } -> std::convertible_to<std::map<std::string, double>>;
};

}  // namespace unirl
