// The process the kill loop (crash_driver.cpp) kills: GRPO on the built-in GPT for a tiny task,
// a checkpoint every step into a run directory, resuming from the latest complete checkpoint when
// started again; at the end it prints a hash of the final weights. Deterministic on CPU: the
// prompts of step s depend on s alone, and the trainer's checkpoint restores the rest (weights,
// reference model, optimizer, guard, RNG states, step).
//
//   crash_worker DIR STEPS [d_model] [keep]
//
// Markers on stdout, one a line, flushed: "fresh" or "resumed S", "saving S" / "saved S" around
// each save, "hash 0x..." and "done" at the end.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/train/run_directory.hpp>
#include <unirl/trainer.hpp>

namespace {
// Fraction of generated tokens equal to 1: a task the policy learns in a few steps.
struct count_ones {
  torch::Tensor operator()(const unirl::token_rollout& b) const {
    const auto hit = (b.completion_ids == 1).to(torch::kFloat) * b.completion_mask;
    return hit.sum(1) / b.completion_mask.sum(1).clamp_min(1.0);
  }
};

// The prompts of step `s`: a function of s alone, so a resumed run sees what the uninterrupted one saw.
unirl::prompt_batch prompts_of(std::int64_t s) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(s) * 1000003u + 7u);
  std::uniform_int_distribution<std::int64_t> tok(2, 15), len(1, 4);
  unirl::prompt_batch in;
  for (int i = 0; i < 4; ++i) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(len(rng)));
    for (auto& t : p) t = tok(rng);
    in.tokens.push_back(std::move(p));
  }
  return in;
}

// FNV-1a 64 over every parameter's and buffer's name and bytes (float32, CPU, contiguous).
std::uint64_t weights_hash(const unirl::models::gpt& m) {
  std::uint64_t h = 14695981039346656037ull;
  auto mix = [&h](const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) {
      h ^= c[i];
      h *= 1099511628211ull;
    }
  };
  auto all = m.named_parameters();
  for (auto& nb : m.named_buffers()) all.push_back(nb);
  for (const auto& [name, t] : all) {
    mix(name.data(), name.size());
    const auto c = t.detach().to(torch::kCPU).contiguous();
    mix(c.data_ptr(), static_cast<std::size_t>(c.numel()) * c.element_size());
  }
  return h;
}
}  // namespace

int main(int argc, char** argv) try {
  if (argc < 3) {
    std::cerr << "usage: crash_worker DIR STEPS [d_model] [keep]\n";
    return 2;
  }
  const std::string dir = argv[1];
  const std::int64_t steps = std::atoll(argv[2]);
  const std::int64_t d_model = argc > 3 ? std::atoll(argv[3]) : 128;
  const std::int64_t keep = argc > 4 ? std::atoll(argv[4]) : 2;
  torch::set_num_threads(1);
  torch::manual_seed(0);

  using trainer_t = unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, count_ones>;
  trainer_t t{unirl::models::gpt(unirl::models::gpt_options{
                  .vocab_size = 16, .max_len = 16, .n_layer = 2, .n_head = 4, .d_model = d_model}),
              count_ones{},
              {.algorithm = {.clip_high = 0.28, .kl_coef = 0.01, .sampling = {.max_new_tokens = 6}},
               .optim = {.lr = 1e-3},
               .group_size = 4,
               .seed = 11,
               .progress = false}};

  unirl::train::run_directory run(dir, {.keep = keep});
  run.remove_temporaries();
  if (const auto last = run.latest()) {
    t.load(last->path.string());
    std::cout << "resumed " << t.step_count() << std::endl;
  } else {
    std::cout << "fresh" << std::endl;
  }
  for (std::int64_t s = t.step_count(); s < steps; ++s) {
    t.step(prompts_of(s));
    std::cout << "saving " << t.step_count() << std::endl;
    run.save(t.step_count(), [&](const std::string& path) { t.save(path); });
    std::cout << "saved " << t.step_count() << std::endl;
  }
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(weights_hash(t.models().policy)));
  std::cout << "hash " << buf << std::endl << "done" << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "crash_worker: " << e.what() << "\n";
  return 1;
}
