// unirl quickstart: teach a tiny character-level GPT two-number addition, then improve it with
// GRPO from an exact-answer + format reward — everything embedded, a few minutes on 2 CPU cores.
//
//   quickstart --out runs/quickstart                  # defaults
//   quickstart --out runs/qs rl_steps=60 seed=3       # any option as key=value
//
// Stage 1 (supervised): next-token training on "a+b=c." until the held-out accuracy (greedy)
// enters [band_low, band_high] — a model that is right only part of the time, so the sparse
// exact-answer reward has something to reinforce. Stage 2 (RL): GRPO through unirl::trainer.
// Writes metrics.jsonl, reward_curve.png and summary.json (accuracy_before, accuracy_after, steps,
// seconds) in --out.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/core/command_line.hpp>
#include <unirl/models/char_tokenizer.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/train/plot.hpp>
#include <unirl/train/report.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/trainer.hpp>

#include "common/addition.hpp"

struct quickstart_options {
  std::int64_t max_operand = 99;      // operands drawn from [0, max_operand]
  std::int64_t d_model = 64;
  std::int64_t n_layer = 2;
  std::int64_t n_head = 4;
  std::int64_t heldout = 400;         // held-out problems (never trained on)
  double pretrain_lr = 2e-3;
  std::int64_t pretrain_batch = 64;
  std::int64_t pretrain_max_steps = 4000;
  std::int64_t eval_every = 25;      // pretraining steps between held-out evaluations
  std::int64_t rl_eval_every = 250;  // GRPO steps between held-out evaluations
  double band_low = 0.25;             // stop pretraining once held-out accuracy is in the band
  double band_high = 0.40;
  std::int64_t rl_steps = 2000;
  std::int64_t prompts_per_step = 16;
  std::int64_t group_size = 8;
  double rl_lr = 3e-4;
  double temperature = 1.0;
  double format_weight = 0.1;
  unirl::algo::advantage_kind advantage = unirl::algo::advantage_kind::dr_grpo;
  double rl_seconds = 200;            // stop RL early after this many seconds (a loaded machine)
  std::int64_t seed = 0;
  std::int64_t threads = 1;           // LibTorch intra-op threads (tiny tensors: 1 is fastest)
  std::string pretrained = "";        // weights file: loaded when it exists, else written after stage 1
};
BOOST_HANA_ADAPT_STRUCT(quickstart_options, max_operand, d_model, n_layer, n_head, heldout, pretrain_lr,
                        pretrain_batch, pretrain_max_steps, eval_every, rl_eval_every, band_low, band_high, rl_steps,
                        prompts_per_step, group_size, rl_lr, temperature, format_weight, advantage, rl_seconds, seed,
                        threads, pretrained);

namespace {
using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

using problem = examples::addition_problem;
std::string prompt_of(const problem& p) { return p.question() + "="; }

struct task : examples::addition_task {
  unirl::models::char_tokenizer tok{"0123456789+=."};
  using addition_task::addition_task;

  unirl::prompt_batch prompts(const std::vector<problem>& ps) const {
    unirl::prompt_batch in{.decode = tok.decoder(), .pad_id = tok.pad_id()};
    for (const auto& p : ps) {
      in.tokens.push_back(tok.encode(prompt_of(p)));
      in.texts.push_back(prompt_of(p));
      in.references.push_back(p.answer());
    }
    return in;
  }
  unirl::sampling_options sampling(double temperature) const {
    return {.max_new_tokens = 5, .temperature = temperature, .stop_tokens = {tok.id('.')}};
  }
};

// Greedy held-out accuracy: the completion (stop token excluded) must equal the sum exactly.
double accuracy(const unirl::models::gpt& model, const task& t) {
  torch::NoGradGuard ng;
  const auto in = t.prompts(t.heldout());
  auto s = t.sampling(1.0);
  s.top_k = 1;
  const auto b = unirl::sample_tokens(model, in, 1, s);
  std::int64_t right = 0;
  for (std::size_t i = 0; i < b.completions.size(); ++i) right += b.completions[i] == b.references[i];
  return static_cast<double>(right) / static_cast<double>(b.completions.size());
}

// A supervised batch of `n` training problems: prompt "a+b=", completion "c." (the loss covers
// the answer and the stop token).
unirl::train::sft_batch pretrain_batch(task& t, std::int64_t n) {
  std::vector<std::vector<std::int64_t>> prompts, answers;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto p = t.draw_train();
    prompts.push_back(t.tok.encode(prompt_of(p)));
    answers.push_back(t.tok.encode(p.answer() + "."));
  }
  return unirl::train::make_sft_batch(prompts, answers, t.tok.pad_id());
}

// Stage 2's reward and trainer options, shared by the colocated run, the split mode and the
// data-parallel mode (the options type does not depend on the parallel strategy).
using reward_t = unirl::rewards::weighted<unirl::rewards::exact_answer, unirl::rewards::regex_format>;
using trainer_t = unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, reward_t>;
reward_t stage2_reward(const quickstart_options& o) {
  return reward_t{{.weights = {1.0, o.format_weight}}, unirl::rewards::exact_answer{},
                  unirl::rewards::regex_format{{.pattern = R"(\d{1,3})"}}};
}
trainer_t::options stage2_options(const quickstart_options& o, const task& t, const std::string& metrics_path,
                                  bool progress = true) {
  return {.algorithm = {.clip_high = 0.28,
                        .agg = unirl::algo::loss_agg::token_mean,
                        .advantage = o.advantage,
                        .sampling = t.sampling(o.temperature)},
          .optim = {.lr = o.rl_lr},
          .schedule = {.kind = unirl::train::schedule_kind::cosine, .warmup_steps = 10, .min_lr_ratio = 0.1},
          .group_size = o.group_size,
          .seed = o.seed,
          .metrics_path = metrics_path,
          .samples_path = metrics_path.empty() ? std::string{}
                                               : (std::filesystem::path(metrics_path).parent_path() / "samples.jsonl").string(),
          .progress = progress,
          .total_steps = o.rl_steps};
}
}  // namespace

#include "01_quickstart/split.hpp"  // mode=split: one learner, N samplers (uses the helpers above)
#include "01_quickstart/data_parallel.hpp"  // data_parallel=true: stage 2 over c10d ranks

int main(int argc, char** argv) try {
  quickstart_options o;
  const auto split = examples::take_split_mode(argc, argv);  // mode=, max_staleness=: not quickstart_options
  const auto dp_mode = quickstart_dp::take_options(argc, argv);  // data_parallel=, compression=, ...
  auto flags = unirl::options::parse_command_line(o, argc, argv, {{"out", "runs/quickstart"}, {"help", "false"}});
  if (flags["help"] == "true") {
    std::cout << "usage: quickstart [--out DIR] [key=value ...]\n" << unirl::options::to_string(o);
    return 0;
  }
  const std::string out = flags["out"];
  std::filesystem::create_directories(out);
  torch::set_num_threads(static_cast<int>(std::max<std::int64_t>(1, o.threads)));
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));
  const auto t_start = clock_type::now();
  std::cout << std::fixed << std::setprecision(2);

  task t(o.max_operand, o.heldout, static_cast<std::uint64_t>(o.seed) * 7919 + 17);
  unirl::models::gpt model(unirl::models::gpt_options{
      .vocab_size = t.tok.vocab_size(), .max_len = 16, .n_layer = o.n_layer, .n_head = o.n_head, .d_model = o.d_model});
  if (split.sampler()) return quickstart_split::sample(o, split, t, model);  // the weights come from rank 0

  // ---- stage 1: supervised pretraining into the accuracy band --------------------------------
  std::cout << "stage 1: pretraining a " << o.n_layer << "-layer, d=" << o.d_model
            << " character GPT on a+b until held-out accuracy is in [" << o.band_low << ", " << o.band_high << "]\n";
  double acc = 0.0;
  std::int64_t pre_steps = 0;
  const bool cached = !o.pretrained.empty() && std::filesystem::exists(o.pretrained);
  if (cached) {
    torch::load(model.net(), o.pretrained);
    std::cout << "  loaded pretrained weights from " << o.pretrained << "\n";
  } else {
    // The library's SFT stage (AdamW, no weight decay, constant lr), stopped by the evaluation
    // once the held-out accuracy reaches the band.
    unirl::train::sft_trainer<unirl::models::gpt> sft(
        model, {.optim = {.lr = o.pretrain_lr}, .batch_size = o.pretrain_batch, .steps = o.pretrain_max_steps,
                .eval_every = o.eval_every, .progress = false});
    const auto r = sft.run([&](std::int64_t n) { return pretrain_batch(t, n); },
                           [&](const unirl::train::supervised_stats& s) {
                             model.train(false);
                             acc = accuracy(model, t);
                             std::cout << "  step " << std::setw(5) << s.step + 1 << "  loss " << std::fixed
                                       << std::setprecision(3) << s.loss << "  held-out accuracy "
                                       << std::setprecision(1) << 100 * acc << "%\n"
                                       << std::flush;
                             return acc >= o.band_low;
                           });
    pre_steps = r.steps;
  }
  const double pretrain_seconds = since(t_start);
  if (!cached && !o.pretrained.empty()) torch::save(model.net(), o.pretrained);
  model.train(false);
  const double acc_before = accuracy(model, t);
  std::cout << "pretrained in " << pre_steps << " steps, " << std::setprecision(1) << pretrain_seconds
            << " s: held-out accuracy " << 100 * acc_before << "%\n";
  if (acc_before > o.band_high)
    std::cout << "  (above the band: lower pretrain_lr or eval_every for a lower start)\n";
  if (split.learner())
    return quickstart_split::learn(o, split, t, model, out, {acc_before, pre_steps, pretrain_seconds, t_start});
  if (dp_mode.on) return quickstart_dp::learn(dp_mode, o, t, model, out, {acc_before, pre_steps, pretrain_seconds, t_start});

  // ---- stage 2: GRPO with exact-answer + format reward --------------------------------------
  reward_t reward = stage2_reward(o);
  trainer_t trainer{model, reward, stage2_options(o, t, (std::filesystem::path(out) / "metrics.jsonl").string())};
  std::cout << "stage 2: GRPO, " << o.prompts_per_step << " prompts x " << o.group_size << " samples per step, up to "
            << o.rl_steps << " steps / " << o.rl_seconds << " s\n";
  const auto t_rl = clock_type::now();
  std::int64_t rl_steps = 0;
  for (; rl_steps < o.rl_steps && since(t_rl) < o.rl_seconds; ++rl_steps) {
    std::vector<problem> ps;
    for (std::int64_t i = 0; i < o.prompts_per_step; ++i) ps.push_back(t.draw_train());
    const auto st = trainer.step(t.prompts(ps));
    if ((rl_steps + 1) % o.rl_eval_every == 0) {
      trainer.models().policy.train(false);
      std::cerr << "\n";
      std::cout << "  step " << std::setw(5) << rl_steps + 1 << "  reward " << std::setprecision(3) << st.reward_mean
                << "  held-out accuracy " << std::setprecision(1) << 100 * accuracy(trainer.models().policy, t)
                << "%\n" << std::flush;
    }
  }
  const double rl_seconds = since(t_rl);
  trainer.models().policy.train(false);
  const double acc_after = accuracy(trainer.models().policy, t);
  const double seconds = since(t_start);
  std::cerr << "\n";
  std::cout << "held-out accuracy: " << std::setprecision(1) << 100 * acc_before << "% -> " << 100 * acc_after
            << "% after " << rl_steps << " GRPO steps (" << std::setprecision(0) << rl_seconds << " s RL, " << seconds
            << " s total)\n";

  const auto metrics = (std::filesystem::path(out) / "metrics.jsonl").string();
  try {
    unirl::train::plot_metrics(metrics, (std::filesystem::path(out) / "reward_curve.png").string(),
                               {"reward_mean", "reward/exact_answer", "entropy"});
  } catch (const unirl::error& e) {
    std::cout << "no reward curve image: " << e.what() << "\n";
  }
  nlohmann::json summary{{"accuracy_before", acc_before}, {"accuracy_after", acc_after},
                         {"steps", rl_steps},             {"pretrain_steps", pre_steps},
                         {"seconds", seconds},            {"pretrain_seconds", pretrain_seconds},
                         {"rl_seconds", rl_seconds},      {"options", unirl::options::to_json(o)}};
  std::ofstream(std::filesystem::path(out) / "summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);
  std::cout << "wrote " << out << "/metrics.jsonl, samples.jsonl, reward_curve.png, summary.json, report.html\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "quickstart: " << e.what() << "\n";
  return 1;
}
