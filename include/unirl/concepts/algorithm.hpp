#pragma once
/// \file algorithm.hpp
/// Algorithms: each owns the sample, advantage and loss stages for the tracks it can train.
#include <concepts>
#include <type_traits>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/concepts/options.hpp>
#include <unirl/concepts/rollout.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>

namespace unirl {

namespace detail {
// A track no algorithm trains: `Algorithm` asks `supports_track` about it to check the member exists.
struct unknown_track {};

template <class A, class Track>
struct algorithm_for_track {
  using type = A;
};
template <class A, class Track>
  requires requires { typename A::template for_track<Track>; }
struct algorithm_for_track<A, Track> {
  using type = typename A::template for_track<Track>;
};
template <class A, class M>
struct algorithm_for {
  using type = A;
};
template <class A, class M>
  requires requires { typename M::track; }
struct algorithm_for<A, M> {
  using type = typename algorithm_for_track<A, typename M::track>::type;
};
}  // namespace detail

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
/// For gradient accumulation (trainer option `micro_batch_size`): `torch::Tensor
/// loss_normaliser(const rollout_t<M>&) const` — what the loss of a batch divides by (its valid
/// tokens under token_mean, its sequences otherwise; without it, its samples): micro-batch i's loss
/// weighs n_i / sum_j n_j — and `rollout_t<M> prepare_minibatch(const rollout_t<M>&) const`, the
/// minibatch with the statistics its micro-batches must share taken over all of it (PPO's advantage
/// whitening); `loss` sees `step_info::micro_batches > 1` then.
/// Checks of its settings (the trainer names no algorithm's options): `void check_model(const M&
/// model, const std::string& key) const` — settings that cannot work with the model, checked when
/// the trainer is built (e.g. GRPO's `sampling.max_new_tokens` against `max_length()`), throwing
/// `config_error` under `key` + the option's name (the trainer passes "algorithm."); and `void
/// check_input(const M& model, const Input& input, const std::string& key) const` — an input that
/// cannot work, checked before each sampling (prompts longer than the context allows).
///
/// A *family* of algorithms whose options depend on the track (`algo::ppo<>`: each track nests its
/// own options) is not itself an `Algorithm`: it declares `template <class Track> using for_track`,
/// the `Algorithm` for one track, and the trainer builds `algorithm_for_t<A, M>`.
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
  { A::template supports_track<detail::unknown_track> } -> std::convertible_to<bool>;
};

/// The algorithm a trainer builds from `A` for models of `M`: `A::for_track<M::track>` when `A`
/// is a family (see `Algorithm`), else `A` itself.
template <class A, class M>
using algorithm_for_t = typename detail::algorithm_for<A, M>::type;

/// `A` (or, for a family, `algorithm_for_t<A, M>`) can train models of `M`'s track: it computes
/// advantages and a loss on `rollout_t<M>`.
template <class A, class M>
concept AlgorithmFor = ModelAdapter<M> && Algorithm<algorithm_for_t<A, M>> && RolloutBatch<rollout_t<M>> &&
    algorithm_for_t<A, M>::template supports_track<typename M::track> &&
    requires(algorithm_for_t<A, M>& a, model_set<M>& ms, rollout_t<M>& b, const rollout_t<M>& cb,
             const torch::Tensor& r, const step_info& info) {
      { a.advantage(ms, b, r, info) } -> std::same_as<torch::Tensor>;
      { a.loss(ms, cb, info) } -> std::same_as<loss_terms>;
    };

/// `A` (or `algorithm_for_t<A, M>`) can draw a rollout of `M` from `Input` (prompts, conditions,
/// an environment).
template <class A, class M, class Input>
concept SamplesFrom = AlgorithmFor<A, M> &&
    requires(algorithm_for_t<A, M>& a, model_set<M>& ms, Input& in, const step_info& info) {
      { a.sample(ms, in, info) } -> std::same_as<rollout_t<M>>;
    };

/// An advantage estimator: rewards (and whatever else it needs) in, advantages out.
///
/// Minimal complete definition (outcome-level estimators: group-normalised, Dr.GRPO, RLOO):
/// `torch::Tensor operator()(const torch::Tensor& rewards, std::int64_t group_size) const`,
/// rewards (B*G,) grouped contiguously -> advantages (B*G,). Optionally the call takes the
/// execution policy as its first template argument (`algo::estimate<Exec>(e, r, G)` passes it).
template <class E>
concept GroupAdvantageEstimator = requires(const E& e, const torch::Tensor& r, std::int64_t g) {
  { e(r, g) } -> std::same_as<torch::Tensor>;
};

}  // namespace unirl
