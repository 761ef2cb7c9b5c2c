#pragma once
/// \file token_common.hpp
/// What every token-track algorithm does around the sampler: draw completions, recompute the
/// pi_old log-probabilities at the training geometry (so an on-policy first update has ratio
/// exactly 1), and score them under the reference model when there is one.
///
/// ```cpp
/// auto batch = unirl::algo::sample_for_update(models, prompts, info, opts.sampling, true);
/// ```
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/core/batch.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/lora_guard.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/rollout/engine_sampler.hpp>
#include <unirl/rollout/partial.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_logprob.hpp>
#include <unirl/rollout/token_sampler.hpp>

namespace unirl::algo {

/// Sampling settings that cannot work with `model`, rejected when a trainer is built (through an
/// algorithm's `check_model` hook, concepts/algorithm.hpp) rather than at the first step:
/// completions as long as the model's context (`max_length()`), stop tokens outside its
/// vocabulary. `key` is where the options sit (e.g. "algorithm.sampling."); throws `config_error`.
template <class M>
void check_sampling_against_model(const sampling_options& s, const M& model, const std::string& key) {
  if constexpr (requires { { model.max_length() } -> std::convertible_to<std::int64_t>; }) {
    const std::int64_t L = model.max_length();
    if (s.max_new_tokens >= L)
      throw config_error(key + "max_new_tokens",
                         unirl::detail::concat("value ", s.max_new_tokens, " leaves no room for a prompt in the model's ",
                                               "context of max_length() = ", L, " tokens; expected < ", L));
  }
  if constexpr (requires { { model.vocab_size() } -> std::convertible_to<std::int64_t>; }) {
    const std::int64_t V = model.vocab_size();
    for (const auto t : s.stop_tokens)
      if (t < 0 || t >= V)
        throw config_error(key + "stop_tokens", unirl::detail::concat("token id ", t, " is outside the model's vocabulary of ",
                                                                      V, " tokens; expected ids in [0, ", V, ")"));
  }
}

/// The longest prompt of `in` plus `max_new_tokens` must fit the model's context; checked before
/// sampling (an algorithm's `check_input` hook). `key` as for `check_sampling_against_model`.
template <class M>
void check_prompt_lengths(const sampling_options& s, const M& model, const prompt_batch& in, const std::string& key) {
  if constexpr (requires { { model.max_length() } -> std::convertible_to<std::int64_t>; }) {
    const std::int64_t L = model.max_length(), T = s.max_new_tokens;
    for (std::size_t i = 0; i < in.tokens.size(); ++i) {
      const auto P = static_cast<std::int64_t>(in.tokens[i].size());
      UNIRL_CHECK(P + T <= L, "trainer::step: prompt ", i, " has ", P, " tokens; with ", key, "max_new_tokens = ", T,
                  " that makes ", P + T, ", more than the model's max_length() = ", L,
                  ": shorten the prompts to at most ", L - T, " tokens or lower max_new_tokens");
    }
  }
}

/// `rollout::update_logprob(model, batch, temperature, false, layout).first` without gradients,
/// `chunk` sequences at a time (0: all at once) and on the model's own device: each chunk's rows
/// are moved there and its log-probs back to the batch's device. How a reference kept on the CPU
/// (trainer option `memory.reference_device`) scores a rollout sampled on an accelerator, and
/// how the no-grad forwards of a large batch stay within memory. (B, T) float.
template <ExecutionPolicy Exec = exec::automatic, CausalLM M>
torch::Tensor chunked_logprob(const M& model, const token_rollout& batch, double temperature,
                              rollout::update_layout layout, std::int64_t chunk = 0) {
  torch::NoGradGuard ng;
  const std::int64_t n = batch.size();
  const torch::Device home = batch.completion_ids.device();
  torch::Device where = home;
  if constexpr (requires { { model.device() } -> std::convertible_to<torch::Device>; }) where = model.device();
  if (n == 0 || ((chunk <= 0 || chunk >= n) && where == home))
    return rollout::update_logprob<Exec>(model, batch, temperature, false, layout).first;
  const std::int64_t step = chunk > 0 ? chunk : n;
  std::vector<torch::Tensor> parts;
  for (std::int64_t lo = 0; lo < n; lo += step) {
    const auto idx = torch::arange(lo, std::min(n, lo + step), torch::TensorOptions(torch::kInt64).device(home));
    const token_rollout part = batch::to(batch.select(idx), where);
    parts.push_back(rollout::update_logprob<Exec>(model, part, temperature, false, layout).first.to(home));
  }
  return torch::cat(parts, 0);
}

/// `info.group_size` completions per prompt: through the rollout engine when `s.engine` (the
/// default) and the model is a `PagedCausalLM`, else the static batch of `sample_tokens` (a model
/// without the paged forward is chosen at compile time and always samples there). The engine's
/// figures go to the step statistics (host counts, no device read; summed over a step's draws,
/// peaks the largest): `engine/steps`, `engine/peak_blocks`, `engine/peak_kv_bytes`,
/// `engine/prefix_hit_tokens`, `engine/preemptions`. With `info.partial` (partial rollouts,
/// rollout/partial.hpp) the groups come from its engine, which carries groups in flight across
/// draws and weight versions, and its figures go there too: `partial/carried_groups`,
/// `partial/restarted_groups`, `partial/mixed_samples`, `partial/version_changes`,
/// `partial/in_flight_groups`, `partial/oldest_version`.
template <CausalLM M>
token_rollout draw_completions(const M& model, const prompt_batch& input, const step_info& info,
                               const sampling_options& s) {
  rollout::engine_summary sum;
  token_rollout batch;
  if (info.partial) {
    if constexpr (PagedCausalLM<M>) {
      batch = info.partial->draw(model, input, info.group_size, s, info.device, &sum);
      if (info.extra) {
        const auto& f = info.partial->last();
        auto& x = *info.extra;
        x["partial/carried_groups"] += static_cast<double>(f.carried_groups);
        x["partial/restarted_groups"] += static_cast<double>(f.restarted_groups);
        x["partial/mixed_samples"] += static_cast<double>(f.mixed_samples);
        x["partial/version_changes"] += static_cast<double>(f.version_changes);
        x["partial/in_flight_groups"] = static_cast<double>(f.in_flight_groups);
        const auto oldest = static_cast<double>(f.oldest_version);
        x["partial/oldest_version"] = x.contains("partial/oldest_version") ? std::min(x["partial/oldest_version"], oldest)
                                                                            : oldest;
      }
    } else {
      UNIRL_CHECK(false, "partial rollouts need a model with the paged forward (PagedCausalLM, concepts/causal_lm.hpp); "
                         "this model samples through sample_tokens only");
    }
  } else {
    batch = rollout::sample_completions(model, input, info.group_size, s, info.device, &sum);
  }
  if (sum.steps > 0 && info.extra) {  // summed over a step's draws (dynamic sampling draws again), peaks the largest
    auto& x = *info.extra;
    x["engine/steps"] += static_cast<double>(sum.steps);
    x["engine/prefix_hit_tokens"] += static_cast<double>(sum.prefix_hit_tokens);
    x["engine/preemptions"] += static_cast<double>(sum.preemptions);
    x["engine/peak_blocks"] = std::max(x["engine/peak_blocks"], static_cast<double>(sum.peak_blocks));
    x["engine/peak_kv_bytes"] = std::max(x["engine/peak_kv_bytes"], static_cast<double>(sum.peak_kv_bytes));
  }
  return batch;
}

/// Samples `info.group_size` completions per prompt with the policy, then (optionally) replaces
/// the sampler's log-probabilities by the training forward's — laid out as the update will lay
/// it out, so an on-policy first update sees ratio exactly 1 — and fills `ref_logp` when the
/// model set holds a reference. Reports `sampler_logp_max_diff` (train/inference mismatch, read
/// with the step's statistics). `Exec` is the execution policy of the log-prob op.
template <ExecutionPolicy Exec = exec::automatic, CausalLM M>
token_rollout sample_for_update(model_set<M>& models, const prompt_batch& input, const step_info& info,
                                const sampling_options& s, bool recompute_old_logp,
                                rollout::update_layout layout = rollout::update_layout::padded) {
  torch::NoGradGuard ng;
  token_rollout batch = draw_completions(models.policy, input, info, s);
  const auto mask = batch.completion_mask;
  if (recompute_old_logp) {
    const torch::Tensor lp =
        chunked_logprob<Exec>(models.policy, batch, s.temperature, layout, info.logprob_chunk) * mask;
    info.report("sampler_logp_max_diff", (lp - batch.old_logp).abs().max());
    batch.old_logp = lp;
  }
  if (models.reference) {
    const lora::disabled_guard base;  // a policy with LoRA adapters is its own reference, adapters off
    batch.ref_logp =
        chunked_logprob<Exec>(*models.reference, batch, s.temperature, layout, info.logprob_chunk) * mask;
  }
  return batch;
}

/// The DAPO soft overlong penalty for completions of `lengths` tokens (docs/algorithms/grpo.md):
/// 0 up to `max_len - buffer`, then `((max_len - buffer) - L) / buffer` down to -1 at `max_len`,
/// -1 beyond. (B,) in `dtype` (a floating type).
inline torch::Tensor overlong_penalty(const torch::Tensor& lengths, std::int64_t max_len, std::int64_t buffer,
                                      torch::ScalarType dtype = torch::kFloat) {
  UNIRL_CHECK(buffer > 0 && buffer <= max_len, "overlong_penalty: buffer = ", buffer, ": expected in [1, max_len = ",
              max_len, "]");
  UNIRL_CHECK(c10::isFloatingType(dtype), "overlong_penalty: dtype ", dtype, ": expected a floating type");
  const auto L = lengths.to(dtype);
  const double start = static_cast<double>(max_len - buffer);
  auto p = (start - L) / static_cast<double>(buffer);
  p = torch::where(L <= start, torch::zeros_like(p), p);
  return torch::where(L > static_cast<double>(max_len), torch::full_like(p, -1.0), p);
}

}  // namespace unirl::algo
