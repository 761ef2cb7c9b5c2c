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
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>
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
    // Drop a token when the tokens before it already reach top_p (the first token always stays).
    auto drop = (cum - torch::softmax(sorted, -1)) >= top_p;
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

/// Samples `group_size` completions per prompt with the KV cache. Call under `torch::NoGradGuard`.
/// With a `PrefixSharingCausalLM` each prompt is prefilled once and its cache rows are shared by
/// the group's samples.
/// Completions stop at a stop token (kept, masked 1) or at `max_new_tokens`; afterwards slots hold
/// `pad_id` with mask 0. `completions` holds the decoded text without stop tokens when the input
/// has a decoder; `prompts` and `references` are copied per sample.
template <CausalLM M>
token_rollout sample_tokens(const M& model, const prompt_batch& in, std::int64_t group_size, const sampling_options& s,
                            torch::Device device = torch::kCPU) {
  s.validate("sampling.");
  UNIRL_CHECK(in.texts.empty() || in.texts.size() == in.tokens.size(), "sample_tokens: ", in.texts.size(),
              " prompt texts for ", in.tokens.size(), " prompts");
  UNIRL_CHECK(in.references.empty() || in.references.size() == in.tokens.size(), "sample_tokens: ",
              in.references.size(), " references for ", in.tokens.size(), " prompts");
  auto [pids, pmask] = pad_prompts(in, group_size);
  pids = pids.to(device);
  pmask = pmask.to(device);
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
  auto logp = torch::zeros({B, T}, torch::TensorOptions(torch::kFloat).device(device));
  auto alive = torch::ones({B}, torch::TensorOptions(torch::kBool).device(device));
  torch::Tensor stops;
  if (!s.stop_tokens.empty())
    stops = torch::tensor(s.stop_tokens, torch::kInt64).to(device);
  std::int64_t produced = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const auto scaled = logits.to(torch::kFloat) / s.temperature;
    const auto lsm = torch::log_softmax(scaled, -1);
    const auto probs = torch::softmax(filter_logits(scaled, s.top_k, s.top_p), -1);
    auto next = torch::multinomial(probs, 1).squeeze(1);  // (B,)
    next = torch::where(alive, next, torch::full_like(next, in.pad_id));
    ids.select(1, t).copy_(next);
    mask.select(1, t).copy_(alive.to(torch::kFloat));
    logp.select(1, t).copy_(torch::where(alive, lsm.gather(1, next.unsqueeze(1)).squeeze(1), torch::zeros_like(next, torch::kFloat)));
    produced = t + 1;
    if (stops.defined()) alive = alive & torch::isin(next, stops).logical_not();
    if (!alive.any().item<bool>() || t + 1 == T) break;
    logits = model.logits_cached(next.unsqueeze(1), alive.to(torch::kFloat).unsqueeze(1), cache).select(1, 0);
  }
  // A completion's own stop token stays real, while slots after it were fed with mask 0.

  token_rollout r;
  r.prompt_ids = pids;
  r.prompt_mask = pmask;
  r.completion_ids = ids.slice(1, 0, produced).contiguous();
  r.completion_mask = mask.slice(1, 0, produced).contiguous();
  r.old_logp = logp.slice(1, 0, produced).contiguous();
  r.prompt_index = torch::arange(B, torch::TensorOptions(torch::kInt64).device(device)).div(group_size, "floor");
  const auto n_prompts = static_cast<std::size_t>(in.size());
  for (std::int64_t b = 0; b < B; ++b) {
    const auto p = static_cast<std::size_t>(b / group_size);
    if (!in.texts.empty()) r.prompts.push_back(in.texts[p]);
    if (!in.references.empty()) r.references.push_back(in.references[p]);
  }
  (void)n_prompts;
  if (in.decode) {
    const auto hid = r.completion_ids.to(torch::kCPU), hm = r.completion_mask.to(torch::kCPU);
    const auto* pi = hid.data_ptr<std::int64_t>();
    const auto* pm = hm.data_ptr<float>();
    for (std::int64_t b = 0; b < B; ++b) {
      std::vector<std::int64_t> toks;
      for (std::int64_t t = 0; t < produced; ++t) {
        if (pm[b * produced + t] == 0.f) break;
        const auto v = pi[b * produced + t];
        if (std::find(s.stop_tokens.begin(), s.stop_tokens.end(), v) != s.stop_tokens.end()) break;
        toks.push_back(v);
      }
      r.completions.push_back(in.decode(toks));
    }
  }
  return r;
}

}  // namespace unirl
