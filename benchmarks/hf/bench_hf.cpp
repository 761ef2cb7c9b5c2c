// Hugging Face decoders (include/unirl/models/hf/) at the layer shapes of Qwen2.5-0.5B: hidden
// 896, 14 query heads / 2 KV heads of 64, MLP 4864, vocabulary 151,936, tied embeddings,
// rope_theta 1e6, random weights (Hugging Face's initialisation, seed 0), float32 — the C++ half
// of decode_compare.py and grpo_update_compare.py. Two LibTorch threads (--threads=N changes it).
//
// BM_hf_decode/<batch>/<layers>/<new>: prefill a 16-token prompt and take two greedy steps (not
//   timed), then <new> greedy steps through the KV cache (timed); items = batch * new tokens.
//   --reps=R repeats this R times on the same model and reports the fastest.
// BM_hf_grpo_update/<sequences>/<layers>/<chunked>: the update of one unirl::trainer::step of
//   algo::grpo<> (layout padded, pi_old from the update's own forward, seq-mean-token-mean,
//   clip 0.2; gradient-norm clip 1; AdamW lr 1e-6) on a fixed rollout of <sequences> x (64 prompt
//   + 192 completion tokens) in groups of 8: forward, backward, optimizer step. Timed: the step's
//   time_update. chunked = 1: the hf model (a HiddenStateCausalLM: the LM head and log-softmax in
//   row chunks, ops::linear_logprob); 0: the same network behind an adapter that only has
//   logits() (the (B, T, V) logits materialised). items = sequences * 256 tokens; counter
//   peak_rss_MiB: getrusage's ru_maxrss of the process so far (run one case per process).
//
// BM_hf_grpo_memory/<sequences>/<layers>/<config>: the one-device memory features on the same
//   update (chunked head, GRPO with kl_coef 0.04, so a reference model exists): config 0 fp32,
//   1 bf16 (autocast, float32 master weights), 2 activation checkpointing of the decoder blocks,
//   3 LoRA r = 16 on every linear (the reference is the base), 4 all three. Two steps; the
//   second (optimizer state allocated) is timed and its memory figures reported: resident_MiB
//   (the process at the update's start: weights, reference, optimizer state), update_peak_MiB
//   (the highest resident set during the update, above its start: activations, gradients,
//   temporaries), trainable_MiB (parameters that train). Flag: --memory=32:fp32,32:lora,...
//
// The shapes are flags, so the drivers run exactly the cases they compare:
//   bench_hf --decode=1,64 --layers=24 --new=32 --reps=2 --update= --threads=2
//   bench_hf --decode= --update=64:1,16:0 --layers=2
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/trainer.hpp>

#include "bench_args.hpp"
#include "qwen_shapes.hpp"

namespace hf = unirl::models::hf;

namespace {

using unirl_bench::qwen_shapes;

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // KiB on Linux
}

constexpr std::int64_t kPrompt = 16;
std::int64_t g_reps = 1;  // --reps: timed decodes per case, the fastest reported

void BM_hf_decode(benchmark::State& state) {
  const auto B = state.range(0), layers = state.range(1), N = state.range(2);
  torch::manual_seed(0);
  hf::causal_lm lm(qwen_shapes(layers));
  lm.train(false);
  torch::NoGradGuard ng;
  const auto prompt = torch::randint(0, 151936, {B, kPrompt}, torch::kInt64);
  const auto one = torch::ones({B, 1});
  for (auto _ : state) {
    double best = 0;
    for (std::int64_t r = 0; r < g_reps; ++r) {
      auto cache = lm.make_cache(B, kPrompt + 2 + N);
      // the prompt's last position only through the head (as sample_tokens does)
      const auto h = lm.hidden_states_cached(prompt, torch::ones({B, kPrompt}), cache).select(1, kPrompt - 1);
      auto next = torch::matmul(h, lm.lm_head_weight().t()).argmax(-1, true);
      for (int w = 0; w < 2; ++w) next = lm.logits_cached(next, one, cache).select(1, 0).argmax(-1, true);
      const auto t0 = std::chrono::steady_clock::now();
      for (std::int64_t t = 0; t < N; ++t) next = lm.logits_cached(next, one, cache).select(1, 0).argmax(-1, true);
      benchmark::DoNotOptimize(next.data_ptr<std::int64_t>());
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = r == 0 ? dt : std::min(best, dt);
    }
    state.SetIterationTime(best);  // the fastest repetition: the least disturbed by other jobs
  }
  state.SetItemsProcessed(state.iterations() * B * N);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
}

// The hf network behind an adapter with logits() only: the update materialises (B, T, V).
struct materialised_lm : unirl::models::module_adapter<materialised_lm, hf::decoder_net> {
  using track = unirl::token_track;
  using cache_type = unirl::models::kv_cache;
  using module_adapter::module_adapter;
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const {
    return net_.ptr()->forward(ids, mask);
  }
  cache_type make_cache(std::int64_t b, std::int64_t n) const { return net_->make_cache(b, n); }
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, cache_type& c) const {
    return net_.ptr()->forward_cached(ids, mask, c);
  }
  std::int64_t vocab_size() const { return net_->config().vocab_size; }
};
static_assert(unirl::CausalLM<materialised_lm> && !unirl::HiddenStateCausalLM<materialised_lm>);

// grpo<> whose sampling returns a prepared rollout: the step is then the update alone.
struct fixed_rollout_grpo : unirl::algo::grpo<> {
  using grpo::grpo;
  unirl::token_rollout batch;
  template <unirl::CausalLM M>
  unirl::token_rollout sample(unirl::model_set<M>&, const unirl::prompt_batch&, const unirl::step_info&) {
    return batch;
  }
};

// Reward: the share of completion tokens in the lower half of the vocabulary (varies within a group).
struct low_half_reward {
  torch::Tensor operator()(const unirl::token_rollout& b) const {
    return ((b.completion_ids < 151936 / 2).to(torch::kFloat) * b.completion_mask).sum(1) / b.completion_mask.sum(1);
  }
};

constexpr std::int64_t kUpdatePrompt = 64, kUpdateCompletion = 192, kGroup = 8;

// The fixed rollout of S sequences (random prompts shared by groups of 8, random completions) and
// the prompt batch whose step returns it.
unirl::prompt_batch fill_fixed_rollout(unirl::token_rollout& b, std::int64_t S) {
  torch::manual_seed(1);
  b.prompt_ids = torch::randint(0, 151936, {S / kGroup, kUpdatePrompt}, torch::kInt64).repeat_interleave(kGroup, 0);
  b.prompt_mask = torch::ones({S, kUpdatePrompt});
  b.completion_ids = torch::randint(0, 151936, {S, kUpdateCompletion}, torch::kInt64);
  b.completion_mask = torch::ones({S, kUpdateCompletion});
  b.old_logp = torch::zeros({S, kUpdateCompletion});
  b.prompt_index = torch::arange(S, torch::kInt64).floor_divide(kGroup);
  unirl::prompt_batch in;
  for (std::int64_t i = 0; i < S / kGroup; ++i) in.tokens.push_back({i});
  return in;
}

template <class Model>
void grpo_update(benchmark::State& state, Model model) {
  const auto S = state.range(0);
  unirl::trainer<Model, fixed_rollout_grpo, low_half_reward> t{
      std::move(model), low_half_reward{},
      {.algorithm = {.layout = unirl::rollout::update_layout::padded, .sampling = {.max_new_tokens = kUpdateCompletion}},
       .optim = {.lr = 1e-6},
       .clip = {.max_grad_norm = 1.0},
       .group_size = kGroup,
       .progress = false}};
  const auto in = fill_fixed_rollout(t.algorithm().batch, S);
  for (auto _ : state) {
    const auto s = t.step(in);
    state.SetIterationTime(s.time_update);
    state.counters["loss"] = s.loss;
  }
  state.SetItemsProcessed(state.iterations() * S * (kUpdatePrompt + kUpdateCompletion));
  state.counters["peak_rss_MiB"] = peak_rss_mib();
}

void BM_hf_grpo_update(benchmark::State& state) {
  torch::manual_seed(0);
  hf::causal_lm lm(qwen_shapes(state.range(1)));
  if (state.range(2) != 0) grpo_update(state, std::move(lm));
  else grpo_update(state, materialised_lm(lm.net()));
}

// One of the memory configurations of BM_hf_grpo_memory.
enum memory_config : std::int64_t { mem_fp32, mem_bf16, mem_ckpt, mem_lora, mem_all };

void BM_hf_grpo_memory(benchmark::State& state) {
  const auto S = state.range(0), cfg = state.range(2);
  torch::manual_seed(0);
  hf::causal_lm lm(qwen_shapes(state.range(1)));
  const bool lora = cfg == mem_lora || cfg == mem_all;
  if (lora) unirl::lora::apply(lm, {.rank = 16, .alpha = 32});
  unirl::trainer<hf::causal_lm, fixed_rollout_grpo, low_half_reward> t{
      std::move(lm), low_half_reward{},
      {.algorithm = {.kl_coef = 0.04,
                     .layout = unirl::rollout::update_layout::padded,
                     .sampling = {.max_new_tokens = kUpdateCompletion}},
       .optim = {.lr = 1e-6},
       .clip = {.max_grad_norm = 1.0},
       .memory = {.checkpointing = (cfg == mem_ckpt || cfg == mem_all) ? std::vector<std::string>{"decoder_blocks"}
                                                                       : std::vector<std::string>{}},
       .precision = (cfg == mem_bf16 || cfg == mem_all) ? unirl::precision::bf16 : unirl::precision::fp32,
       .group_size = kGroup,
       .progress = false}};
  const auto in = fill_fixed_rollout(t.algorithm().batch, S);
  t.algorithm().batch.ref_logp = torch::zeros({S, kUpdateCompletion});
  double trainable = 0;
  for (const auto& p : t.models().policy.parameters())
    if (p.requires_grad()) trainable += static_cast<double>(p.numel() * p.element_size());
  for (auto _ : state) {
    (void)t.step(in);  // allocates the optimizer state
    const auto s = t.step(in);
    state.SetIterationTime(s.time_update);
    state.counters["loss"] = s.loss;
    state.counters["resident_MiB"] = s.extra.at("memory/advantage_mb");
    state.counters["update_peak_MiB"] = s.extra.at("memory/update_peak_mb") - s.extra.at("memory/advantage_mb");
  }
  state.SetItemsProcessed(state.iterations() * S * (kUpdatePrompt + kUpdateCompletion));
  state.counters["trainable_MiB"] = trainable / (1 << 20);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
}

using unirl_bench::split;

}  // namespace

int main(int argc, char** argv) {
  std::string decode = "1,64", update = "64:1", memory, layers = "4", new_tokens = "32";
  int threads = 2;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const std::string f = std::string(flag) + "=";
      return a.rfind(f, 0) == 0 ? argv[i] + f.size() : nullptr;
    };
    if (const char* v = value("--decode")) decode = v;
    else if (const char* v = value("--update")) update = v;
    else if (const char* v = value("--memory")) memory = v;
    else if (const char* v = value("--layers")) layers = v;
    else if (const char* v = value("--new")) new_tokens = v;
    else if (const char* v = value("--threads")) threads = std::atoi(v);
    else if (const char* v = value("--reps")) g_reps = std::max(1, std::atoi(v));
    else rest.push_back(argv[i]);
  }
  torch::set_num_threads(threads);
  const auto L = std::stoll(layers), N = std::stoll(new_tokens);
  for (const auto& b : split(decode, ','))
    benchmark::RegisterBenchmark("BM_hf_decode", BM_hf_decode)
        ->Args({std::stoll(b), L, N})
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  for (const auto& u : split(update, ',')) {
    const auto parts = split(u, ':');
    benchmark::RegisterBenchmark("BM_hf_grpo_update", BM_hf_grpo_update)
        ->Args({std::stoll(parts.at(0)), L, parts.size() > 1 ? std::stoll(parts[1]) : 1})
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  }
  const std::vector<std::string> configs{"fp32", "bf16", "ckpt", "lora", "all"};
  for (const auto& u : split(memory, ',')) {
    const auto parts = split(u, ':');
    const auto it = std::find(configs.begin(), configs.end(), parts.size() > 1 ? parts[1] : "");
    if (it == configs.end()) {
      std::fprintf(stderr, "--memory: \"%s\" is not sequences:config with config one of fp32, bf16, ckpt, lora, all\n",
                   u.c_str());
      return 2;
    }
    benchmark::RegisterBenchmark(("BM_hf_grpo_memory/" + *it).c_str(), BM_hf_grpo_memory)
        ->Args({std::stoll(parts.at(0)), L, it - configs.begin()})
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
