#pragma once
/// \file token.hpp
/// The token track (LLM, VLM): its rollout batch `token_rollout` (the track tag `token_track`
/// is in concepts/track.hpp), `concat_rollouts`, and the prompt input `prompt_batch` that
/// `step()` takes.
///
/// ```cpp
/// unirl::prompt_batch in{.tokens = {{1, 2, 3}}, .texts = {"1+2="}, .references = {"3"}};
/// auto stats = trainer.step(in);      // samples group_size completions per prompt
/// // rewards read the decoded text:   batch.completions[i], batch.references[i]
/// ```
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/rollout.hpp>
#include <unirl/concepts/track.hpp>
#include <unirl/core/batch.hpp>
#include <unirl/core/error.hpp>

namespace unirl {

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
///
/// Its members are reflected (core/batch.hpp): a new per-sample field is one line here and one
/// name in the `BOOST_HANA_ADAPT_STRUCT` below; a new per-token (B, T, ...) field also goes in
/// the completion group of `ragged_columns`, so that `trimmed()` and `concat_rollouts` pad and
/// cut it with the completions.
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
  torch::Tensor token_version{};  // (B, T) int64, the weight version each token was drawn with (partial
                                  // rollouts, rollout/partial.hpp); undefined otherwise; read under the mask
  torch::Tensor prompt_index;     // (B,) int64, which prompt of the input each sample answers
  std::vector<std::string> prompts{};      // (B) prompt text per sample (empty when not given)
  std::vector<std::string> completions{};  // (B) decoded completion (empty when no decoder)
  std::vector<std::string> references{};   // (B) ground truth of the sample's prompt (or empty)
  // What the sampler knows on the host without reading the device: the real tokens of each
  // sample's prompt and completion (a stop token included). They describe the masks as the
  // sampler lays them out (prompts left-padded, completions right-padded, real tokens contiguous)
  // and let `trimmed()` and the shared-prompt layout skip a device read; empty when unknown (a
  // batch built by hand): those then read the masks. Code that edits the masks clears them.
  std::vector<std::int64_t> host_prompt_lengths{};      // (B) or empty
  std::vector<std::int64_t> host_completion_lengths{};  // (B) or empty

  /// The padded second axes: prompts (left-padded, mask `prompt_mask`) and completions
  /// (right-padded, mask `completion_mask`) with every member aligned with them.
  using ragged_columns = batch::column_groups<
      batch::columns<batch::pad_side::left, "prompt_mask", "prompt_ids">,
      batch::columns<batch::pad_side::right, "completion_mask", "completion_ids", "old_logp", "ref_logp", "values",
                     "returns", "advantages", "token_version">>;

  std::int64_t size() const { return completion_ids.defined() ? completion_ids.size(0) : 0; }
  /// Tokens generated per sample, (B,) int64.
  torch::Tensor lengths() const { return completion_mask.sum(1).to(torch::kInt64); }
  /// Prompt and completion concatenated: ids (B, P+T) and mask (B, P+T).
  torch::Tensor full_ids() const { return torch::cat({prompt_ids, completion_ids}, 1); }
  torch::Tensor full_mask() const { return torch::cat({prompt_mask, completion_mask}, 1); }

  /// Dynamic padding: the same samples without the prompt columns that are padding in every row
  /// and the completion columns past the longest completion (`batch::trim`). Per-token results on
  /// the kept columns are unchanged (positions count real tokens; padding is never attended), so
  /// a minibatch of short responses costs what its tokens cost. Every other member is kept.
  /// With the host lengths (a sampled batch) the widths come from them, without a device read;
  /// otherwise the masks are read once (`batch::trim`).
  token_rollout trimmed() const;

  /// Whether the host lengths describe this batch (one per sample).
  bool has_host_lengths() const {
    const auto n = static_cast<std::size_t>(size());
    return n > 0 && host_prompt_lengths.size() == n && host_completion_lengths.size() == n;
  }

  /// The samples at `index` ((n,) int64), in order (`batch::select`).
  token_rollout select(const torch::Tensor& index) const;
};

}  // namespace unirl

BOOST_HANA_ADAPT_STRUCT(unirl::token_rollout, prompt_ids, prompt_mask, completion_ids, completion_mask, old_logp,
                        ref_logp, values, returns, advantages, token_version, prompt_index, prompts, completions, references,
                        host_prompt_lengths, host_completion_lengths);

namespace unirl {

inline token_rollout token_rollout::trimmed() const {
  if (!has_host_lengths() || !prompt_mask.defined() || !completion_mask.defined()) return batch::trim(*this);
  // The groups of ragged_columns: prompts (left-padded), then completions (right-padded); at
  // least one column of each stays, as in batch::trim.
  const auto P = prompt_mask.size(1), T = completion_mask.size(1);
  std::int64_t lp = 1, lc = 1;
  for (const auto l : host_prompt_lengths) lp = std::max(lp, l);
  for (const auto l : host_completion_lengths) lc = std::max(lc, l);
  return batch::keep_columns(*this, {{{P - std::min(lp, P), P}, {0, std::min(lc, T)}}});
}
inline token_rollout token_rollout::select(const torch::Tensor& index) const { return batch::select(*this, index); }

/// Rollouts of possibly different widths one after the other (`batch::concat`): prompts
/// left-padded and completions right-padded to the widest part, ids with `pad_id`, every other
/// padded slot with 0.
inline token_rollout concat_rollouts(const std::vector<token_rollout>& parts, std::int64_t pad_id) {
  return batch::concat(parts, [pad_id](std::string_view member) {
    return member == "prompt_ids" || member == "completion_ids" ? static_cast<double>(pad_id) : 0.0;
  });
}

static_assert(RolloutBatch<token_rollout>);

}  // namespace unirl
