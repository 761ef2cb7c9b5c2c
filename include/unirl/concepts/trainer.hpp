#pragma once
/// \file trainer.hpp
/// What the slots of `unirl::trainer<Model, Algorithm, Reward, Parallel>` must model, checked one
/// by one so that a type that fails names the missing member at the trainer's declaration
/// (pinned by the compile-fail tests): `trainer_slots_checked<...>` is true or does not compile.
///
/// ```cpp
/// static_assert(unirl::trainer_slots_checked<my_model, unirl::algo::grpo<>, my_reward, unirl::parallel::single_device>);
/// ```
#include <concepts>
#include <cstdint>
#include <type_traits>

#include <torch/torch.h>

#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/concepts/parallel.hpp>
#include <unirl/concepts/reward.hpp>
#include <unirl/concepts/rollout.hpp>
#include <unirl/concepts/track.hpp>

namespace unirl {

namespace detail {
// What a token-track model lacks of CausalLM, member by member (the trainer names the first).
template <class M>
inline constexpr bool on_token_track = requires { requires std::is_same_v<typename M::track, token_track>; };
template <class M>
inline constexpr bool lm_has_cache_type = requires { typename M::cache_type; };
template <class M>
inline constexpr bool lm_has_make_cache = requires(const M& m, std::int64_t n) {
  { m.make_cache(n, n) } -> std::same_as<typename M::cache_type>;
};
template <class M>
inline constexpr bool lm_has_logits_cached = requires(const M& m, const torch::Tensor& t, typename M::cache_type& c) {
  { m.logits_cached(t, t, c) } -> std::same_as<torch::Tensor>;
};
template <class M>
inline constexpr bool lm_has_logits = requires(const M& m, const torch::Tensor& t) {
  { m.logits(t, t) } -> std::same_as<torch::Tensor>;
};
template <class M>
inline constexpr bool lm_has_vocab_size = requires(const M& m) {
  { m.vocab_size() } -> std::convertible_to<std::int64_t>;
};
}  // namespace detail

namespace detail {
// The checks, in the order a user meets them: the model, then the algorithm for its track, the
// reward for its rollout batch and the parallel strategy.
template <class Model, class Algorithm, class Reward, class Parallel>
struct trainer_slot_checks {
  static_assert(TrainableModule<Model>,
                "unirl::trainer: Model does not model TrainableModule: it needs parameters(), named_parameters(), "
                "named_buffers(), clone(), train(bool) and to(torch::Device) (see unirl::models::module_adapter)");
  static_assert(ModelAdapter<Model>,
                "unirl::trainer: Model does not model ModelAdapter: it needs a `track` member type with a "
                "`rollout_type` (token_track, flow_track, env_track or a track of your own)");
  static_assert(!detail::on_token_track<Model> || detail::lm_has_logits<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks "
                "`torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const`");
  static_assert(!detail::on_token_track<Model> || detail::lm_has_cache_type<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks the "
                "KV-cache member type `cache_type`");
  static_assert(!detail::on_token_track<Model> || !detail::lm_has_cache_type<Model> ||
                    detail::lm_has_make_cache<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks the "
                "KV-cache member `cache_type make_cache(std::int64_t batch, std::int64_t capacity) const`");
  static_assert(!detail::on_token_track<Model> || !detail::lm_has_cache_type<Model> ||
                    detail::lm_has_logits_cached<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks the "
                "KV-cache member `torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, "
                "cache_type& cache) const`");
  static_assert(!detail::on_token_track<Model> || detail::lm_has_vocab_size<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks "
                "`std::int64_t vocab_size() const`");

  using algorithm_type = algorithm_for_t<Algorithm, Model>;
  static_assert(::unirl::Algorithm<algorithm_type>,
                "unirl::trainer: Algorithm does not model unirl::Algorithm: it needs `options`, a constructor "
                "from options, the requires_* flags and supports_track (see concepts/algorithm.hpp)");
  static_assert(AlgorithmFor<Algorithm, Model>,
                "unirl::trainer: Algorithm does not model AlgorithmFor<Algorithm, Model>: it cannot train this "
                "model's track (supports_track, advantage(...) and loss(...) on rollout_t<Model>)");
  static_assert(RewardFor<Reward, rollout_t<Model>>,
                "unirl::trainer: Reward does not model RewardFor<Reward, rollout_t<Model>>: it must be callable "
                "on the model's rollout batch and return torch::Tensor (one score per sample)");
  static_assert(ParallelStrategy<Parallel>,
                "unirl::trainer: Parallel does not model ParallelStrategy (see concepts/parallel.hpp)");

  static constexpr bool value = true;
};
}  // namespace detail

/// True when `Model`, `Algorithm`, `Reward` and `Parallel` can compose a `unirl::trainer`; a
/// slot that cannot fails to compile with a message naming the concept and the missing member.
template <class Model, class Algorithm, class Reward, class Parallel>
inline constexpr bool trainer_slots_checked = detail::trainer_slot_checks<Model, Algorithm, Reward, Parallel>::value;

}  // namespace unirl
