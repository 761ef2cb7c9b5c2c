#pragma once
/// \file token_sampler.hpp
/// Batched autoregressive sampling with a KV cache for any `CausalLM`: temperature, top-k,
/// top-p, stop tokens and a maximum length. Returns a `token_rollout` with left-padded prompts,
/// right-padded completions, response masks and the sampler's log-probabilities.
///
/// ```cpp
/// unirl::prompt_batch in{.tokens = {{1, 5, 2}}, .decode = my_decode};
/// torch::NoGradGuard ng;
/// auto batch = unirl::sample_tokens(model, in, /*group_size=*/4, {.max_new_tokens = 8});
/// // batch.completion_ids (4, T), batch.completion_mask (4, T), batch.old_logp (4, T)
/// ```
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl {

/// Keeps the `top_k` largest logits and the smallest set of tokens whose probability reaches
/// `top_p`; the others become -inf. logits (B, V) -> (B, V).
inline torch::Tensor filter_logits(torch::Tensor logits, std::int64_t top_k, double top_p) {
  const auto neg_inf = -std::numeric_limits<float>::infinity();
  const auto V = logits.size(-1);
  if (top_k > 0 && top_k < V) {
    const auto kth = std::get<0>(logits.topk(top_k, -1)).select(-1, top_k - 1).unsqueeze(-1);
    logits = logits.masked_fill(logits < kth, neg_inf);
  }
  if (top_p < 1.0) {
    auto [sorted, order] = logits.sort(-1, /*descending=*/true);
    const auto cum = torch::softmax(sorted, -1).cumsum(-1);
    // Drop a token when the tokens before it already reach top_p. The first token always stays,
    // set explicitly: a top_p below float's range (1e-300) compares as 0 on float logits, and
    // 0 >= 0 dropped every token, leaving a NaN distribution (found by fuzz_engine_request).
    auto drop = (cum - torch::softmax(sorted, -1)) >= top_p;
    drop.narrow(-1, 0, 1).fill_(false);
    logits = logits.masked_fill(torch::zeros_like(drop).scatter(-1, order, drop), neg_inf);
  }
  return logits;
}

/// Left-pads prompts into (B, P) ids and mask, each prompt repeated `group_size` times in a row.
inline std::pair<torch::Tensor, torch::Tensor> pad_prompts(const prompt_batch& in, std::int64_t group_size) {
  UNIRL_CHECK(in.size() > 0, "sample_tokens: the prompt batch is empty");
  UNIRL_CHECK(group_size >= 1, "sample_tokens: group_size = ", group_size, ": expected >= 1");
  std::int64_t P = 0;
  for (std::size_t i = 0; i < in.tokens.size(); ++i) {
    UNIRL_CHECK(!in.tokens[i].empty(), "sample_tokens: prompt ", i, " is empty; every prompt needs a token");
    P = std::max<std::int64_t>(P, static_cast<std::int64_t>(in.tokens[i].size()));
  }
  const auto B = in.size() * group_size;
  auto ids = torch::full({B, P}, in.pad_id, torch::kInt64);
  auto mask = torch::zeros({B, P}, torch::kFloat);
  auto* pi = ids.data_ptr<std::int64_t>();
  auto* pm = mask.data_ptr<float>();
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& t = in.tokens[static_cast<std::size_t>(b / group_size)];
    const auto off = P - static_cast<std::int64_t>(t.size());
    for (std::size_t j = 0; j < t.size(); ++j) {
      pi[b * P + off + static_cast<std::int64_t>(j)] = t[j];
      pm[b * P + off + static_cast<std::int64_t>(j)] = 1.f;
    }
  }
  return {ids, mask};
}

/// With stop tokens, the tokens the sampler decodes between two reads of whether every sequence
/// has stopped (one host synchronisation each; a batch that stopped meanwhile decodes at most
/// this many - 1 steps more, all masked). The completions are the same for any interval.
inline constexpr std::int64_t stop_check_interval = 8;

/// Samples `group_size` completions per prompt with the KV cache. Call under `torch::NoGradGuard`.
/// With a `PrefixSharingCausalLM` each prompt is prefilled once and its cache rows are shared by
/// the group's samples.
/// Completions stop at a stop token (kept, masked 1) or at `max_new_tokens`; afterwards slots hold
/// `pad_id` with mask 0. `completions` holds the decoded text without stop tokens when the input
/// has a decoder; `prompts` and `references` are copied per sample.
///
/// Host synchronisations: none without stop tokens and decoder (inside a `deferred_checks` scope,
/// as in the trainer's step); with stop tokens one per `stop_check_interval` tokens, the last of
/// which also reads the completion lengths and, with a decoder, the tokens (one read at the end
/// when a decoder needs the tokens and no stop token is set). The draw is `torch::multinomial`'s
/// own (argmax of p / q, q ~ Exp(1): the same samples from the same generator) without its
/// validation reads; a distribution holding NaN (a model with non-finite logits) is reported as
/// an error by a check deferred to the caller's next read (read at the end outside such a scope).
template <CausalLM M>
token_rollout sample_tokens(const M& model, const prompt_batch& in, std::int64_t group_size, const sampling_options& s,
                            torch::Device device = torch::kCPU) {
  s.validate("sampling.");
  UNIRL_CHECK(in.texts.empty() || in.texts.size() == in.tokens.size(), "sample_tokens: ", in.texts.size(),
              " prompt texts for ", in.tokens.size(), " prompts");
  UNIRL_CHECK(in.references.empty() || in.references.size() == in.tokens.size(), "sample_tokens: ",
              in.references.size(), " references for ", in.tokens.size(), " prompts");
  auto [pids, pmask] = pad_prompts(in, group_size);
  // Host-made tensors go to the device without waiting for it.
  pids = pids.to(device, /*non_blocking=*/true);
  pmask = pmask.to(device, /*non_blocking=*/true);
  const auto B = pids.size(0), P = pids.size(1), T = s.max_new_tokens;

  // The prompt's last logits (b, V). A model with hidden states runs its LM head on that
  // position only: at a 150k vocabulary the head over the whole prompt costs more than the layers.
  auto prompt_logits = [&](const torch::Tensor& ids, const torch::Tensor& mask, typename M::cache_type& c) {
    if constexpr (HiddenStateCausalLM<M> && requires(typename M::cache_type& cc, const torch::Tensor& t) {
                    { model.hidden_states_cached(t, t, cc) } -> std::same_as<torch::Tensor>;
                  })
      return torch::matmul(model.hidden_states_cached(ids, mask, c).select(1, P - 1), model.lm_head_weight().t());
    else
      return model.logits_cached(ids, mask, c).select(1, P - 1);
  };
  // The prompt's prefill runs once per group when the model's cache rows can be shared.
  auto prefill = [&] {
    if constexpr (PrefixSharingCausalLM<M>) {
      if (group_size > 1) {
        const auto one = torch::arange(in.size(), torch::TensorOptions(torch::kInt64).device(device)) * group_size;
        auto c = model.make_cache(in.size(), P + T);
        const auto l = prompt_logits(pids.index_select(0, one), pmask.index_select(0, one), c);
        const auto rows = torch::arange(B, torch::TensorOptions(torch::kInt64).device(device)).div(group_size, "floor");
        return std::pair{l.index_select(0, rows), model.select_cache(c, rows)};
      }
    }
    auto c = model.make_cache(B, P + T);
    auto l = prompt_logits(pids, pmask, c);
    return std::pair{l, std::move(c)};
  };
  auto [logits, cache] = prefill();  // (B, V), the cache after the prompts
  auto ids = torch::full({B, T}, in.pad_id, torch::TensorOptions(torch::kInt64).device(device));
  auto mask = torch::zeros({B, T}, torch::TensorOptions(torch::kFloat).device(device));
  // Log-probs in the logits' precision: float64 stays float64, other types float32.
  const auto lp_dtype = logits.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto logp = torch::zeros({B, T}, torch::TensorOptions(lp_dtype).device(device));
  auto alive = torch::ones({B}, torch::TensorOptions(torch::kBool).device(device));
  torch::Tensor stops;
  if (!s.stop_tokens.empty())
    stops = torch::tensor(s.stop_tokens, torch::kInt64).to(device, /*non_blocking=*/true);
  auto no_nan = torch::ones({}, torch::TensorOptions(torch::kBool).device(device));  // every distribution drawn from
  std::int64_t produced = 0;
  // temperature = 0 is greedy: top_k = 1 at temperature 1 (sampling_options).
  const double temperature = s.temperature > 0.0 ? s.temperature : 1.0;
  const std::int64_t top_k = s.temperature > 0.0 ? s.top_k : 1;
  for (std::int64_t t = 0; t < T; ++t) {
    const auto scaled = logits.to(lp_dtype) / temperature;
    const auto lsm = torch::log_softmax(scaled, -1);
    const auto probs = torch::softmax(filter_logits(scaled, top_k, s.top_p), -1);
    no_nan = no_nan & probs.isnan().any().logical_not();
    // torch::multinomial(probs, 1)'s draw, without its two validation reads per call.
    auto next = probs.div(torch::empty_like(probs).exponential_(1)).argmax(-1);  // (B,)
    next = torch::where(alive, next, torch::full_like(next, in.pad_id));
    ids.select(1, t).copy_(next);
    mask.select(1, t).copy_(alive.to(torch::kFloat));
    logp.select(1, t).copy_(torch::where(alive, lsm.gather(1, next.unsqueeze(1)).squeeze(1), torch::zeros_like(next, lp_dtype)));
    produced = t + 1;
    if (stops.defined()) alive = alive & torch::isin(next, stops).logical_not();
    if (t + 1 == T) break;
    if (stops.defined() && (t + 1) % stop_check_interval == 0 && to_host(alive.any()).at(0) == 0.0) break;
    logits = model.logits_cached(next.unsqueeze(1), alive.to(torch::kFloat).unsqueeze(1), cache).select(1, 0);
  }
  // A completion's own stop token stays real, while slots after it were fed with mask 0.

  // One read at the end when something is needed on the host: the completion lengths (with stop
  // tokens; the width is the longest), the tokens (a decoder), the NaN check (outside a deferred
  // scope). Without stop tokens every sample has `produced` tokens.
  const std::string nan_message = "sample_tokens: a next-token distribution holds NaN (the model's logits are not "
                                  "finite); expected finite logits";
  auto* deferred = deferred_checks::current();
  if (deferred) deferred->add(no_nan, {}, [nan_message](const std::vector<double>&) { return nan_message; });
  std::vector<torch::Tensor> parts;
  if (!deferred) parts.push_back(no_nan.to(torch::kFloat64).reshape({1}));
  if (stops.defined()) parts.push_back(mask.slice(1, 0, produced).sum(1).to(torch::kFloat64));
  if (in.decode) parts.push_back(ids.slice(1, 0, produced).reshape({-1}).to(torch::kFloat64));
  std::vector<double> read;
  if (!parts.empty()) read = to_host(torch::cat(parts));
  std::size_t at = 0;
  if (!deferred) UNIRL_CHECK(read.at(at++) != 0.0, nan_message);
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(B), produced);
  if (stops.defined())
    for (auto& l : lengths) l = static_cast<std::int64_t>(read.at(at++));
  // The tokens (with a decoder): sample b's token t is read[at + b * stride + t].
  const std::int64_t stride = produced;
  produced = *std::max_element(lengths.begin(), lengths.end());  // every sample has its first token

  token_rollout r;
  r.prompt_ids = pids;
  r.prompt_mask = pmask;
  r.completion_ids = ids.slice(1, 0, produced).contiguous();
  r.completion_mask = mask.slice(1, 0, produced).contiguous();
  r.old_logp = logp.slice(1, 0, produced).contiguous();
  r.prompt_index = torch::arange(B, torch::TensorOptions(torch::kInt64).device(device)).div(group_size, "floor");
  for (std::int64_t b = 0; b < B; ++b) {
    const auto p = static_cast<std::size_t>(b / group_size);
    if (!in.texts.empty()) r.prompts.push_back(in.texts[p]);
    if (!in.references.empty()) r.references.push_back(in.references[p]);
    r.host_prompt_lengths.push_back(static_cast<std::int64_t>(in.tokens[p].size()));
  }
  r.host_completion_lengths = lengths;
  if (in.decode) {
    for (std::int64_t b = 0; b < B; ++b) {
      std::vector<std::int64_t> toks;
      for (std::int64_t t = 0; t < lengths[static_cast<std::size_t>(b)]; ++t) {
        const auto v = static_cast<std::int64_t>(read.at(at + static_cast<std::size_t>(b * stride + t)));
        if (std::find(s.stop_tokens.begin(), s.stop_tokens.end(), v) != s.stop_tokens.end()) break;
        toks.push_back(v);
      }
      r.completions.push_back(in.decode(toks));
    }
  }
  return r;
}

}  // namespace unirl
