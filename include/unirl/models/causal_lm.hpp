#pragma once
/// \file causal_lm.hpp
/// The `CausalLM` concept — what the token track needs from a language model — and the token
/// log-probability / entropy helpers the sampler and the losses share.
///
/// ```cpp
/// auto logits = model.logits(ids, mask);                          // (B, L, V)
/// auto [logp, ent] = unirl::models::token_logprob(logits, targets);  // (B, L) each
/// ```
#include <concepts>
#include <cstdint>
#include <utility>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/core/error.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl {

/// A causal language model adapter of the token track.
///
/// Minimal complete definition (besides `ModelAdapter` with `track = token_track`):
/// - `torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const` — ids (B, L)
///   int64, mask (B, L) float (1 = real token; padding may sit anywhere, positions count real
///   tokens only); returns (B, L, V) next-token logits;
/// - `typename M::cache_type` and `cache_type make_cache(std::int64_t batch, std::int64_t capacity) const`;
/// - `torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, cache_type& cache) const`
///   — the next n tokens (B, n) with their mask (B, n), appended to the cache; returns (B, n, V)
///   equal to the corresponding rows of `logits` over the whole sequence so far;
/// - `std::int64_t vocab_size() const`.
template <class M>
concept CausalLM = ModelAdapter<M> && std::same_as<typename M::track, token_track> &&
    requires(const M& m, const torch::Tensor& t, typename M::cache_type& c, std::int64_t n) {
      { m.logits(t, t) } -> std::same_as<torch::Tensor>;
      { m.make_cache(n, n) } -> std::same_as<typename M::cache_type>;
      { m.logits_cached(t, t, c) } -> std::same_as<torch::Tensor>;
      { m.vocab_size() } -> std::convertible_to<std::int64_t>;
    };

/// A value model for PPO on the token track: `values(ids, mask)` gives (B, L), V of each prefix.
template <class C>
concept TokenCritic = TrainableModule<C> && requires(const C& c, const torch::Tensor& t) {
  { c.values(t, t) } -> std::same_as<torch::Tensor>;
};

namespace models {

/// Log-probability of `targets` under `logits` and the entropy of each distribution, in one
/// log-softmax pass: logits (..., V), targets (...) int64 -> ((...), (...)) float.
/// `temperature` divides the logits first (the sampler's distribution).
inline std::pair<torch::Tensor, torch::Tensor> token_logprob(const torch::Tensor& logits, const torch::Tensor& targets,
                                                             double temperature = 1.0, bool with_entropy = true) {
  UNIRL_CHECK(logits.dim() == targets.dim() + 1, "token_logprob: logits ", logits.sizes(),
              " must have one more dimension than targets ", targets.sizes());
  UNIRL_CHECK(temperature > 0.0, "token_logprob: temperature = ", temperature, ": expected > 0");
  const auto x = temperature == 1.0 ? logits.to(torch::kFloat) : logits.to(torch::kFloat) / temperature;
  const auto lsm = torch::log_softmax(x, -1);
  auto logp = lsm.gather(-1, targets.unsqueeze(-1).to(torch::kInt64)).squeeze(-1);
  torch::Tensor ent;
  if (with_entropy) ent = -(lsm.exp() * lsm).sum(-1);
  return {logp, ent};
}

/// Log-probabilities (and entropies) of a rollout's completion tokens under `model`, computed
/// with the full forward over prompt + completion (the training geometry): (B, T) each.
template <CausalLM M>
std::pair<torch::Tensor, torch::Tensor> completion_logprob(const M& model, const token_rollout& b,
                                                           double temperature = 1.0, bool with_entropy = true) {
  const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1);
  const auto ids = b.full_ids(), mask = b.full_mask();
  // Logits at position i predict token i+1: completion token t is predicted at P-1+t.
  const auto logits = model.logits(ids.slice(1, 0, P + T - 1), mask.slice(1, 0, P + T - 1)).slice(1, P - 1, P + T - 1);
  return token_logprob(logits, b.completion_ids, temperature, with_entropy);
}

}  // namespace models
}  // namespace unirl
