#pragma once
/// \file algorithm.hpp
/// Algorithms: each owns the sample, advantage and loss stages for the tracks it can train.
#include <concepts>
#include <type_traits>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/concepts/rollout.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>

namespace unirl {

/// An RL algorithm (loss + advantage + the sampler it trains from).
///
/// Minimal complete definition:
/// - `typename A::options` — a reflectable options aggregate; `A(const options&)`;
/// - `static constexpr bool requires_reference, requires_critic, requires_ema_rollout,
///   requires_group, supports_multi_update` — what the trainer must build or allow;
/// - `template <class Track> static constexpr bool supports_track` — tracks it can train;
/// - for a model `M` of a supported track (checked by `AlgorithmFor`):
///   - `rollout_t<M> sample(model_set<M>&, const Input&, const step_info&)`
///   - `torch::Tensor advantage(model_set<M>&, rollout_t<M>&, const torch::Tensor& rewards, const step_info&)`
///     stores the advantages in the batch and returns them (for the statistics);
///   - `loss_terms loss(model_set<M>&, const rollout_t<M>& minibatch, const step_info&)`.
/// Optional: `bool uses_reference() const` (build the reference only when true),
/// `void after_optimizer_step(model_set<M>&)` (EMA updates), `void save(torch::serialize::OutputArchive&) const`
/// and `void load(torch::serialize::InputArchive&)` for state that must survive a resume.
template <class A>
concept Algorithm = requires {
  typename A::options;
  requires options::Reflectable<typename A::options>;
  requires std::constructible_from<A, const typename A::options&>;
  { A::requires_reference } -> std::convertible_to<bool>;
  { A::requires_critic } -> std::convertible_to<bool>;
  { A::requires_ema_rollout } -> std::convertible_to<bool>;
  { A::requires_group } -> std::convertible_to<bool>;
  { A::supports_multi_update } -> std::convertible_to<bool>;
};

/// `A` can train models of `M`'s track: it computes advantages and a loss on `rollout_t<M>`.
template <class A, class M>
concept AlgorithmFor = Algorithm<A> && ModelAdapter<M> && RolloutBatch<rollout_t<M>> &&
    A::template supports_track<typename M::track> &&
    requires(A& a, model_set<M>& ms, rollout_t<M>& b, const rollout_t<M>& cb, const torch::Tensor& r,
             const step_info& info) {
      { a.advantage(ms, b, r, info) } -> std::same_as<torch::Tensor>;
      { a.loss(ms, cb, info) } -> std::same_as<loss_terms>;
    };

/// `A` can draw a rollout of `M` from `Input` (prompts, conditions, an environment).
template <class A, class M, class Input>
concept SamplesFrom = AlgorithmFor<A, M> && requires(A& a, model_set<M>& ms, Input& in, const step_info& info) {
  { a.sample(ms, in, info) } -> std::same_as<rollout_t<M>>;
};

/// An advantage estimator: rewards (and whatever else it needs) in, advantages out.
///
/// Minimal complete definition: `typename E::options` and
/// `torch::Tensor operator()(const torch::Tensor& rewards, std::int64_t group_size) const`
/// for outcome-level estimators (group-normalised, Dr.GRPO, RLOO), or the richer call an
/// algorithm documents (GAE takes values and done flags).
template <class E>
concept GroupAdvantageEstimator = requires(const E& e, const torch::Tensor& r, std::int64_t g) {
  { e(r, g) } -> std::same_as<torch::Tensor>;
};

}  // namespace unirl
