#pragma once
/// \file packing.hpp
/// Layouts of a token rollout for the update forward: sequence packing (every sequence's real
/// tokens in one row, no padding) and prompt de-duplication (each distinct prompt once).
///
/// ```cpp
/// auto p = unirl::rollout::pack_rollout(batch);
/// auto logits = model.logits_packed(p.ids, p.positions, p.segments);   // (1, N, V)
/// auto d = unirl::rollout::find_distinct_prompts(batch);               // d.ids (U, P), d.inverse (B,)
/// ```
/// The names are also reachable as `unirl::models::pack_rollout` etc. (their former home).
#include <algorithm>
#include <cstdint>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::rollout {

/// A rollout's (prompt + completion) sequences packed into one row without padding: the real
/// tokens of sample 0, then of sample 1, ... `length()` is the sum of the real lengths.
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
  // Every sample needs a real prompt token: the host lengths of a sampled batch tell without a read.
  UNIRL_CHECK(b.size() == 0 ||
                  (b.has_host_lengths()
                       ? std::all_of(b.host_prompt_lengths.begin(), b.host_prompt_lengths.end(),
                                     [](std::int64_t l) { return l > 0; })
                       : to_host((b.prompt_mask.sum(1) > 0).all()).at(0) != 0.0),
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

}  // namespace unirl::rollout

namespace unirl::models {
// Former home of these names (models/causal_lm.hpp); kept so existing code compiles unchanged.
using rollout::distinct_prompts;
using rollout::find_distinct_prompts;
using rollout::pack_rollout;
using rollout::packed_rollout;
}  // namespace unirl::models
