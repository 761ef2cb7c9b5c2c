// The rollout engine (rollout/engine.hpp) against the static-batch `sample_tokens` on the same
// requests, side by side in one run: generated tokens per second.
//
// Lengths: per sequence a completion length L is drawn and forced — the engine gets
// max_new_tokens = L per request; `sample_tokens` runs the requests in batches of <batch>
// (the engine's max_sequences), each with max_new_tokens = that batch's max(L) (a static batch
// decodes until its longest row ends: the rows that stopped earlier stay in it, masked), no stop
// token. Both count sum(L) generated tokens.
//   long tail: L = the limit for 5 % of the sequences (every 20th), the others log-normal with
//              median limit / 8 and sigma 1, clipped to [1, limit] (seed 0);
//   equal:     L = limit / 2 for every sequence.
// Models (random weights, float32): the quickstart's GPT (d_model 64, 2 layers, 4 heads; vocab 16;
// its position table raised to prompt + limit) and Qwen2.5-0.5B's shapes with 4 layers (hidden 896,
// 14 / 2 heads of 64, MLP 4864, vocabulary 151,936, tied).
//
// Partial rollouts (--partial=1; rollout/partial.hpp): batches of <groups> groups of 8 from the
// quickstart GPT with stop token 0 (random weights: about one token in 16 stops a completion, so
// lengths are geometric, capped at the limit): whole batches through `sample_tokens_engine` (a
// batch ends with its slowest group) against partial rollouts offered twice the prompts (a batch
// is the first <groups> groups to finish; the others go on into the next). Groups per second and
// engine steps per batch, side by side, the same number of batches.
//
//   bench_rollout [--threads=1] [--reps=3] [--gpt-seqs=256 --gpt-batch=64 --gpt-limit=128]
//                 [--qwen-seqs=64 --qwen-batch=16 --qwen-limit=32] [--prompt=16] [--tail=1 --equal=1 --static=1]
//                 [--targets=0 --target-layers=24 --target-batch=64 --target-steps=4]
//                 [--partial=0 --partial-batches=24 --partial-groups=8 --partial-limit=128]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/models/gpt.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/rollout/engine.hpp>
#include <unirl/rollout/engine_sampler.hpp>
#include <unirl/rollout/partial.hpp>
#include <unirl/rollout/token_sampler.hpp>

#include "qwen_shapes.hpp"

namespace {

std::int64_t flag(int argc, char** argv, const std::string& name, std::int64_t def) {
  const auto key = "--" + name + "=";
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]).rfind(key, 0) == 0) return std::stoll(std::string(argv[i]).substr(key.size()));
  return def;
}

std::vector<std::int64_t> lengths(std::int64_t n, std::int64_t limit, bool tail) {
  std::vector<std::int64_t> out;
  std::mt19937 rng(0);
  std::lognormal_distribution<double> d(std::log(static_cast<double>(limit) / 8.0), 1.0);
  for (std::int64_t i = 0; i < n; ++i) {
    if (!tail) out.push_back(limit / 2);
    else if (i % 20 == 19) out.push_back(limit);
    else out.push_back(std::clamp<std::int64_t>(std::llround(d(rng)), 1, limit));
  }
  return out;
}

template <class M>
void compare(const char* name, const M& model, std::int64_t seqs, std::int64_t batch, std::int64_t prompt,
             std::int64_t limit, bool tail, std::int64_t reps, bool run_static) {
  torch::NoGradGuard ng;
  const auto V = model.vocab_size();
  std::mt19937 rng(1);
  std::uniform_int_distribution<std::int64_t> tok(0, V - 1);
  unirl::prompt_batch in;
  for (std::int64_t i = 0; i < seqs; ++i) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(prompt));
    for (auto& x : p) x = tok(rng);
    in.tokens.push_back(p);
  }
  const auto L = lengths(seqs, limit, tail);
  std::int64_t work = 0;
  for (const auto l : L) work += l;
  using clock = std::chrono::steady_clock;
  auto seconds = [](clock::time_point a) { return std::chrono::duration<double>(clock::now() - a).count(); };

  // Alternating runs, the fastest of each side (a loaded machine's noise hits both).
  // CPU seconds too (std::clock, one thread): on a machine other jobs load, the work a side did
  // varies less than its wall time.
  double t_static = 1e300, t_engine = 1e300, c_static = 1e300, c_engine = 1e300;
  auto cpu = [](std::clock_t a) { return static_cast<double>(std::clock() - a) / CLOCKS_PER_SEC; };
  std::int64_t generated = 0, peak_blocks = 0, slot_bytes = 0;
  for (std::int64_t rep = 0; rep < reps; ++rep) {
    auto t0 = clock::now();
    auto c0 = std::clock();
    for (std::int64_t lo = 0; run_static && lo < seqs; lo += batch) {
      const auto hi = std::min(seqs, lo + batch);
      unirl::prompt_batch part{.tokens = {in.tokens.begin() + lo, in.tokens.begin() + hi}};
      const auto b = unirl::sample_tokens(model, part, 1, {.max_new_tokens = *std::max_element(L.begin() + lo, L.begin() + hi)});
      (void)b;
    }
    t_static = std::min(t_static, seconds(t0));
    c_static = std::min(c_static, cpu(c0));
    unirl::rollout::engine eng{model, {.block_size = 16, .kv_tokens = batch * (prompt + limit + 16),
                                       .max_sequences = batch, .max_batch_tokens = std::max<std::int64_t>(512, batch)}};
    for (std::int64_t i = 0; i < seqs; ++i)
      eng.submit({.prompt = in.tokens[static_cast<std::size_t>(i)],
                  .sampling = {.max_new_tokens = L[static_cast<std::size_t>(i)]}, .seed = static_cast<std::uint64_t>(i)});
    t0 = clock::now();
    c0 = std::clock();
    generated = 0;
    while (eng.has_work()) {
      for (const auto& r : eng.step()) generated += static_cast<std::int64_t>(r.tokens.size());
      peak_blocks = std::max(peak_blocks, eng.stats().used_blocks);
    }
    t_engine = std::min(t_engine, seconds(t0));
    c_engine = std::min(c_engine, cpu(c0));
    slot_bytes = eng.slot_bytes();
  }
  if (generated != work) std::fprintf(stderr, "engine generated %lld tokens, expected %lld\n", (long long)generated, (long long)work);
  const double static_kv = static_cast<double>(batch * (prompt + limit) * slot_bytes) / (1 << 20);
  const double engine_kv = static_cast<double>(peak_blocks * 16 * slot_bytes) / (1 << 20);
  std::printf("| %s | %s | %lld x (%lld + <=%lld), batch %lld | %lld | %.0f | %.0f | %.2fx | %.2fx | %.1f | %.1f |\n", name,
              tail ? "long tail" : "equal", (long long)seqs, (long long)prompt, (long long)limit, (long long)batch,
              (long long)work,
              static_cast<double>(work) / t_static, static_cast<double>(work) / t_engine, t_static / t_engine,
              c_static / c_engine, static_kv,
              engine_kv);
  std::fflush(stdout);
}

// The absolute targets against this machine, measured in the same run (--targets=1):
//   sgemm rate: torch::linear at one decode step's shapes (rows = the batch; per layer the fused
//     q/k/v, o, the fused gate/up and down, then the tied head), best of 3 each, FLOP-weighted
//     over the step;
//   bandwidth: a sum over a 1 GiB float tensor (best of 5);
//   the engine's decode steps (every row a decode token, sampling included, best of the steps):
//     at batch 64, 2 * rows * matmul parameters per step over the step time against the sgemm
//     rate (= the share of the step that is GEMM time); at batch 1, every weight read once per
//     token (the parameters' bytes) over the step time against the bandwidth.
//   Every time here is CPU time (std::clock, one thread): on a machine other jobs load, wall
//   times of the machine's measurement and of the engine see different contention.
template <class M>
double decode_step_seconds(const M& model, std::int64_t batch, std::int64_t prompt, std::int64_t steps) {
  torch::NoGradGuard ng;
  unirl::rollout::engine eng{model, {.block_size = 16, .kv_tokens = batch * (prompt + steps + 32), .max_sequences = batch,
                                     .max_batch_tokens = batch * prompt}};
  std::mt19937 rng(2);
  std::uniform_int_distribution<std::int64_t> tok(0, model.vocab_size() - 1);
  for (std::int64_t i = 0; i < batch; ++i) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(prompt));
    for (auto& x : p) x = tok(rng);
    eng.submit({.prompt = p, .sampling = {.max_new_tokens = steps + 1}, .seed = static_cast<std::uint64_t>(i)});
  }
  double best = 1e300;
  while (eng.has_work()) {
    const auto c0 = std::clock();
    (void)eng.step();
    const double t = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
    if (eng.stats().prefill_tokens == 0 && eng.stats().decode_tokens == batch) best = std::min(best, t);
  }
  return best;
}

void targets(std::int64_t layers, std::int64_t big_batch, std::int64_t steps) {
  torch::NoGradGuard ng;
  auto best_of = [](int reps, auto&& f) {  // CPU seconds (see decode_step_seconds)
    double best = 1e300;
    for (int r = 0; r < reps; ++r) {
      const auto c0 = std::clock();
      f();
      best = std::min(best, static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC);
    }
    return best;
  };
  double bandwidth = 0;
  {
    const auto x = torch::ones({std::int64_t{1} << 28}, torch::kFloat);  // 1 GiB
    const double t = best_of(5, [&] { (void)x.sum().item<float>(); });
    bandwidth = static_cast<double>(x.numel() * 4) / t;
  }
  const auto c = unirl_bench::qwen_shapes(layers);
  const std::int64_t H = c.hidden_size, I = c.intermediate_size, Dq = c.num_attention_heads * c.head_dim,
                     Dkv = c.num_key_value_heads * c.head_dim, V = c.vocab_size;
  // The matmuls the model runs on more than one row: q/k/v and gate/up fused (hf::fused_linears).
  const std::vector<std::pair<std::int64_t, std::int64_t>> layer_shapes{{Dq + 2 * Dkv, H}, {H, Dq}, {2 * I, H}, {H, I}};
  auto sgemm = [&](std::int64_t rows) {  // (GEMM seconds of one decode step, its FLOPs)
    double seconds = 0, flops = 0;
    auto one = [&](std::int64_t out, std::int64_t in, std::int64_t count) {
      const auto x = torch::randn({rows, in}), w = torch::randn({out, in});
      seconds += count * best_of(3, [&] { (void)torch::linear(x, w); });
      flops += static_cast<double>(count) * 2.0 * static_cast<double>(rows * out * in);
    };
    for (const auto& [out, in] : layer_shapes) one(out, in, layers);
    one(V, H, 1);
    return std::pair{seconds, flops};
  };
  unirl::models::hf::causal_lm q{c};
  q.train(false);
  std::int64_t bytes = 0;
  for (const auto& p : q.parameters()) bytes += p.numel() * p.element_size();
  std::printf("\n| target | this machine | engine decode step | engine / machine | goal |\n|---|---|---|---|---|\n");
  {
    const auto [gemm_s, flops] = sgemm(big_batch);
    const double step = decode_step_seconds(q, big_batch, 16, steps);
    std::printf("| batch %lld, Qwen2.5-0.5B shapes, %lld layers: GFLOP/s | sgemm %.1f | %.1f (%.3f s/step) | %.0f %% | >= 75 %% |\n",
                (long long)big_batch, (long long)layers, flops / gemm_s / 1e9, flops / step / 1e9, step,
                100.0 * gemm_s / step);
  }
  {
    const double step = decode_step_seconds(q, 1, 16, steps);
    std::printf("| batch 1, Qwen2.5-0.5B shapes, %lld layers: weight GB/s (%.2f GB per token) | bandwidth %.1f | %.1f (%.3f s/token) | "
                "%.0f %% | >= 90 %% |\n",
                (long long)layers, static_cast<double>(bytes) / 1e9, bandwidth / 1e9,
                static_cast<double>(bytes) / step / 1e9, step, 100.0 * static_cast<double>(bytes) / step / bandwidth);
  }
  std::fflush(stdout);
}

}  // namespace

// --partial=1: whole batches against partial rollouts (see the file comment).
void partial(std::int64_t batches, std::int64_t groups, std::int64_t prompt, std::int64_t limit, std::int64_t reps) {
  torch::NoGradGuard ng;
  torch::manual_seed(0);
  unirl::models::gpt g{unirl::models::gpt_options{
      .vocab_size = 16, .max_len = prompt + limit, .n_layer = 2, .n_head = 4, .d_model = 64}};
  g.train(false);
  const std::int64_t G = 8;
  std::mt19937 rng(1);
  std::uniform_int_distribution<std::int64_t> tok(1, 15);
  auto prompts = [&](std::int64_t n) {
    unirl::prompt_batch in;
    for (std::int64_t i = 0; i < n; ++i) {
      std::vector<std::int64_t> p(static_cast<std::size_t>(prompt));
      for (auto& x : p) x = tok(rng);
      in.tokens.push_back(p);
    }
    return in;
  };
  const unirl::sampling_options s{.max_new_tokens = limit, .temperature = 1.0, .stop_tokens = {0}, .engine = true};
  using clock = std::chrono::steady_clock;
  auto seconds = [](clock::time_point a) { return std::chrono::duration<double>(clock::now() - a).count(); };
  double t_whole = 1e300, t_part = 1e300;
  std::int64_t steps_whole = 0, steps_part = 0, tok_whole = 0, tok_part = 0, carried = 0;
  for (std::int64_t rep = 0; rep < reps; ++rep) {
    torch::manual_seed(rep);
    auto t0 = clock::now();
    std::int64_t steps = 0, toks = 0;
    for (std::int64_t b = 0; b < batches; ++b) {
      unirl::rollout::engine_summary sum;
      const auto r = unirl::rollout::sample_tokens_engine(g, prompts(groups), G, s, torch::kCPU, {}, &sum);
      steps += sum.steps;
      toks += static_cast<std::int64_t>(r.completion_mask.sum().item<double>());
    }
    t_whole = std::min(t_whole, seconds(t0));
    steps_whole = steps;
    tok_whole = toks;
    torch::manual_seed(rep);
    unirl::rollout::partial_rollouts carry{{.batch_groups = groups}};
    t0 = clock::now();
    steps = toks = 0;
    std::int64_t c = 0;
    for (std::int64_t b = 0; b < batches; ++b) {
      unirl::rollout::engine_summary sum;
      const auto r = carry.draw(g, prompts(2 * groups), G, s, torch::kCPU, &sum);
      steps += sum.steps;
      toks += static_cast<std::int64_t>(r.completion_mask.sum().item<double>());
      c += carry.last().carried_groups;
    }
    t_part = std::min(t_part, seconds(t0));
    steps_part = steps;
    tok_part = toks;
    carried = c;
  }
  const double n = static_cast<double>(batches * groups);
  std::printf("\n| sampler | batches x groups of %lld | groups / s | tokens / s | engine steps per batch | tokens per batch | "
              "groups carried |\n|---|---|---|---|---|---|---|\n", (long long)G);
  std::printf("| whole batches (sample_tokens_engine) | %lld x %lld | %.1f | %.0f | %.1f | %.0f | 0 |\n", (long long)batches,
              (long long)groups, n / t_whole, static_cast<double>(tok_whole) / t_whole, static_cast<double>(steps_whole) / static_cast<double>(batches),
              static_cast<double>(tok_whole) / static_cast<double>(batches));
  std::printf("| partial rollouts, 2x prompts offered | %lld x %lld | %.1f | %.0f | %.1f | %.0f | %lld |\n", (long long)batches,
              (long long)groups, n / t_part, static_cast<double>(tok_part) / t_part, static_cast<double>(steps_part) / static_cast<double>(batches),
              static_cast<double>(tok_part) / static_cast<double>(batches), (long long)carried);
  std::printf("partial / whole: %.2fx groups per second\n", t_whole / t_part);
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  torch::set_num_threads(static_cast<int>(flag(argc, argv, "threads", 1)));
  const auto prompt = flag(argc, argv, "prompt", 16);
  const auto reps = flag(argc, argv, "reps", 3);
  const auto gseqs = flag(argc, argv, "gpt-seqs", 256), gbatch = flag(argc, argv, "gpt-batch", 64),
             glimit = flag(argc, argv, "gpt-limit", 128);
  const auto qseqs = flag(argc, argv, "qwen-seqs", 64), qbatch = flag(argc, argv, "qwen-batch", 16),
             qlimit = flag(argc, argv, "qwen-limit", 32);
  // --tail=0 / --equal=0 skip a length profile; --static=0 runs the engine alone (for a profiler).
  const bool run_tail = flag(argc, argv, "tail", 1) != 0, run_equal = flag(argc, argv, "equal", 1) != 0,
             run_static = flag(argc, argv, "static", 1) != 0;
  std::vector<bool> profiles;
  if (run_tail) profiles.push_back(true);
  if (run_equal) profiles.push_back(false);
  std::printf("| model | lengths | requests x (prompt + completion), batch | generated tokens | sample_tokens tok/s | "
              "engine tok/s | engine / static | engine / static (CPU s) | static KV MiB | engine peak KV MiB |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  torch::manual_seed(0);
  unirl::models::gpt g{unirl::models::gpt_options{
      .vocab_size = 16, .max_len = prompt + glimit, .n_layer = 2, .n_head = 4, .d_model = 64}};
  g.train(false);
  if (gseqs > 0)
    for (const bool tail : profiles) compare("quickstart GPT", g, gseqs, gbatch, prompt, glimit, tail, reps, run_static);
  if (qseqs > 0) {
    unirl::models::hf::causal_lm q{unirl_bench::qwen_shapes(4)};
    q.train(false);
    for (const bool tail : profiles)
      compare("Qwen2.5-0.5B shapes, 4 layers", q, qseqs, qbatch, prompt, qlimit, tail, reps, run_static);
  }
  if (flag(argc, argv, "partial", 0) != 0)
    partial(flag(argc, argv, "partial-batches", 24), flag(argc, argv, "partial-groups", 8), prompt,
            flag(argc, argv, "partial-limit", 128), reps);
  if (flag(argc, argv, "targets", 0) != 0)
    targets(flag(argc, argv, "target-layers", 24), flag(argc, argv, "target-batch", 64), flag(argc, argv, "target-steps", 4));
  return 0;
}
