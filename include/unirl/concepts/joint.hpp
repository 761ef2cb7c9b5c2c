#pragma once
/// \file joint.hpp
/// Joint training composes trainers (`unirl::joint`): the concepts say what a trainer, or
/// anything standing in for one, must offer to take part.
///
/// ```cpp
/// static_assert(unirl::SteppedTrainer<my_flow_trainer, torch::Tensor>);  // step(conditions) -> step_stats
/// static_assert(unirl::GeneratorTrainer<my_flow_trainer, torch::Tensor>);
/// ```
#include <concepts>
#include <optional>

#include <torch/torch.h>

#include <unirl/concepts/checkpoint.hpp>
#include <unirl/core/stats.hpp>

namespace unirl {

/// How a chain's generator takes part in a step: only sampled and scored (its weights frozen), or
/// stepped — sampled, scored and updated by its own algorithm.
enum class generator_mode { frozen, trained };

/// Something trained one step at a time on inputs of type `Input` and saved with the rest of a
/// joint run: a `unirl::trainer`, or a composition of them (`joint::chain`).
///
/// Minimal complete definition: `step_stats step(Input)` (or a type with a `double reward_mean`
/// member: `joint::chain_stats`), and `Checkpointable` (`save(OutputArchive&) const`,
/// `load(InputArchive&)`).
template <class T, class Input>
concept SteppedTrainer = Checkpointable<T> && requires(T& t, Input in) {
  { t.step(in).reward_mean } -> std::convertible_to<double>;
};

/// A trainer that can stand at the end of a chain (`joint::link`): stepped on a tensor of
/// conditions (one per upstream sample, each drawn `group_size` times in a row), or only sampled
/// from (`rollout`) and scored with its own reward, with the rewards of its last step readable.
///
/// Minimal complete definition, besides `SteppedTrainer<T, torch::Tensor>`:
/// `rollout(torch::Tensor)` (a batch its `reward()` scores into a tensor), `reward()`,
/// `const torch::Tensor& last_rewards() const`, and `settings().group_size`.
template <class T, class Conditions = torch::Tensor>
concept GeneratorTrainer = SteppedTrainer<T, Conditions> && requires(T& t, const T& c, Conditions in) {
  { t.reward()(t.rollout(in)) } -> std::same_as<torch::Tensor>;
  { c.last_rewards() } -> std::convertible_to<const torch::Tensor&>;
  { c.settings().group_size } -> std::convertible_to<std::int64_t>;
};

/// What a chain needs of the upstream trainer's reward: a link that can be switched between
/// sampling a frozen generator and stepping it (`joint::link`), and that reports the
/// generator's last step.
template <class R>
concept GeneratorLink = requires(R& r, const R& c, generator_mode m) {
  r.set_mode(m);
  { c.mode() } -> std::same_as<generator_mode>;
  { c.generator_stats() } -> std::convertible_to<const std::optional<step_stats>&>;
};

}  // namespace unirl
