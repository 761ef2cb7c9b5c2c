// BM_decode_kv_cache / BM_decode_recompute: 128 new tokens for a batch of 8 with the built-in
// GPT, with the KV cache and by recomputing the whole prefix at every step.
// BM_grpo_step: one GRPO step through unirl::trainer (sample with the cache, reward, group
// advantages, clipped loss, backward, AdamW) — the C++ half of grpo_step.py's comparison;
// items_per_second is samples/s. All with one LibTorch thread (see main).
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/trainer.hpp>

namespace {
unirl::models::gpt decode_model() {
  torch::manual_seed(0);
  return unirl::models::gpt(unirl::models::gpt_options{.vocab_size = 64, .max_len = 160, .n_layer = 4, .n_head = 4,
                                                       .d_model = 128});
}
constexpr std::int64_t kBatch = 8, kPrompt = 16, kNew = 128;

void BM_decode_kv_cache(benchmark::State& state) {
  auto m = decode_model();
  m.train(false);
  torch::NoGradGuard ng;
  const auto prompt = torch::randint(0, 64, {kBatch, kPrompt}, torch::kInt64);
  for (auto _ : state) {
    auto cache = m.make_cache(kBatch, kPrompt + kNew);
    auto logits = m.logits_cached(prompt, torch::ones({kBatch, kPrompt}), cache).select(1, kPrompt - 1);
    const auto one = torch::ones({kBatch, 1});
    for (std::int64_t t = 0; t < kNew; ++t) {
      const auto next = logits.argmax(-1, true);
      logits = m.logits_cached(next, one, cache).select(1, 0);
    }
    benchmark::DoNotOptimize(logits.data_ptr<float>());
  }
  state.SetItemsProcessed(state.iterations() * kBatch * kNew);
}
BENCHMARK(BM_decode_kv_cache)->Unit(benchmark::kMillisecond);

void BM_decode_recompute(benchmark::State& state) {
  auto m = decode_model();
  m.train(false);
  torch::NoGradGuard ng;
  const auto prompt = torch::randint(0, 64, {kBatch, kPrompt}, torch::kInt64);
  for (auto _ : state) {
    auto ids = prompt;
    for (std::int64_t t = 0; t < kNew; ++t) {
      const auto logits = m.logits(ids, torch::ones(ids.sizes())).select(1, ids.size(1) - 1);
      ids = torch::cat({ids, logits.argmax(-1, true)}, 1);
    }
    benchmark::DoNotOptimize(ids.data_ptr<std::int64_t>());
  }
  state.SetItemsProcessed(state.iterations() * kBatch * kNew);
}
BENCHMARK(BM_decode_recompute)->Unit(benchmark::kMillisecond);

// The GRPO step shared with grpo_step.py: GPT (vocab 14, 4 heads; d_model and layers from the
// benchmark's arguments: 64 x 2, the comparison's default, and 128 x 4), 16 prompts of 6 tokens x
// group 8 = 128 samples, 5 new tokens at temperature 1 (no stop token), reward = share of
// generated tokens equal to token 1, group-normalised advantages, clip 0.2 / 0.28, token-mean,
// AdamW lr 1e-4.
struct hit_reward {
  torch::Tensor operator()(const unirl::token_rollout& b) const {
    return ((b.completion_ids == 1).to(torch::kFloat) * b.completion_mask).sum(1) / b.completion_mask.sum(1);
  }
};

// `fast` = the defaults (the prompt's prefill and update forward shared by its group, pi_old taken
// from the single update's forward); otherwise the same work as grpo_step.py's step.
void grpo_step(benchmark::State& state, bool fast) {
  torch::manual_seed(0);
  unirl::models::gpt model(unirl::models::gpt_options{.vocab_size = 14, .max_len = 16, .n_layer = state.range(1),
                                                      .n_head = 4, .d_model = state.range(0)});
  unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, hit_reward> t{
      model, hit_reward{},
      {.algorithm = {.clip_high = 0.28, .agg = unirl::algo::loss_agg::token_mean, .reuse_on_policy_logp = fast,
                     .layout = fast ? unirl::rollout::update_layout::shared_prompt
                                    : unirl::rollout::update_layout::padded,
                     .sampling = {.max_new_tokens = 5}},
       .optim = {.lr = 1e-4},
       .group_size = 8,
       .progress = false}};
  unirl::prompt_batch in;
  for (std::int64_t i = 0; i < 16; ++i) in.tokens.push_back({i % 10, (i + 3) % 10, 10, (i * 7) % 10, i % 4, 11});
  for (auto _ : state) benchmark::DoNotOptimize(t.step(in).loss);
  state.SetItemsProcessed(state.iterations() * 128);
}
void BM_grpo_step(benchmark::State& state) { grpo_step(state, true); }
void BM_grpo_step_same_work(benchmark::State& state) { grpo_step(state, false); }
BENCHMARK(BM_grpo_step)->Args({64, 2})->Args({128, 4})->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK(BM_grpo_step_same_work)->Args({64, 2})->Args({128, 4})->Unit(benchmark::kMillisecond)->MinTime(3.0);
}  // namespace

// One LibTorch thread, as grpo_step.py uses on the Python side: these tensors are too small for
// intra-op parallelism to pay, and a shared machine makes extra threads wait for cores.
int main(int argc, char** argv) {
  torch::set_num_threads(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
