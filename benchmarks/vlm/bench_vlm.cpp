// The VLM adapter (include/unirl/models/vlm/) in GRPO steps: what the vision-feature cache saves,
// and what modality-aware activation checkpointing saves. A VLM whose vision tower dominates
// (vlm::make_small: a CLIP tower of --vision-layers layers, hidden 256, 8 heads, MLP 1024, on
// 112 x 112 images of 8 x 8 patches = 196 feature rows; a 2-layer models::gpt of width 64, text
// vocabulary 64), P prompts `{1, 2, <image i>, 3}` each with its own random image, G = 8
// samples of 16 tokens each, float32, --threads LibTorch threads (default 1).
//
// BM_vlm_cache/<prompts>: two trainers of identical weights, algo::grpo<> with kl_coef 0.04 (a
//   reference model, so the step has four forwards that show the images: the sampler's prefill,
//   the reference's log-probs, pi_old's, the update's), frozen tower; one with the cache
//   (vlm_options::cache_features = true: each image encoded once per step), one without (false:
//   every forward encodes its images again). The two take --reps steps alternately (new images
//   each step) and the fastest step of each is reported: cached_s / uncached_s (whole step),
//   cached_sample_s / uncached_sample_s (the sample stage), tokens_per_s_cached / _uncached
//   (P * G * 16 completion tokens per step second), speedup (uncached_s / cached_s),
//   calls_cached / calls_uncached (vision_tower_calls of one step), tower_s (one vision-tower
//   call over the P images alone, no gradient, fastest of --reps) and tower_share_uncached
//   (calls_uncached / P * tower_s / uncached_s). Manual time: the cached step.
// BM_vlm_memory/<prompts>/<config>: the tower trained (freeze_vision_tower = false, so it is in
//   the update's graph), GRPO with kl_coef 0, activation checkpointing config 0 none,
//   1 {"vision_tower"}, 2 {"decoder_blocks"}, 3 both. Two steps; the second's figures:
//   update_peak_MiB = memory/update_peak_mb - memory/advantage_mb (the highest resident set
//   during the update above its start: activations, gradients, temporaries), resident_MiB.
//   Run one case per process (the figures are the process's resident set).
//
//   bench_vlm --cache=4 --reps=3 --memory=
//   for c in none vision_tower decoder_blocks both; do bench_vlm --cache= --memory=4:$c; done
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/trainer.hpp>
#include <unirl/vlm.hpp>

#include "bench_args.hpp"

namespace vlm = unirl::models::vlm;
using small_vlm = vlm::vlm<unirl::models::gpt>;

namespace {

constexpr std::int64_t kGroup = 8, kNew = 16, kImage = 112, kVocab = 64;
std::int64_t g_reps = 3;           // --reps
std::int64_t g_vision_layers = 6;  // --vision-layers

small_vlm make_model(bool cache, bool freeze) {
  torch::manual_seed(0);
  return vlm::make_small({.vocab_size = kVocab,
                          .max_len = 256,
                          .n_layer = 2,
                          .n_head = 4,
                          .d_model = 64,
                          .image_size = kImage,
                          .patch_size = 8,
                          .vision_hidden = 256,
                          .vision_layers = g_vision_layers,
                          .vision_heads = 8,
                          .vision_intermediate = 1024,
                          .model = {.freeze_vision_tower = freeze, .cache_features = cache}});
}

// Fraction of completion tokens equal to 1 (differs within groups: the update has a gradient).
struct count_ones {
  torch::Tensor operator()(const unirl::token_rollout& b) const {
    const auto hit = (b.completion_ids == 1).to(torch::kFloat) * b.completion_mask;
    return hit.sum(1) / b.completion_mask.sum(1).clamp_min(1.0);
  }
};

using vlm_trainer = unirl::trainer<small_vlm, unirl::algo::grpo<>, count_ones>;

// A new image table: P prompts, each with its own image (seeded: both trainers see the same).
unirl::prompt_batch image_prompts(small_vlm& m, std::int64_t P, std::uint64_t seed) {
  torch::manual_seed(seed);
  m.images().clear();
  unirl::prompt_batch in;
  for (std::int64_t i = 0; i < P; ++i) {
    const auto img = m.images().add(torch::rand({3, kImage, kImage}));
    std::vector<std::int64_t> t{1, 2};
    t.insert(t.end(), img.begin(), img.end());
    t.push_back(3);
    in.tokens.push_back(std::move(t));
  }
  return in;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void BM_vlm_cache(benchmark::State& state) {
  const auto P = state.range(0);
  auto cached_model = make_model(/*cache=*/true, /*freeze=*/true);
  auto uncached_model = make_model(/*cache=*/false, /*freeze=*/true);
  const auto opts = [] {
    return unirl::trainer_options<unirl::algo::grpo<>>{
        .algorithm = {.kl_coef = 0.04, .sampling = {.max_new_tokens = kNew}},
        .optim = {.lr = 1e-4},
        .group_size = kGroup,
        .progress = false};
  };
  vlm_trainer cached{cached_model, count_ones{}, opts()}, uncached{uncached_model, count_ones{}, opts()};
  const auto inf = std::numeric_limits<double>::infinity();
  for (auto _ : state) {
    double best_c = inf, best_u = inf, sample_c = inf, sample_u = inf, tower = inf, calls_c = 0, calls_u = 0;
    for (std::int64_t r = 0; r < g_reps + 1; ++r) {  // the first round warms up, not counted
      const auto seed = static_cast<std::uint64_t>(100 + r);
      const auto sc = cached.step(image_prompts(cached_model, P, seed));
      const auto su = uncached.step(image_prompts(uncached_model, P, seed));
      std::vector<torch::Tensor> images;
      for (std::int64_t i = 0; i < P; ++i) images.push_back(cached_model.images().image(i));
      const auto t0 = std::chrono::steady_clock::now();
      {
        torch::NoGradGuard ng;
        (void)cached_model.vision_tower()->features_packed(images);
      }
      const auto tt = seconds_since(t0);
      if (r == 0) continue;
      best_c = std::min(best_c, sc.seconds);
      best_u = std::min(best_u, su.seconds);
      sample_c = std::min(sample_c, sc.time_sample);
      sample_u = std::min(sample_u, su.time_sample);
      tower = std::min(tower, tt);
      calls_c = sc.extra.at("vision_tower_calls");
      calls_u = su.extra.at("vision_tower_calls");
    }
    state.SetIterationTime(best_c);
    const double tokens = static_cast<double>(P * kGroup * kNew);
    state.counters["cached_s"] = best_c;
    state.counters["uncached_s"] = best_u;
    state.counters["cached_sample_s"] = sample_c;
    state.counters["uncached_sample_s"] = sample_u;
    state.counters["tokens_per_s_cached"] = tokens / best_c;
    state.counters["tokens_per_s_uncached"] = tokens / best_u;
    state.counters["speedup"] = best_u / best_c;
    state.counters["calls_cached"] = calls_c;
    state.counters["calls_uncached"] = calls_u;
    state.counters["tower_s"] = tower;
    state.counters["tower_share_uncached"] = calls_u / static_cast<double>(P) * tower / best_u;
  }
}

void BM_vlm_memory(benchmark::State& state) {
  const auto P = state.range(0), cfg = state.range(1);
  std::vector<std::string> kinds;
  if (cfg == 1 || cfg == 3) kinds.emplace_back("vision_tower");
  if (cfg == 2 || cfg == 3) kinds.emplace_back("decoder_blocks");
  auto model = make_model(/*cache=*/true, /*freeze=*/false);
  vlm_trainer t{model,
                count_ones{},
                {.algorithm = {.kl_coef = 0.0, .sampling = {.max_new_tokens = kNew}},
                 .optim = {.lr = 1e-4},
                 .memory = {.checkpointing = kinds},
                 .group_size = kGroup,
                 .progress = false}};
  for (auto _ : state) {
    (void)t.step(image_prompts(model, P, 1));  // allocates the optimizer state
    const auto s = t.step(image_prompts(model, P, 2));
    state.SetIterationTime(s.time_update);
    state.counters["loss"] = s.loss;
    state.counters["resident_MiB"] = s.extra.at("memory/advantage_mb");
    state.counters["update_peak_MiB"] = s.extra.at("memory/update_peak_mb") - s.extra.at("memory/advantage_mb");
    state.counters["vision_tower_calls"] = s.extra.at("vision_tower_calls");
  }
}

using unirl_bench::split;

}  // namespace

int main(int argc, char** argv) {
  std::string cache = "4", memory;
  int threads = 1;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const std::string f = std::string(flag) + "=";
      return a.rfind(f, 0) == 0 ? argv[i] + f.size() : nullptr;
    };
    if (const char* v = value("--cache"))
      cache = v;
    else if (const char* v = value("--memory"))
      memory = v;
    else if (const char* v = value("--threads"))
      threads = std::atoi(v);
    else if (const char* v = value("--reps"))
      g_reps = std::max(1, std::atoi(v));
    else if (const char* v = value("--vision-layers"))
      g_vision_layers = std::max(1, std::atoi(v));
    else
      rest.push_back(argv[i]);
  }
  torch::set_num_threads(threads);
  for (const auto& p : split(cache, ','))
    benchmark::RegisterBenchmark("BM_vlm_cache", BM_vlm_cache)
        ->Args({std::stoll(p)})
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  const std::vector<std::string> configs{"none", "vision_tower", "decoder_blocks", "both"};
  for (const auto& u : split(memory, ',')) {
    const auto parts = split(u, ':');
    const auto it = std::find(configs.begin(), configs.end(), parts.size() > 1 ? parts[1] : "");
    if (it == configs.end()) {
      std::fprintf(
          stderr,
          "--memory: \"%s\" is not prompts:config with config one of none, vision_tower, decoder_blocks, both\n",
          u.c_str());
      return 2;
    }
    benchmark::RegisterBenchmark(("BM_vlm_memory/" + *it).c_str(), BM_vlm_memory)
        ->Args({std::stoll(parts.at(0)), it - configs.begin()})
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
