#pragma once
/// \file token.hpp
/// The token track (LLM, VLM): `token_track`, its rollout batch `token_rollout`, and the prompt
/// input `prompt_batch` that `step()` takes.
///
/// ```cpp
/// unirl::prompt_batch in{.tokens = {{1, 2, 3}}, .texts = {"1+2="}, .references = {"3"}};
/// auto stats = trainer.step(in);      // samples group_size completions per prompt
/// // rewards read the decoded text:   batch.completions[i], batch.references[i]
/// ```
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/rollout.hpp>
#include <unirl/core/error.hpp>

namespace unirl {

struct token_rollout;

/// Track tag of causal language models (and VLMs): rollouts are `token_rollout`.
struct token_track {
  using rollout_type = token_rollout;
};

/// Turns completion token ids back into text (a tokenizer's decode).
using token_decoder = std::function<std::string(const std::vector<std::int64_t>&)>;

/// The input of one token-track step: prompts as token ids, with optional text and per-prompt
/// ground truth that the rollout carries for rewards.
struct prompt_batch {
  std::vector<std::vector<std::int64_t>> tokens;  // one token sequence per prompt (no padding)
  std::vector<std::string> texts{};               // optional: the prompts as text
  std::vector<std::string> references{};          // optional: ground truth per prompt (e.g. "42")
  token_decoder decode{};                         // optional: fills token_rollout::completions
  std::int64_t pad_id = 0;                        // id written into padded slots (never attended)

  std::int64_t size() const { return static_cast<std::int64_t>(tokens.size()); }
};

/// A batch of sampled completions: B = prompts x group_size sequences, grouped contiguously
/// (samples [g*G, (g+1)*G) share prompt g). Prompts are left-padded, completions right-padded.
struct token_rollout {
  torch::Tensor prompt_ids;       // (B, P) int64, left-padded
  torch::Tensor prompt_mask;      // (B, P) float, 1 = real prompt token
  torch::Tensor completion_ids;   // (B, T) int64, right-padded
  torch::Tensor completion_mask;  // (B, T) float, 1 = generated token (a stop token included)
  torch::Tensor old_logp;         // (B, T) float, log pi_old of each completion token (the sampler's)
  torch::Tensor ref_logp{};       // (B, T) float, reference log-probs; undefined when no reference
  torch::Tensor values{};         // (B, T) float, critic values at rollout time (PPO)
  torch::Tensor returns{};        // (B, T) float, GAE returns (PPO)
  torch::Tensor advantages{};     // (B, T) float, filled by the advantage stage
  torch::Tensor prompt_index;     // (B,) int64, which prompt of the input each sample answers
  std::vector<std::string> prompts{};      // (B) prompt text per sample (empty when not given)
  std::vector<std::string> completions{};  // (B) decoded completion (empty when no decoder)
  std::vector<std::string> references{};   // (B) ground truth of the sample's prompt (or empty)

  std::int64_t size() const { return completion_ids.defined() ? completion_ids.size(0) : 0; }
  /// Tokens generated per sample, (B,) int64.
  torch::Tensor lengths() const { return completion_mask.sum(1).to(torch::kInt64); }
  /// Prompt and completion concatenated: ids (B, P+T) and mask (B, P+T).
  torch::Tensor full_ids() const { return torch::cat({prompt_ids, completion_ids}, 1); }
  torch::Tensor full_mask() const { return torch::cat({prompt_mask, completion_mask}, 1); }

  /// Dynamic padding: the same samples without the prompt columns that are padding in every row
  /// and the completion columns past the longest completion. Per-token results on the kept
  /// columns are unchanged (positions count real tokens; padding is never attended), so a
  /// minibatch of short responses costs what its tokens cost. Text fields are not carried.
  token_rollout trimmed() const {
    token_rollout out;
    const auto P = prompt_mask.size(1), T = completion_mask.size(1);
    const auto any_p = (prompt_mask.sum(0) > 0).to(torch::kCPU);
    const auto any_c = (completion_mask.sum(0) > 0).to(torch::kCPU);
    std::int64_t p0 = 0, t1 = T;
    while (p0 < P - 1 && !any_p[p0].item<bool>()) ++p0;
    while (t1 > 1 && !any_c[t1 - 1].item<bool>()) --t1;
    auto cols = [](const torch::Tensor& x, std::int64_t a, std::int64_t b) {
      return x.defined() ? x.slice(1, a, b) : torch::Tensor{};
    };
    out.prompt_ids = cols(prompt_ids, p0, P);
    out.prompt_mask = cols(prompt_mask, p0, P);
    out.completion_ids = cols(completion_ids, 0, t1);
    out.completion_mask = cols(completion_mask, 0, t1);
    out.old_logp = cols(old_logp, 0, t1);
    out.ref_logp = cols(ref_logp, 0, t1);
    out.values = cols(values, 0, t1);
    out.returns = cols(returns, 0, t1);
    out.advantages = cols(advantages, 0, t1);
    out.prompt_index = prompt_index;
    return out;
  }

  /// The samples at `index` ((n,) int64), in order.
  token_rollout select(const torch::Tensor& index) const {
    UNIRL_CHECK(index.dim() == 1, "token_rollout::select: index must be 1-D, got sizes ", index.sizes());
    const auto idx = index.to(torch::kInt64);
    auto pick = [&](const torch::Tensor& t) {
      return t.defined() ? t.index_select(0, idx.to(t.device())) : torch::Tensor{};
    };
    token_rollout out;
    out.prompt_ids = pick(prompt_ids);
    out.prompt_mask = pick(prompt_mask);
    out.completion_ids = pick(completion_ids);
    out.completion_mask = pick(completion_mask);
    out.old_logp = pick(old_logp);
    out.ref_logp = pick(ref_logp);
    out.values = pick(values);
    out.returns = pick(returns);
    out.advantages = pick(advantages);
    out.prompt_index = pick(prompt_index);
    const auto host = idx.to(torch::kCPU).contiguous();
    const auto* p = host.data_ptr<std::int64_t>();
    auto pick_strings = [&](const std::vector<std::string>& v) {
      std::vector<std::string> r;
      if (v.empty()) return r;
      r.reserve(static_cast<std::size_t>(host.numel()));
      for (std::int64_t i = 0; i < host.numel(); ++i) {
        UNIRL_CHECK(p[i] >= 0 && p[i] < static_cast<std::int64_t>(v.size()), "token_rollout::select: index ", p[i],
                    " out of range for ", v.size(), " samples");
        r.push_back(v[static_cast<std::size_t>(p[i])]);
      }
      return r;
    };
    out.prompts = pick_strings(prompts);
    out.completions = pick_strings(completions);
    out.references = pick_strings(references);
    return out;
  }
};

static_assert(RolloutBatch<token_rollout>);

}  // namespace unirl
