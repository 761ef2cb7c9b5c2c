#pragma once
/// \file sft.hpp
/// Supervised fine-tuning of a causal LM on (prompt, completion) token sequences: the mean
/// cross-entropy of the completion tokens (the prompt is context only), in one padded forward.
/// The short supervised stage before RL in the examples and recipes.
///
/// ```cpp
/// auto batch = unirl::train::make_sft_batch({prompt_ids}, {answer_ids}, tok.pad_id());
/// auto loss = unirl::train::sft_loss(model, batch);   // mean -log p over the answer tokens
/// opt.zero_grad(); loss.backward(); opt.step();
/// ```
#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/models/causal_lm.hpp>

namespace unirl::train {

/// Prompt + completion sequences, right-padded into one batch.
struct sft_batch {
  torch::Tensor ids;          // (B, L) int64, prompt then completion, padded with pad_id
  torch::Tensor mask;         // (B, L) float, 1 = real token
  torch::Tensor target_mask;  // (B, L-1) float, 1 where position t predicts a completion token t+1
  std::int64_t tokens() const { return target_mask.defined() ? target_mask.sum().item<std::int64_t>() : 0; }
};

/// Packs `prompts[i] + completions[i]` into an `sft_batch`. Every prompt needs at least one token
/// and every completion at least one (else there is nothing to learn from it).
inline sft_batch make_sft_batch(const std::vector<std::vector<std::int64_t>>& prompts,
                                const std::vector<std::vector<std::int64_t>>& completions, std::int64_t pad_id) {
  UNIRL_CHECK(!prompts.empty() && prompts.size() == completions.size(), "make_sft_batch: ", prompts.size(),
              " prompts and ", completions.size(), " completions: expected as many, at least one");
  const auto B = static_cast<std::int64_t>(prompts.size());
  std::size_t L = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    UNIRL_CHECK(!prompts[i].empty(), "make_sft_batch: prompt ", i, " is empty: expected at least one token");
    UNIRL_CHECK(!completions[i].empty(), "make_sft_batch: completion ", i, " is empty: expected at least one token");
    L = std::max(L, prompts[i].size() + completions[i].size());
  }
  const auto Li = static_cast<std::int64_t>(L);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(B * Li), pad_id);
  std::vector<float> mask(static_cast<std::size_t>(B * Li), 0.f), target(static_cast<std::size_t>(B * (Li - 1)), 0.f);
  for (std::int64_t i = 0; i < B; ++i) {
    const auto& p = prompts[static_cast<std::size_t>(i)];
    const auto& c = completions[static_cast<std::size_t>(i)];
    const auto row = static_cast<std::size_t>(i * Li);
    std::copy(p.begin(), p.end(), ids.begin() + static_cast<std::ptrdiff_t>(row));
    std::copy(c.begin(), c.end(), ids.begin() + static_cast<std::ptrdiff_t>(row + p.size()));
    std::fill_n(mask.begin() + static_cast<std::ptrdiff_t>(row), p.size() + c.size(), 1.f);
    // Position t predicts token t+1: completion tokens sit at [|p|, |p|+|c|), predicted from [|p|-1, |p|+|c|-1).
    std::fill_n(target.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i * (Li - 1)) + p.size() - 1),
                c.size(), 1.f);
  }
  return {torch::tensor(ids, torch::kInt64).view({B, Li}), torch::tensor(mask, torch::kFloat).view({B, Li}),
          torch::tensor(target, torch::kFloat).view({B, Li - 1})};
}

/// Mean negative log-likelihood of the completion tokens of `b` under `model` (token mean over
/// the whole batch), differentiable.
template <CausalLM M>
torch::Tensor sft_loss(const M& model, const sft_batch& b) {
  const auto L = b.ids.size(1);
  UNIRL_CHECK(L >= 2, "sft_loss: sequences of ", L, " tokens: expected at least a prompt and a completion token");
  const auto dev = model.device();
  const auto ids = b.ids.to(dev), mask = b.mask.to(dev), target_mask = b.target_mask.to(dev);
  const auto logits = model.logits(ids.slice(1, 0, L - 1), mask.slice(1, 0, L - 1));
  const auto logp = models::token_logprob(logits, ids.slice(1, 1, L), 1.0, false).first;
  return -(logp * target_mask.to(logp.dtype())).sum() / target_mask.sum().clamp_min(1.0);
}

}  // namespace unirl::train
