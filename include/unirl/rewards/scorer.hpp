#pragma once
/// \file scorer.hpp
/// Scorers: the building blocks of rewards. A scorer maps a rollout batch to one float per
/// sample; scorers are generic over the batch and constrained only by the fields they read.
///
/// ```cpp
/// struct says_hello {
///   static constexpr std::string_view name = "hello";
///   template <unirl::rewards::HasCompletions B>
///   torch::Tensor operator()(const B& b) const {
///     std::vector<float> r;
///     for (const auto& c : b.completions) r.push_back(c.find("hello") != std::string::npos);
///     return unirl::rewards::to_scores(r);
///   }
/// };
/// static_assert(unirl::rewards::ScorerFor<says_hello, my_batch>);
/// ```
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/reward.hpp>
#include <unirl/config.hpp>
#include <unirl/core/error.hpp>

namespace unirl::rewards {

// HasCompletions, HasReferences, HasPrompts, HasImages and ScorerFor: concepts/reward.hpp.

/// The generated images of a batch: `b.images`, else `b.samples()`.
template <HasImages B>
torch::Tensor images_of(const B& b) {
  if constexpr (requires { { b.images } -> std::convertible_to<const torch::Tensor&>; }) return b.images;
  else return b.samples();
}

/// The display name of a scorer: its `name()` / `name` member, else `fallback`.
template <class S>
std::string scorer_name(const S& s, const std::string& fallback) {
  if constexpr (requires { { s.name() } -> std::convertible_to<std::string>; }) return std::string(s.name());
  else if constexpr (requires { { S::name } -> std::convertible_to<std::string_view>; }) return std::string(S::name);
  else return fallback;
}

/// A (B,) float32 tensor from per-sample scores.
inline torch::Tensor to_scores(const std::vector<float>& v) {
  auto t = torch::empty({static_cast<std::int64_t>(v.size())}, torch::kFloat32);
  std::copy(v.begin(), v.end(), t.data_ptr<float>());
  return t;
}

/// Checks that `scores` is a (n,) floating tensor; `who` names the scorer in the error.
inline torch::Tensor check_scores(torch::Tensor scores, std::int64_t n, const std::string& who) {
  UNIRL_CHECK(scores.defined(), who, ": returned an undefined tensor; expected (", n, ",) float scores");
  if (scores.dim() == 2 && scores.size(1) == 1) scores = scores.squeeze(1);
  UNIRL_CHECK(scores.dim() == 1 && scores.size(0) == n, who, ": returned scores of shape ", scores.sizes(),
              "; expected (", n, ",) — one score per sample");
  if (!scores.is_floating_point()) scores = scores.to(torch::kFloat32);
  return scores;
}

/// The number of samples in a batch: `size()` when it has one, else the completions' count.
template <class B>
std::int64_t batch_size(const B& b) {
  if constexpr (requires { { b.size() } -> std::convertible_to<std::int64_t>; }) return static_cast<std::int64_t>(b.size());
  else if constexpr (HasCompletions<B>) return static_cast<std::int64_t>(b.completions.size());
  else if constexpr (HasImages<B>) return images_of(b).size(0);
  else static_assert(unirl::detail::dependent_false<B>, "unirl::rewards::batch_size: the batch has no size()");
}

/// The batch's completions, checked to hold one text per sample (a token batch without a decoder
/// has none).
template <HasCompletions B>
const std::vector<std::string>& completions_of(const B& b, std::string_view who) {
  if constexpr (requires { { b.size() } -> std::convertible_to<std::int64_t>; })
    UNIRL_CHECK(static_cast<std::int64_t>(b.completions.size()) == static_cast<std::int64_t>(b.size()), who,
                ": the batch has ", b.completions.size(), " completion texts for ", b.size(),
                " samples; expected one per sample (give the sampler a decoder)");
  return b.completions;
}

/// Reads `b.references[i]`, with a clear error when the batch carries fewer references than samples.
template <HasReferences B>
const std::string& reference_at(const B& b, std::size_t i, std::string_view who) {
  UNIRL_CHECK(i < b.references.size(), who, ": the batch has ", b.references.size(), " references for ",
              batch_size(b), " samples; expected one reference per sample");
  return b.references[i];
}

/// Scores `batch` on another thread; the future yields what `scorer(batch)` returns. The batch is
/// copied, so the caller may start the next rollout at once. `scorer` must outlive the future and
/// must not be called concurrently from elsewhere meanwhile (a `remote_scorer` may: it is
/// thread-safe and has its own `submit`).
///
/// ```cpp
/// auto pending = unirl::rewards::score_async(reward, batch);
/// auto next = sample_next();              // overlaps the scoring
/// torch::Tensor r = pending.get();
/// ```
template <class Scorer, class Batch>
  requires ScorerFor<Scorer, Batch>
std::future<torch::Tensor> score_async(Scorer& scorer, Batch batch) {
  return std::async(std::launch::async, [&scorer, b = std::move(batch)]() -> torch::Tensor { return scorer(b); });
}

}  // namespace unirl::rewards
