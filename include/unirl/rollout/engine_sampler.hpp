#pragma once
/// \file engine_sampler.hpp
/// `sample_tokens` through the rollout engine: the same contract (a `token_rollout` with
/// left-padded prompts, right-padded completions, masks, behaviour log-probs `old_logp`, decoded
/// completions, host lengths), drawn by continuous batching over the paged KV cache. Each
/// prompt's group is one request of n = group_size samples (prefilled once, its blocks shared);
/// each prompt's seed comes from LibTorch's default CPU generator, so `torch::manual_seed` makes
/// a rollout reproducible, and every sample draws from its own stream.
///
/// ```cpp
/// torch::NoGradGuard ng;
/// auto batch = unirl::rollout::sample_tokens_engine(model, in, /*group_size=*/4, {.max_new_tokens = 8});
/// // the layout of unirl::sample_tokens: batch.completion_ids (4, T), batch.old_logp (4, T)
/// ```
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>
#include <unirl/rollout/engine.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_sampler.hpp>

namespace unirl::rollout {

/// The engine's sizes for a rollout of `sequences` samples of up to `tokens` tokens each:
/// `base` with its pool sized to hold `min(sequences, max_sequences)` of them at once and
/// `max_sequences` at least `group` (a group enters whole).
inline engine_options engine_options_for(std::int64_t sequences, std::int64_t tokens, std::int64_t group,
                                         engine_options base = {}) {
  base.max_sequences = std::max(base.max_sequences, group);
  const auto live = std::min(sequences, base.max_sequences);
  const auto per = (tokens + base.block_size - 1) / base.block_size * base.block_size;
  base.kv_tokens = live * per;
  return base;
}

/// What one `sample_tokens_engine` call did: its engine steps (one host read each that samples),
/// the most KV blocks in use at once and their bytes, the prompt tokens the prefix cache served,
/// the preemptions.
struct engine_summary {
  std::int64_t steps = 0, peak_blocks = 0, peak_kv_bytes = 0, prefix_hit_tokens = 0, preemptions = 0;
};

namespace detail {
// The token_rollout of `by_sample` (one engine result per sample, sample b answering prompt
// b / group_size of `in`; `pids` / `pmask` are `pad_prompts(in, group_size)`): the layout of
// `sample_tokens`. With `versions`, `token_version` holds each token's weight version.
inline token_rollout assemble_rollout(const prompt_batch& in, const torch::Tensor& pids, const torch::Tensor& pmask,
                                      std::int64_t group_size, const std::vector<result>& by_sample,
                                      const sampling_options& s, torch::Device device, torch::ScalarType lp_dtype,
                                      bool versions) {
  const auto B = static_cast<std::int64_t>(by_sample.size());
  std::int64_t T = 1;
  for (const auto& r : by_sample) T = std::max<std::int64_t>(T, static_cast<std::int64_t>(r.tokens.size()));
  auto ids = torch::full({B, T}, in.pad_id, torch::kInt64);
  auto mask = torch::zeros({B, T}, torch::kFloat);
  auto logp = torch::zeros({B, T}, torch::kDouble);
  auto ver = versions ? torch::zeros({B, T}, torch::kInt64) : torch::Tensor{};
  auto* pi = ids.data_ptr<std::int64_t>();
  auto* pm = mask.data_ptr<float>();
  auto* pl = logp.data_ptr<double>();
  auto* pv = versions ? ver.data_ptr<std::int64_t>() : nullptr;
  token_rollout r;
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& x = by_sample[static_cast<std::size_t>(b)];
    for (std::size_t t = 0; t < x.tokens.size(); ++t) {
      pi[b * T + static_cast<std::int64_t>(t)] = x.tokens[t];
      pm[b * T + static_cast<std::int64_t>(t)] = 1.f;
      pl[b * T + static_cast<std::int64_t>(t)] = x.logp[t];
      if (pv) pv[b * T + static_cast<std::int64_t>(t)] = x.versions[t];
    }
    const auto p = static_cast<std::size_t>(b / group_size);
    if (!in.texts.empty()) r.prompts.push_back(in.texts[p]);
    if (!in.references.empty()) r.references.push_back(in.references[p]);
    r.host_prompt_lengths.push_back(static_cast<std::int64_t>(in.tokens[p].size()));
    r.host_completion_lengths.push_back(static_cast<std::int64_t>(x.tokens.size()));
    if (in.decode) {
      std::vector<std::int64_t> toks;
      for (const auto v : x.tokens) {
        if (std::find(s.stop_tokens.begin(), s.stop_tokens.end(), v) != s.stop_tokens.end()) break;
        toks.push_back(v);
      }
      r.completions.push_back(in.decode(toks));
    }
  }
  r.prompt_ids = pids.to(device, /*non_blocking=*/true);
  r.prompt_mask = pmask.to(device, /*non_blocking=*/true);
  r.completion_ids = ids.to(device, /*non_blocking=*/true);
  r.completion_mask = mask.to(device, /*non_blocking=*/true);
  r.old_logp = logp.to(device, lp_dtype);
  if (versions) r.token_version = ver.to(device, /*non_blocking=*/true);
  r.prompt_index = torch::arange(B, torch::TensorOptions(torch::kInt64)).div(group_size, "floor").to(device);
  return r;
}
}  // namespace detail

/// `sample_tokens(model, in, group_size, s, device)` through the engine (see the file comment).
/// The model runs on its own device; the batch lands on `device`; `summary`, when given, receives
/// the engine's figures. Call under `torch::NoGradGuard`.
template <PagedCausalLM M>
token_rollout sample_tokens_engine(const M& model, const prompt_batch& in, std::int64_t group_size,
                                   const sampling_options& s, torch::Device device = torch::kCPU,
                                   engine_options eo = {}, engine_summary* summary = nullptr) {
  s.validate("sampling.");
  UNIRL_CHECK(in.texts.empty() || in.texts.size() == in.tokens.size(), "sample_tokens_engine: ", in.texts.size(),
              " prompt texts for ", in.tokens.size(), " prompts");
  UNIRL_CHECK(in.references.empty() || in.references.size() == in.tokens.size(), "sample_tokens_engine: ",
              in.references.size(), " references for ", in.tokens.size(), " prompts");
  auto [pids, pmask] = pad_prompts(in, group_size);  // checks the prompts and group_size
  const auto B = pids.size(0), P = pids.size(1);
  engine eng{model, engine_options_for(B, P + s.max_new_tokens, group_size, eo)};
  // One seed per prompt from the default generator (reproducible under torch::manual_seed).
  const auto seeds = torch::randint(0, std::numeric_limits<std::int64_t>::max(), {in.size()}, torch::kInt64);
  const auto* sp = seeds.data_ptr<std::int64_t>();
  for (std::int64_t p = 0; p < in.size(); ++p)
    eng.submit({.prompt = in.tokens[static_cast<std::size_t>(p)], .sampling = s,
                .seed = static_cast<std::uint64_t>(sp[p]), .n = group_size});
  std::vector<result> by_sample(static_cast<std::size_t>(B));
  engine_summary sum;
  while (eng.has_work()) {
    for (auto& r : eng.step()) by_sample[static_cast<std::size_t>(r.request * group_size + r.sample)] = std::move(r);
    const auto& st = eng.stats();
    sum.peak_blocks = std::max(sum.peak_blocks, st.used_blocks);
    sum.peak_kv_bytes = std::max(sum.peak_kv_bytes, st.kv_bytes);
  }
  sum.steps = eng.stats().steps;
  sum.prefix_hit_tokens = eng.stats().prefix_hit_tokens;
  sum.preemptions = eng.stats().preemptions;
  if (summary) *summary = sum;

  const auto lp_dtype = eng.dtype() == torch::kDouble ? torch::kDouble : torch::kFloat;
  return detail::assemble_rollout(in, pids, pmask, group_size, by_sample, s, device, lp_dtype, false);
}

/// Completions the way the trainers draw them: through the engine when `s.engine` (the default)
/// and the model is a `PagedCausalLM` (chosen at compile time), else the static batch of
/// `sample_tokens`. Evaluations use it too, so a greedy held-out figure (`top_k = 1`) comes from
/// the path the training samples came from. `summary` receives the engine's figures (zeros on
/// the static path). Call under `torch::NoGradGuard`.
template <CausalLM M>
token_rollout sample_completions(const M& model, const prompt_batch& in, std::int64_t group_size,
                                 const sampling_options& s, torch::Device device = torch::kCPU,
                                 engine_summary* summary = nullptr) {
  if (summary) *summary = {};
  if constexpr (PagedCausalLM<M>) {
    if (s.engine) return sample_tokens_engine(model, in, group_size, s, device, {}, summary);
  }
  return sample_tokens(model, in, group_size, s, device);
}

}  // namespace unirl::rollout
