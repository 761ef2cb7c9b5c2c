#pragma once
/// \file token_common.hpp
/// What every token-track algorithm does around the sampler: draw completions, recompute the
/// pi_old log-probabilities at the training geometry (so an on-policy first update has ratio
/// exactly 1), and score them under the reference model when there is one.
///
/// ```cpp
/// auto batch = unirl::algo::sample_for_update(models, prompts, info, opts.sampling, true);
/// ```
#include <cstdint>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/core/context.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_logprob.hpp>
#include <unirl/rollout/token_sampler.hpp>

namespace unirl::algo {

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
  token_rollout batch = sample_tokens(models.policy, input, info.group_size, s, info.device);
  const auto mask = batch.completion_mask;
  if (recompute_old_logp) {
    const torch::Tensor lp =
        rollout::update_logprob<Exec>(models.policy, batch, s.temperature, false, layout).first * mask;
    info.report("sampler_logp_max_diff", (lp - batch.old_logp).abs().max());
    batch.old_logp = lp;
  }
  if (models.reference)
    batch.ref_logp =
        rollout::update_logprob<Exec>(*models.reference, batch, s.temperature, false, layout).first * mask;
  return batch;
}

/// The DAPO soft overlong penalty for completions of `lengths` tokens (docs/algorithms/grpo.md):
/// 0 up to `max_len - buffer`, then falling linearly to -1 at `max_len`, -1 beyond. (B,) float.
inline torch::Tensor overlong_penalty(const torch::Tensor& lengths, std::int64_t max_len, std::int64_t buffer) {
  UNIRL_CHECK(buffer > 0 && buffer <= max_len, "overlong_penalty: buffer = ", buffer, ": expected in [1, max_len = ",
              max_len, "]");
  const auto L = lengths.to(torch::kFloat);
  const double start = static_cast<double>(max_len - buffer);
  auto p = (start - L) / static_cast<double>(buffer);
  p = torch::where(L <= start, torch::zeros_like(p), p);
  return torch::where(L > static_cast<double>(max_len), torch::full_like(p, -1.0), p);
}

}  // namespace unirl::algo
