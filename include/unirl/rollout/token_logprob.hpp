#pragma once
/// \file token_logprob.hpp
/// Token log-probabilities and entropies under a `CausalLM`, shared by the sampler and the
/// losses: from logits in one pass (`token_logprob`), and of a rollout's completion tokens at
/// the training geometry in each update layout (padded, packed, shared prompt).
///
/// ```cpp
/// auto logits = model.logits(ids, mask);                             // (B, L, V)
/// auto [logp, ent] = unirl::rollout::token_logprob(logits, targets); // (B, L) each
/// auto [lp, e] = unirl::rollout::update_logprob(model, batch, 1.0, true, unirl::rollout::update_layout::packed);
/// ```
/// A `HiddenStateCausalLM` (e.g. `models::hf::causal_lm`) never materialises the (B, T, V) logits
/// here: its head runs in row chunks through `ops::linear_logprob` (`head_logprob`).
/// The names are also reachable as `unirl::models::token_logprob` etc. (their former home).
#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>
#include <string_view>
#include <utility>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/ops/logprob.hpp>
#include <unirl/rollout/packing.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::rollout {

/// Log-probability of `targets` under `logits` and the entropy of each distribution, in one
/// pass (`ops::token_logprob`: fused loops on CPU, the CUDA kernels when built with them):
/// logits (..., V), targets (...) int64 -> ((...), (...)) in `ops::logprob_dtype` of the logits
/// (float64 logits give float64 results; float32, float16, bfloat16 give float32).
/// `temperature` divides the logits first (the sampler's distribution; 0, greedy, records the
/// log-probs at temperature 1, as `top_k = 1` does).
template <ExecutionPolicy Exec = exec::automatic>
std::pair<torch::Tensor, torch::Tensor> token_logprob(const torch::Tensor& logits, const torch::Tensor& targets,
                                                      double temperature = 1.0, bool with_entropy = true) {
  UNIRL_CHECK(logits.dim() == targets.dim() + 1, "token_logprob: logits ", logits.sizes(),
              " must have one more dimension than targets ", targets.sizes());
  UNIRL_CHECK(temperature >= 0.0, "token_logprob: temperature = ", temperature, ": expected >= 0 (0 = greedy)");
  if (temperature == 0.0) temperature = 1.0;
  const auto dtype = ops::logprob_dtype(logits.scalar_type());
  const auto x = temperature == 1.0 ? logits.to(dtype) : logits.to(dtype) / temperature;
  const auto r = ops::token_logprob<Exec>(x.reshape({-1, x.size(-1)}), targets.reshape({-1}).to(torch::kInt64));
  return {r.logp.view(targets.sizes()), with_entropy ? r.entropy.view(targets.sizes()) : torch::Tensor()};
}

/// Rows per chunk of the LM head in `head_logprob`: about 2^25 logits (128 MB in float) at a time.
inline std::int64_t lm_head_chunk_rows(std::int64_t vocab) {
  return std::max<std::int64_t>(1, (std::int64_t{1} << 25) / std::max<std::int64_t>(vocab, 1));
}

/// Whether the update's log-probs take the hidden states of `model`: a `HiddenStateCausalLM` with
/// float32 or float64 weights (other dtypes keep the materialised logits, upcast to float32).
template <CausalLM M>
bool uses_hidden_states(const M& model) {
  if constexpr (HiddenStateCausalLM<M>) {
    const auto t = model.lm_head_weight().scalar_type();
    return t == torch::kFloat || t == torch::kDouble;
  } else {
    return false;
  }
}

/// `token_logprob(hidden @ weight^T, targets, temperature)` without the logits: the LM head and
/// the log-softmax run `chunk` rows at a time (0: `lm_head_chunk_rows(V)`; `ops::linear_logprob`),
/// forward and backward. hidden (..., D), weight (V, D), targets (...) int64 -> ((...), (...)) in
/// the hidden states' floating type.
inline std::pair<torch::Tensor, torch::Tensor> head_logprob(const torch::Tensor& hidden, const torch::Tensor& weight,
                                                            const torch::Tensor& targets, double temperature = 1.0,
                                                            bool with_entropy = true, std::int64_t chunk = 0) {
  UNIRL_CHECK(hidden.dim() == targets.dim() + 1, "head_logprob: hidden ", hidden.sizes(),
              " must have one more dimension than targets ", targets.sizes());
  UNIRL_CHECK(temperature >= 0.0, "head_logprob: temperature = ", temperature, ": expected >= 0 (0 = greedy)");
  if (temperature == 0.0) temperature = 1.0;  // greedy: as token_logprob
  const auto h32 = upcast(hidden);  // the head and log-softmax in float32 (under autocast too)
  const auto h = temperature == 1.0 ? h32 : h32 / temperature;  // (h W^T) / t = (h / t) W^T
  const auto r = ops::linear_logprob(h.reshape({-1, h.size(-1)}), weight, targets.reshape({-1}).to(torch::kInt64),
                                     chunk > 0 ? chunk : lm_head_chunk_rows(weight.size(0)));
  return {r.logp.view(targets.sizes()), with_entropy ? r.entropy.view(targets.sizes()) : torch::Tensor()};
}

/// Log-probabilities (and entropies) of a rollout's completion tokens under `model`, computed
/// with the full forward over prompt + completion (the training geometry): (B, T) each. A
/// `HiddenStateCausalLM` runs its head on the completion positions only, in chunks (`head_logprob`).
template <ExecutionPolicy Exec = exec::automatic, CausalLM M>
std::pair<torch::Tensor, torch::Tensor> completion_logprob(const M& model, const token_rollout& b,
                                                           double temperature = 1.0, bool with_entropy = true) {
  const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1);
  const auto ids = b.full_ids(), mask = b.full_mask();
  if constexpr (HiddenStateCausalLM<M>)
    if (uses_hidden_states(model)) {
      const auto h = model.hidden_states(ids.slice(1, 0, P + T - 1), mask.slice(1, 0, P + T - 1)).slice(1, P - 1);
      return head_logprob(h, model.lm_head_weight(), b.completion_ids, temperature, with_entropy);
    }
  // Logits at position i predict token i+1: completion token t is predicted at P-1+t.
  const auto logits = model.logits(ids.slice(1, 0, P + T - 1), mask.slice(1, 0, P + T - 1)).slice(1, P - 1, P + T - 1);
  return token_logprob<Exec>(logits, b.completion_ids, temperature, with_entropy);
}

/// `completion_logprob` through sequence packing: the same (B, T) log-probabilities (and
/// entropies) under the completion mask, 0 at padded slots, from one packed forward.
template <ExecutionPolicy Exec = exec::automatic, PackedCausalLM M>
std::pair<torch::Tensor, torch::Tensor> packed_completion_logprob(const M& model, const token_rollout& b,
                                                                  double temperature = 1.0, bool with_entropy = true) {
  const auto p = pack_rollout(b);
  if constexpr (HiddenStateCausalLM<M> && requires(const M& m, const torch::Tensor& t) {
                  { m.hidden_states_packed(t, t, t) } -> std::same_as<torch::Tensor>;
                })
    if (uses_hidden_states(model)) {
      const auto h = p.predictors(model.hidden_states_packed(p.ids, p.positions, p.segments));  // (C, D)
      auto [logp, ent] = head_logprob(h, model.lm_head_weight(), p.ids.select(0, 0).index_select(0, p.completion_index),
                                      temperature, with_entropy);
      return {p.unpack(logp), with_entropy ? p.unpack(ent) : torch::Tensor{}};
    }
  const auto logits = p.predictors(model.logits_packed(p.ids, p.positions, p.segments));  // (C, V)
  auto [logp, ent] = token_logprob<Exec>(logits, p.ids.select(0, 0).index_select(0, p.completion_index),
                                         temperature, with_entropy);
  return {p.unpack(logp), with_entropy ? p.unpack(ent) : torch::Tensor{}};
}

/// Whether every prompt row of `b` ends with a real token (its last prompt column is real): from
/// the host lengths of a sampled batch (left-padded prompts of at least one token) without a
/// device read, else one read of that column.
inline bool prompts_end_with_real_tokens(const token_rollout& b) {
  if (b.prompt_mask.size(1) == 0) return false;
  if (b.has_host_lengths())
    return std::all_of(b.host_prompt_lengths.begin(), b.host_prompt_lengths.end(),
                       [](std::int64_t l) { return l > 0; });
  return to_host((b.prompt_mask.select(1, b.prompt_mask.size(1) - 1) > 0).all()).at(0) != 0.0;
}

/// `completion_logprob` with prefix sharing: each distinct prompt runs once through the model,
/// and every completion attends to its prompt's keys and values through the cache
/// (`select_cache`), so a group of G samples costs one prompt forward instead of G. Same (B, T)
/// log-probabilities and gradients as the padded forward (to float rounding). Falls back to the
/// padded forward when no prompt repeats or a prompt row does not end with a real token.
template <ExecutionPolicy Exec = exec::automatic, PrefixSharingCausalLM M>
std::pair<torch::Tensor, torch::Tensor> shared_prompt_completion_logprob(const M& model, const token_rollout& b,
                                                                         double temperature = 1.0,
                                                                         bool with_entropy = true) {
  const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1);
  if (b.size() < 2 || P == 0 || T == 0 || !prompts_end_with_real_tokens(b))
    return completion_logprob<Exec>(model, b, temperature, with_entropy);
  const auto d = find_distinct_prompts(b);
  if (d.count() == b.size()) return completion_logprob<Exec>(model, b, temperature, with_entropy);
  auto cache = model.make_cache(d.count(), P + T);
  if constexpr (HiddenStateCausalLM<M> && requires(const M& m, const torch::Tensor& t, typename M::cache_type& c) {
                  { m.hidden_states_cached(t, t, c) } -> std::same_as<torch::Tensor>;
                })
    if (uses_hidden_states(model)) {  // the same, on hidden states (B, T, D), then the chunked head
      torch::Tensor h = model.hidden_states_cached(d.ids, d.mask, cache).select(1, P - 1).index_select(0, d.inverse);
      h = h.unsqueeze(1);
      if (T > 1) {
        auto shared = model.select_cache(cache, d.inverse);
        h = torch::cat({h, model.hidden_states_cached(b.completion_ids.slice(1, 0, T - 1),
                                                      b.completion_mask.slice(1, 0, T - 1), shared)},
                       1);
      }
      return head_logprob(h, model.lm_head_weight(), b.completion_ids, temperature, with_entropy);
    }
  const auto first = model.logits_cached(d.ids, d.mask, cache).select(1, P - 1).index_select(0, d.inverse);  // (B, V)
  torch::Tensor logits = first.unsqueeze(1);
  if (T > 1) {
    auto shared = model.select_cache(cache, d.inverse);
    const auto rest = model.logits_cached(b.completion_ids.slice(1, 0, T - 1), b.completion_mask.slice(1, 0, T - 1),
                                          shared);  // (B, T-1, V): completion token t+1 predicted at t
    logits = torch::cat({logits, rest}, 1);
  }
  return token_logprob<Exec>(logits, b.completion_ids, temperature, with_entropy);
}

/// How the update forward lays out a minibatch (all give the same log-probabilities; a
/// `HiddenStateCausalLM` runs its LM head in chunks in each):
/// `padded` — prompt + completion rows with padding; `packed` — sequence packing
/// (`PackedCausalLM`); `shared_prompt` — each distinct prompt once (`PrefixSharingCausalLM`).
enum class update_layout { padded, packed, shared_prompt };

}  // namespace unirl::rollout

template <>
inline constexpr std::array unirl::enum_names<unirl::rollout::update_layout>{
    std::string_view{"padded"}, std::string_view{"packed"}, std::string_view{"shared_prompt"}};

namespace unirl::rollout {

/// The update forward's log-probabilities in `layout`. `packed` on a model without `logits_packed`
/// gives a clear error; `shared_prompt` on a model without `select_cache` runs padded. `Exec` is
/// the execution policy of the log-prob op (the model's own forward keeps `exec::automatic`).
template <ExecutionPolicy Exec = exec::automatic, CausalLM M>
std::pair<torch::Tensor, torch::Tensor> update_logprob(const M& model, const token_rollout& b, double temperature,
                                                       bool with_entropy, update_layout layout) {
  if (layout == update_layout::packed) {
    if constexpr (PackedCausalLM<M>) return packed_completion_logprob<Exec>(model, b, temperature, with_entropy);
    else
      UNIRL_CHECK(false, "layout = packed (formerly pack_sequences = true): this model has no ",
                  "logits_packed(ids, positions, segments) (it is not a PackedCausalLM); use layout = padded");
  }
  if constexpr (PrefixSharingCausalLM<M>)
    if (layout == update_layout::shared_prompt)
      return shared_prompt_completion_logprob<Exec>(model, b, temperature, with_entropy);
  return completion_logprob<Exec>(model, b, temperature, with_entropy);
}

}  // namespace unirl::rollout

namespace unirl::models {
// Former home of these names (models/causal_lm.hpp); kept so existing code compiles unchanged.
using rollout::completion_logprob;
using rollout::head_logprob;
using rollout::packed_completion_logprob;
using rollout::shared_prompt_completion_logprob;
using rollout::token_logprob;
using rollout::update_layout;
using rollout::update_logprob;
}  // namespace unirl::models
