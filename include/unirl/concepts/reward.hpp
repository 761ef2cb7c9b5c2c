#pragma once
/// \file reward.hpp
/// Rewards: a scorer maps a rollout batch to one float per sample. Scorers are generic over the
/// batch and constrained only by the fields they read (`HasCompletions`, `HasImages`, ...).
///
/// ```cpp
/// template <unirl::HasCompletions B> torch::Tensor operator()(const B& b) const;   // in a scorer
/// static_assert(unirl::ScorerFor<my_scorer, unirl::token_rollout>);
/// ```
/// The scorer concepts are also reachable as `unirl::rewards::ScorerFor` etc. (their former home).
#include <concepts>
#include <map>
#include <string>
#include <vector>

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

/// A scorer for batches of type `Batch`: the reward concept `RewardFor` (`torch::Tensor
/// operator()(const Batch&)` giving a (B,) float tensor), spelled for the parts of a composite.
///
/// Minimal complete definition: `torch::Tensor operator()(const Batch&)`. Optional: a name,
/// either `static constexpr std::string_view name` or `std::string name() const`, used for the
/// per-component statistics of a composer.
template <class S, class Batch>
concept ScorerFor = RewardFor<S, Batch>;

/// A batch carrying generated text: `std::vector<std::string> completions`, one per sample.
template <class B>
concept HasCompletions = requires(const B& b) {
  { b.completions } -> std::convertible_to<const std::vector<std::string>&>;
};

/// A batch carrying per-sample ground truth text: `std::vector<std::string> references`.
template <class B>
concept HasReferences = requires(const B& b) {
  { b.references } -> std::convertible_to<const std::vector<std::string>&>;
};

/// A batch carrying the prompt text of each sample: `std::vector<std::string> prompts`.
template <class B>
concept HasPrompts = requires(const B& b) {
  { b.prompts } -> std::convertible_to<const std::vector<std::string>&>;
};

/// A batch carrying generated images (or any final samples), (B, ...): a `torch::Tensor images`
/// member or a `torch::Tensor samples() const` method (the flow track's `flow_rollout`).
template <class B>
concept HasImages = requires(const B& b) {
  { b.images } -> std::convertible_to<const torch::Tensor&>;
} || requires(const B& b) {
  { b.samples() } -> std::convertible_to<torch::Tensor>;
};

/// A batch that knows each completion's length in tokens: a `lengths()` method giving a (B,)
/// integer tensor (the token track's `token_rollout`), or a `completion_lengths` member, a (B,)
/// integer tensor or a `std::vector` of integers.
template <class B>
concept HasCompletionLengths = requires(const B& b) { b.completion_lengths; } ||
                               requires(const B& b) { { b.lengths() } -> std::convertible_to<torch::Tensor>; };

namespace rewards {
using unirl::HasCompletionLengths;
using unirl::HasCompletions;
using unirl::HasImages;
using unirl::HasPrompts;
using unirl::HasReferences;
using unirl::ScorerFor;
}  // namespace rewards

}  // namespace unirl
