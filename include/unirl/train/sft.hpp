#pragma once
/// \file sft.hpp
/// Supervised fine-tuning of a causal LM on (prompt, completion) token sequences: the mean
/// cross-entropy of the completion tokens (the prompt is context only), padded or packed, and
/// `sft_trainer<Model>`, the stage that runs it with the RL trainer's optimizer, schedule,
/// clipping, guard, metrics and checkpoints (train/supervised.hpp).
///
/// ```cpp
/// unirl::train::sft_trainer<unirl::models::gpt> sft(model, {.optim = {.lr = 2e-3}, .batch_size = 64, .steps = 500});
/// sft.run([&](std::int64_t n) {                        // n = batch_size examples a step
///   auto [prompts, answers] = draw(n);                 // token ids
///   return unirl::train::make_sft_batch(prompts, answers, tok.pad_id());
/// });
/// // or one step at a time / by hand:
/// auto loss = unirl::train::sft_loss(model, batch);    // mean -log p over the completion tokens
/// ```
/// The loss is `-(1/N) sum_{i, t in completion_i} log p(x_{i,t} | x_{i,<t})` with N the number of
/// completion tokens in the whole batch (a token mean, so a long answer weighs as many tokens as
/// it has). `sft_layout::packed` runs the real tokens of every sequence in one row without padding
/// (`PackedCausalLM::logits_packed`, the packing the RL update uses) — the same loss as `padded`.
#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rollout/token_logprob.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/supervised.hpp>

namespace unirl::train {

/// How the SFT forward lays out a batch: `padded` (right-padded rows) or `packed` (every
/// sequence's real tokens in one row; needs a `PackedCausalLM`). The same loss either way.
enum class sft_layout { padded, packed };

}  // namespace unirl::train

template <>
inline constexpr std::array unirl::enum_names<unirl::train::sft_layout>{std::string_view{"padded"},
                                                                        std::string_view{"packed"}};

namespace unirl::train {

/// Prompt + completion sequences, right-padded into one batch.
struct sft_batch {
  torch::Tensor ids;          // (B, L) int64, prompt then completion, padded with pad_id
  torch::Tensor mask;         // (B, L) float, 1 = real token
  torch::Tensor target_mask;  // (B, L-1) float, 1 where position t predicts a completion token t+1
  std::int64_t size() const { return ids.defined() ? ids.size(0) : 0; }
  std::int64_t tokens() const { return target_mask.defined() ? target_mask.sum().item<std::int64_t>() : 0; }
  /// The rows `index` ((n,) int64, any device): a micro-batch (padding columns kept).
  sft_batch select(const torch::Tensor& index) const {
    const auto i = index.to(ids.device());
    return {ids.index_select(0, i), mask.index_select(0, i), target_mask.index_select(0, i.to(target_mask.device()))};
  }
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

/// An `sft_batch` packed into one row without padding (the layout of `sft_layout::packed`).
struct packed_sft_batch {
  torch::Tensor ids;        // (1, N) int64, the real tokens of sequence 0, then 1, ...
  torch::Tensor positions;  // (1, N) int64, restarting at 0 for every sequence
  torch::Tensor segments;   // (1, N) int64, the sequence each token belongs to
  torch::Tensor predictor;  // (C,) int64, packed index of the token that predicts each completion token
  torch::Tensor targets;    // (C,) int64, the completion tokens, in (b, t) order
};

/// Packs `b` (see `packed_sft_batch`). Each row's real tokens must be a prefix of it (as
/// `make_sft_batch` writes them).
inline packed_sft_batch pack_sft_batch(const sft_batch& b) {
  const auto L = b.ids.size(1);
  const auto real = b.mask > 0;                                   // (B, L)
  const auto counts = real.sum(1).to(torch::kInt64);              // (B,)
  const auto dev = b.ids.device();
  const auto i64 = torch::TensorOptions(torch::kInt64).device(dev);
  UNIRL_CHECK((real == (torch::arange(L, i64).unsqueeze(0) < counts.unsqueeze(1))).all().item<bool>(),
              "pack_sft_batch: a row's real tokens are not a prefix of it: expected right-padded rows "
              "(as make_sft_batch writes them)");
  packed_sft_batch p;
  p.ids = b.ids.masked_select(real).unsqueeze(0);
  const auto N = p.ids.size(1);
  const auto seg = torch::repeat_interleave(torch::arange(b.ids.size(0), i64), counts);
  p.segments = seg.unsqueeze(0);
  p.positions = (torch::arange(N, i64) - (counts.cumsum(0) - counts).index_select(0, seg)).unsqueeze(0);
  const auto flat = (real.flatten().to(torch::kInt64).cumsum(0) - 1).view(real.sizes());  // packed index of (b, t)
  const auto target = b.target_mask > 0;                                                // (B, L-1)
  p.predictor = flat.slice(1, 0, L - 1).masked_select(target);
  p.targets = b.ids.slice(1, 1, L).masked_select(target);
  return p;
}

/// Mean negative log-likelihood of the completion tokens of `b` under `model` (token mean over
/// the whole batch), differentiable; `packed` needs a `PackedCausalLM`.
template <CausalLM M>
torch::Tensor sft_loss(const M& model, const sft_batch& b, sft_layout layout = sft_layout::padded) {
  UNIRL_CHECK(b.ids.defined() && b.ids.dim() == 2 && b.mask.sizes() == b.ids.sizes() && b.target_mask.dim() == 2 &&
                  b.target_mask.size(0) == b.ids.size(0) && b.target_mask.size(1) == b.ids.size(1) - 1,
              "sft_loss: ids ", b.ids.sizes(), ", mask ", b.mask.sizes(), " and target_mask ", b.target_mask.sizes(),
              ": expected (B, L), (B, L) and (B, L-1)");
  const auto L = b.ids.size(1);
  UNIRL_CHECK(L >= 2, "sft_loss: sequences of ", L, " tokens: expected at least a prompt and a completion token");
  const auto dev = model.device();
  const auto ids = b.ids.to(dev), mask = b.mask.to(dev), target_mask = b.target_mask.to(dev);
  if (layout == sft_layout::packed) {
    if constexpr (PackedCausalLM<M>) {
      const auto p = pack_sft_batch({ids, mask, target_mask});
      const auto logits = model.logits_packed(p.ids, p.positions, p.segments).select(0, 0).index_select(0, p.predictor);
      const auto logp = rollout::token_logprob(logits, p.targets, 1.0, false).first;  // (C,)
      return -logp.sum() / target_mask.sum().clamp_min(1.0);
    } else {
      UNIRL_CHECK(false, "sft_loss: layout = packed, but this model has no logits_packed(ids, positions, segments) ",
                  "(it is not a PackedCausalLM); use layout = padded");
    }
  }
  const auto logits = model.logits(ids.slice(1, 0, L - 1), mask.slice(1, 0, L - 1));
  // Positions outside the loss read token 0: a prompt may hold ids beyond the LM's vocabulary
  // (a VLM's image-slot tokens), which only ever appear as inputs.
  const auto targets = ids.slice(1, 1, L).masked_fill(target_mask <= 0, 0);
  const auto logp = rollout::token_logprob(logits, targets, 1.0, false).first;
  return -(logp * target_mask.to(logp.dtype())).sum() / target_mask.sum().clamp_min(1.0);
}

/// Options of the SFT objective.
struct sft_options {
  sft_layout layout = sft_layout::padded;  // padded rows, or packed (PackedCausalLM)
};

/// The SFT objective of `supervised_trainer`: `sft_loss` on an `sft_batch`.
template <CausalLM M>
struct sft_objective {
  using options = sft_options;
  using batch_type = sft_batch;
  static constexpr std::string_view name = "sft";
  options o{};
  explicit sft_objective(options opts = {}) : o(opts) {}
  supervised_loss loss(M& model, const sft_batch& b) const {
    return {sft_loss(model, b, o.layout), b.size(), b.tokens()};
  }
  /// What the loss of `b` divides by: its completion tokens (() float64, no read), so that
  /// micro-batches (`micro_batch_size`) give the gradients of the whole batch's token mean.
  torch::Tensor loss_normaliser(const sft_batch& b) const { return b.target_mask.sum().to(torch::kFloat64); }
};

/// The SFT stage: `supervised_trainer` over `sft_objective` (see train/supervised.hpp for the
/// options, `step`, `run`, `save` / `load`).
template <CausalLM M, class Parallel = ::unirl::parallel::single_device>
using sft_trainer = supervised_trainer<M, sft_objective<M>, Parallel>;

/// (prompt, completion) token sequences in memory, served in shuffled batches epoch after epoch;
/// its position is saved with the trainer's checkpoint (`Checkpointable`), so a resumed SFT run
/// sees the same batches. `steps_for(epochs, batch)` is the step count of that many passes.
/// ```cpp
/// unirl::train::sft_dataset data(prompts, answers, tok.pad_id(), /*seed=*/0);
/// sft_trainer<M> t(model, {.batch_size = 32, .steps = data.steps_for(3, 32)});
/// t.run([&](std::int64_t n) { return data.next(n); }, nullptr, data);
/// ```
class sft_dataset {
 public:
  sft_dataset(std::vector<std::vector<std::int64_t>> prompts, std::vector<std::vector<std::int64_t>> completions,
              std::int64_t pad_id, std::uint64_t seed = 0)
      : prompts_(std::move(prompts)), completions_(std::move(completions)), pad_id_(pad_id), seed_(seed) {
    UNIRL_CHECK(!prompts_.empty() && prompts_.size() == completions_.size(), "sft_dataset: ", prompts_.size(),
                " prompts and ", completions_.size(), " completions: expected as many, at least one");
    for (std::size_t i = 0; i < prompts_.size(); ++i) {
      UNIRL_CHECK(!prompts_[i].empty(), "sft_dataset: prompt ", i, " is empty: expected at least one token");
      UNIRL_CHECK(!completions_[i].empty(), "sft_dataset: completion ", i, " is empty: expected at least one token");
    }
    shuffle();
  }

  std::int64_t size() const { return static_cast<std::int64_t>(prompts_.size()); }
  std::int64_t epoch() const { return epoch_; }
  /// Steps of `epochs` passes in batches of `batch` (the last batch of an epoch may be short).
  std::int64_t steps_for(std::int64_t epochs, std::int64_t batch) const {
    UNIRL_CHECK(epochs >= 0 && batch >= 1, "sft_dataset::steps_for: epochs = ", epochs, ", batch = ", batch,
                ": expected >= 0 and >= 1");
    return epochs * ((size() + batch - 1) / batch);
  }
  /// The next batch of up to `n` examples of the current epoch (a new shuffled epoch starts when
  /// one is used up).
  sft_batch next(std::int64_t n) {
    UNIRL_CHECK(n >= 1, "sft_dataset::next: n = ", n, ": expected >= 1");
    if (cursor_ >= size()) {
      ++epoch_;
      cursor_ = 0;
      shuffle();
    }
    const auto end = std::min(size(), cursor_ + n);
    std::vector<std::vector<std::int64_t>> p, c;
    for (auto i = cursor_; i < end; ++i) {
      p.push_back(prompts_[order_[static_cast<std::size_t>(i)]]);
      c.push_back(completions_[order_[static_cast<std::size_t>(i)]]);
    }
    cursor_ = end;
    return make_sft_batch(p, c, pad_id_);
  }

  void save(torch::serialize::OutputArchive& a) const {
    write_scalar(a, "size", size());
    write_scalar(a, "epoch", epoch_);
    write_scalar(a, "cursor", cursor_);
  }
  void load(torch::serialize::InputArchive& a) {
    const auto n = read_scalar<std::int64_t>(a, "size");
    if (n != size())
      throw checkpoint_error("sft_dataset: the checkpoint is of " + std::to_string(n) + " examples, this dataset has " +
                             std::to_string(size()));
    const auto e = read_scalar<std::int64_t>(a, "epoch"), c = read_scalar<std::int64_t>(a, "cursor");
    if (e < 0 || c < 0 || c > n)
      throw checkpoint_error("sft_dataset: epoch " + std::to_string(e) + ", cursor " + std::to_string(c) +
                             " in the checkpoint: expected >= 0 and a cursor in [0, " + std::to_string(n) + "]");
    epoch_ = e;
    cursor_ = c;
    shuffle();
  }

 private:
  // The order of the current epoch: a permutation drawn from (seed, epoch) alone.
  void shuffle() {
    order_.resize(prompts_.size());
    std::iota(order_.begin(), order_.end(), std::size_t{0});
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(epoch_));
    std::shuffle(order_.begin(), order_.end(), rng);
  }

  std::vector<std::vector<std::int64_t>> prompts_, completions_;
  std::int64_t pad_id_ = 0;
  std::uint64_t seed_ = 0;
  std::int64_t epoch_ = 0, cursor_ = 0;
  std::vector<std::size_t> order_;
};

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::sft_options, layout);
