#pragma once
/// \file causal_lm.hpp
/// The `CausalLM` concept — what the token track needs from a language model — and the token
/// log-probability / entropy helpers the sampler and the losses share.
///
/// ```cpp
/// auto logits = model.logits(ids, mask);                          // (B, L, V)
/// auto [logp, ent] = unirl::models::token_logprob(logits, targets);  // (B, L) each
/// auto [lp, e] = unirl::models::update_logprob(model, batch, 1.0, true, unirl::models::update_layout::packed);
/// ```
#include <concepts>
#include <cstdint>
#include <utility>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/core/error.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/ops/logprob.hpp>
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

/// A `CausalLM` that can run sequence packing (`pack_sequences`): several sequences concatenated
/// into each row without padding. `logits_packed(ids, positions, segments)` takes (R, N) int64
/// each — positions restart at 0 for every sequence, equal segment ids mark one sequence, and a
/// token attends only to its own segment at or before it — and returns (R, N, V) equal to each
/// sequence's logits computed alone.
template <class M>
concept PackedCausalLM = CausalLM<M> && requires(const M& m, const torch::Tensor& t) {
  { m.logits_packed(t, t, t) } -> std::same_as<torch::Tensor>;
};

/// A `CausalLM` whose cache rows can be selected (prefix sharing): `select_cache(cache, index)`
/// returns a cache whose row i is row `index[i]` ((n,) int64) of `cache`, differentiably. The
/// sampler then prefills each distinct prompt once for its whole group, and the update forward
/// (`share_prompt`) runs each distinct prompt once and lets every completion attend to it.
template <class M>
concept PrefixSharingCausalLM = CausalLM<M> &&
    requires(const M& m, const typename M::cache_type& c, const torch::Tensor& index) {
      { m.select_cache(c, index) } -> std::same_as<typename M::cache_type>;
    };

/// A value model for PPO on the token track: `values(ids, mask)` gives (B, L), V of each prefix.
template <class C>
concept TokenCritic = TrainableModule<C> && requires(const C& c, const torch::Tensor& t) {
  { c.values(t, t) } -> std::same_as<torch::Tensor>;
};

/// A `TokenCritic` that can run packed sequences: `values_packed(ids, positions, segments)` (R, N).
template <class C>
concept PackedTokenCritic = TokenCritic<C> && requires(const C& c, const torch::Tensor& t) {
  { c.values_packed(t, t, t) } -> std::same_as<torch::Tensor>;
};

namespace models {

/// Log-probability of `targets` under `logits` and the entropy of each distribution, in one
/// pass (`ops::token_logprob`: fused loops on CPU, the CUDA kernels when built with them):
/// logits (..., V), targets (...) int64 -> ((...), (...)) float.
/// `temperature` divides the logits first (the sampler's distribution).
template <ExecutionPolicy Exec = exec::automatic>
std::pair<torch::Tensor, torch::Tensor> token_logprob(const torch::Tensor& logits, const torch::Tensor& targets,
                                                      double temperature = 1.0, bool with_entropy = true) {
  UNIRL_CHECK(logits.dim() == targets.dim() + 1, "token_logprob: logits ", logits.sizes(),
              " must have one more dimension than targets ", targets.sizes());
  UNIRL_CHECK(temperature > 0.0, "token_logprob: temperature = ", temperature, ": expected > 0");
  const auto x = temperature == 1.0 ? logits.to(torch::kFloat) : logits.to(torch::kFloat) / temperature;
  const auto r = ops::token_logprob<Exec>(x.reshape({-1, x.size(-1)}), targets.reshape({-1}).to(torch::kInt64));
  return {r.logp.view(targets.sizes()), with_entropy ? r.entropy.view(targets.sizes()) : torch::Tensor()};
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

/// A rollout's (prompt + completion) sequences packed into one row without padding: the real
/// tokens of sample 0, then of sample 1, ... `length()` is the sum of the real lengths.
///
/// ```cpp
/// auto p = unirl::models::pack_rollout(batch);
/// auto logits = model.logits_packed(p.ids, p.positions, p.segments);   // (1, N, V)
/// ```
struct packed_rollout {
  torch::Tensor ids;                 // (1, N) int64, the real tokens only
  torch::Tensor positions;           // (1, N) int64, restarting at 0 for every sequence
  torch::Tensor segments;            // (1, N) int64, the sample each token belongs to
  torch::Tensor completion_index;    // (C,) int64, packed index of each real completion token, in (b, t) order
  torch::Tensor completion_mask;     // (B, T) bool, where those tokens sit in the padded layout

  std::int64_t length() const { return ids.size(1); }
  /// Scatters per-completion-token values (C, ...) back to the padded layout (B, T, ...), 0 elsewhere.
  torch::Tensor unpack(const torch::Tensor& per_token) const {
    auto sizes = completion_mask.sizes().vec();
    for (std::int64_t d = 1; d < per_token.dim(); ++d) sizes.push_back(per_token.size(d));
    auto m = completion_mask;
    for (std::int64_t d = 1; d < per_token.dim(); ++d) m = m.unsqueeze(-1);
    return torch::zeros(sizes, per_token.options()).masked_scatter(m.expand(sizes), per_token);
  }
  /// Rows of a packed output (1, N, ...) that predict each completion token (the token before it): (C, ...).
  torch::Tensor predictors(const torch::Tensor& packed_out) const {
    return packed_out.select(0, 0).index_select(0, completion_index - 1);
  }
};

/// Packs a rollout (see `packed_rollout`). Every sample needs at least one real prompt token.
inline packed_rollout pack_rollout(const token_rollout& b) {
  const auto P = b.prompt_ids.size(1);
  const auto full_mask = b.full_mask() > 0;  // (B, P+T)
  UNIRL_CHECK(b.size() == 0 || (b.prompt_mask.sum(1) > 0).all().item<bool>(),
              "pack_rollout: every sample needs at least one real prompt token");
  const auto dev = b.completion_ids.device();
  const auto counts = full_mask.sum(1).to(torch::kInt64);  // (B,) real tokens per sample
  packed_rollout p;
  p.ids = b.full_ids().masked_select(full_mask).unsqueeze(0);
  const auto N = p.ids.size(1);
  const auto seg = torch::repeat_interleave(torch::arange(b.size(), torch::TensorOptions(torch::kInt64).device(dev)), counts);
  const auto starts = counts.cumsum(0) - counts;
  p.segments = seg.unsqueeze(0);
  p.positions = (torch::arange(N, torch::TensorOptions(torch::kInt64).device(dev)) - starts.index_select(0, seg))
                    .unsqueeze(0);
  const auto flat_index = (full_mask.flatten().to(torch::kInt64).cumsum(0) - 1).view(full_mask.sizes());
  p.completion_mask = b.completion_mask > 0;
  p.completion_index = flat_index.slice(1, P).masked_select(p.completion_mask);
  return p;
}

/// `completion_logprob` through sequence packing: the same (B, T) log-probabilities (and
/// entropies) under the completion mask, 0 at padded slots, from one packed forward.
template <PackedCausalLM M>
std::pair<torch::Tensor, torch::Tensor> packed_completion_logprob(const M& model, const token_rollout& b,
                                                                  double temperature = 1.0, bool with_entropy = true) {
  const auto p = pack_rollout(b);
  const auto logits = p.predictors(model.logits_packed(p.ids, p.positions, p.segments));  // (C, V)
  auto [logp, ent] = token_logprob(logits, p.ids.select(0, 0).index_select(0, p.completion_index), temperature,
                                   with_entropy);
  return {p.unpack(logp), with_entropy ? p.unpack(ent) : torch::Tensor{}};
}

/// The distinct prompts of a rollout: `ids`/`mask` (U, P) and `inverse` (B,), the distinct
/// prompt of each sample (rows of equal ids and mask are one prompt, wherever they sit).
struct distinct_prompts {
  torch::Tensor ids, mask, inverse;
  std::int64_t count() const { return ids.size(0); }
};

/// Finds the distinct prompts of `b` (see `distinct_prompts`).
inline distinct_prompts find_distinct_prompts(const token_rollout& b) {
  const auto P = b.prompt_ids.size(1);
  const auto key = torch::cat({b.prompt_ids, b.prompt_mask.to(torch::kInt64)}, 1);
  const auto [uniq, inverse, counts] = torch::unique_dim(key, 0, /*sorted=*/true, /*return_inverse=*/true);
  (void)counts;
  return {uniq.slice(1, 0, P).contiguous(), uniq.slice(1, P).to(torch::kFloat).contiguous(), inverse};
}

/// `completion_logprob` with prefix sharing: each distinct prompt runs once through the model,
/// and every completion attends to its prompt's keys and values through the cache
/// (`select_cache`), so a group of G samples costs one prompt forward instead of G. Same (B, T)
/// log-probabilities and gradients as the padded forward (to float rounding). Falls back to the
/// padded forward when no prompt repeats or a prompt row does not end with a real token.
template <PrefixSharingCausalLM M>
std::pair<torch::Tensor, torch::Tensor> shared_prompt_completion_logprob(const M& model, const token_rollout& b,
                                                                         double temperature = 1.0,
                                                                         bool with_entropy = true) {
  const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1);
  if (b.size() < 2 || P == 0 || T == 0 || !(b.prompt_mask.select(1, P - 1) > 0).all().item<bool>())
    return completion_logprob(model, b, temperature, with_entropy);
  const auto d = find_distinct_prompts(b);
  if (d.count() == b.size()) return completion_logprob(model, b, temperature, with_entropy);
  auto cache = model.make_cache(d.count(), P + T);
  const auto first = model.logits_cached(d.ids, d.mask, cache).select(1, P - 1).index_select(0, d.inverse);  // (B, V)
  torch::Tensor logits = first.unsqueeze(1);
  if (T > 1) {
    auto shared = model.select_cache(cache, d.inverse);
    const auto rest = model.logits_cached(b.completion_ids.slice(1, 0, T - 1), b.completion_mask.slice(1, 0, T - 1),
                                          shared);  // (B, T-1, V): completion token t+1 predicted at t
    logits = torch::cat({logits, rest}, 1);
  }
  return token_logprob(logits, b.completion_ids, temperature, with_entropy);
}

/// How the update forward lays out a minibatch (all give the same log-probabilities):
/// `padded` — prompt + completion rows with padding; `packed` — sequence packing
/// (`PackedCausalLM`); `shared_prompt` — each distinct prompt once (`PrefixSharingCausalLM`).
enum class update_layout { padded, packed, shared_prompt };

/// The update forward's log-probabilities in `layout`. `packed` on a model without `logits_packed`
/// gives a clear error; `shared_prompt` on a model without `select_cache` runs padded.
template <CausalLM M>
std::pair<torch::Tensor, torch::Tensor> update_logprob(const M& model, const token_rollout& b, double temperature,
                                                       bool with_entropy, update_layout layout) {
  if (layout == update_layout::packed) {
    if constexpr (PackedCausalLM<M>) return packed_completion_logprob(model, b, temperature, with_entropy);
    else
      UNIRL_CHECK(false, "pack_sequences = true: this model has no logits_packed(ids, positions, segments) ",
                  "(it is not a PackedCausalLM); set pack_sequences = false");
  }
  if constexpr (PrefixSharingCausalLM<M>)
    if (layout == update_layout::shared_prompt)
      return shared_prompt_completion_logprob(model, b, temperature, with_entropy);
  return completion_logprob(model, b, temperature, with_entropy);
}

}  // namespace models
}  // namespace unirl
