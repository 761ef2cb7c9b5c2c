#pragma once
// The quickstart split into one learner and N samplers (docs/parallel.md, "Learner / sampler
// split"), on PyTorch's c10d from torchrun's variables:
//
//   unirl-launch --nproc 3 -- quickstart mode=split --out runs/qs_split                 # synchronous
//   unirl-launch --nproc 3 -- quickstart mode=split max_staleness=1 --out runs/qs_async  # asynchronous
//   unirl-launch --nproc 3 -- quickstart mode=split max_staleness=1 partial=1 --out runs/qs_partial
//
// partial=1 (asynchronous only): partial rollouts (rollout/partial.hpp). Each sampler offers its
// engine twice a batch's prompts and returns the first prompts_per_step groups to finish; the
// others go on in flight, under the newer weights fetched between engine steps.
//
// Rank 0 pretrains (the samplers wait for its first publish, which delivers the pretrained
// weights), then learns: each step pops the samplers' scored batches (synchronous: one from every
// sampler, each holding prompts_per_step / N prompts, so a step sees what a colocated step sees;
// asynchronous: the next batch of prompts_per_step prompts drawn at most max_staleness versions
// ago), runs trainer::learn and publishes the new weights. It writes the colocated run's
// metrics.jsonl, reward_curve.png and summary.json, plus the mode, the sampler count, the final
// policy_version, the staleness of the steps and the batches dropped as too old.
// Ranks 1.. draw the training problems (the colocated run's sequence, sampler s taking its slice
// of each step's problems, so no two samplers draw the same ones and the held-out set is never
// drawn), sample with the newest weights they hold and score.
//
// Included by main.cpp after its helpers (task, problem, accuracy, quickstart_options).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/parallel/c10d_transport.hpp>
#include <unirl/parallel/rollout_worker.hpp>

#include "common/split_mode.hpp"

namespace quickstart_split {

using transport_t = unirl::parallel::c10d_transport<unirl::rollout_t<unirl::models::gpt>>;

// Prompts per sampler batch: a synchronous step gathers one batch from every sampler.
inline std::int64_t prompts_per_batch(const quickstart_options& o, const examples::split_mode& m) {
  if (m.max_staleness > 0) return o.prompts_per_step;
  UNIRL_CHECK(o.prompts_per_step % m.samplers() == 0, "mode=split: prompts_per_step = ", o.prompts_per_step,
              " with ", m.samplers(), " samplers: expected a multiple of the sampler count (a synchronous step "
              "gathers one batch from every sampler)");
  return o.prompts_per_step / m.samplers();
}

/// Ranks 1..: sample and score until the learner finishes. `model` is only the architecture:
/// the weights come with the learner's first publish.
inline int sample(const quickstart_options& o, const examples::split_mode& m, task& t, unirl::models::gpt model) {
  const std::int64_t per = prompts_per_batch(o, m);
  auto tr = examples::split_transport<unirl::rollout_t<unirl::models::gpt>>(m);  // waits for rank 0's store
  const std::int64_t stream = tr.rank() - 1, n = m.samplers();
  unirl::parallel::rollout_worker<unirl::models::gpt, unirl::algo::grpo<>, reward_t, transport_t> w(
      std::move(model), stage2_reward(o), stage2_options(o, t, ""), tr, stream,
      {.partial_rollouts = m.partial, .partial_batch_groups = m.partial ? per : 0});
  const std::int64_t offered = m.partial ? 2 * per : per;  // partial: over-sampled, twice the batch
  auto next = [&] {
    std::vector<problem> ps;
    for (std::int64_t i = 0; i < n * offered; ++i) {
      const auto p = t.draw_train();
      if (i / offered == stream) ps.push_back(p);
    }
    return t.prompts(ps);
  };
  while (w.run_once(next())) {
  }
  std::cout << "sampler " << tr.rank() << ": " << w.batches() << " batches, last weights version " << w.version()
            << "\n";
  return 0;
}

/// What stage 1 left on rank 0.
struct pretrained {
  double accuracy_before = 0;
  std::int64_t pretrain_steps = 0;
  double pretrain_seconds = 0;
  std::chrono::steady_clock::time_point start;
};

/// Rank 0, after pretraining: learn from the samplers' batches and write the outputs.
inline int learn(const quickstart_options& o, const examples::split_mode& m, task& t, unirl::models::gpt& model,
                 const std::string& out, const pretrained& pre) {
  (void)prompts_per_batch(o, m);  // the samplers' check, here too
  auto tr = examples::split_transport<unirl::rollout_t<unirl::models::gpt>>(m);
  const auto metrics = (std::filesystem::path(out) / "metrics.jsonl").string();
  trainer_t trainer{model, stage2_reward(o), stage2_options(o, t, metrics)};
  unirl::parallel::learner l{trainer, tr};  // version 0: the pretrained weights
  std::cout << "stage 2: GRPO split, 1 learner + " << m.samplers() << " samplers, "
            << (m.max_staleness == 0 ? std::string("synchronous")
                                     : "asynchronous (max_staleness " + std::to_string(m.max_staleness) + ")" +
                                           (m.partial ? ", partial rollouts" : ""))
            << ", " << o.prompts_per_step << " prompts x " << o.group_size << " samples per step, up to " << o.rl_steps
            << " steps / " << o.rl_seconds << " s\n";
  const auto t_rl = std::chrono::steady_clock::now();
  auto since = [](std::chrono::steady_clock::time_point a) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
  };
  std::int64_t rl_steps = 0;
  double staleness_sum = 0, staleness_max = 0;
  for (; rl_steps < o.rl_steps && since(t_rl) < o.rl_seconds; ++rl_steps) {
    const auto st = l.step(m.parts());
    UNIRL_CHECK(st.has_value(), "quickstart: the samplers stopped at step ", rl_steps, "; expected them to run until ",
                "the learner finishes");
    const double s = st->extra.at("staleness");
    staleness_sum += s;
    staleness_max = std::max(staleness_max, s);
    if ((rl_steps + 1) % o.rl_eval_every == 0) {
      trainer.models().policy.train(false);
      std::cerr << "\n";
      std::cout << "  step " << std::setw(5) << rl_steps + 1 << "  reward " << std::setprecision(3) << st->reward_mean
                << "  held-out accuracy " << std::setprecision(1) << 100 * accuracy(trainer.models().policy, t)
                << "%\n" << std::flush;
    }
  }
  const double rl_seconds = since(t_rl);
  l.finish();
  trainer.models().policy.train(false);
  const double acc_after = accuracy(trainer.models().policy, t);
  const double seconds = since(pre.start);
  std::cerr << "\n";
  std::cout << "held-out accuracy: " << std::setprecision(1) << 100 * pre.accuracy_before << "% -> " << 100 * acc_after
            << "% after " << rl_steps << " GRPO steps (" << std::setprecision(0) << rl_seconds << " s RL, " << seconds
            << " s total; staleness mean " << std::setprecision(2)
            << (rl_steps > 0 ? staleness_sum / static_cast<double>(rl_steps) : 0.0) << ", max " << staleness_max
            << ", " << tr.dropped() << " batches dropped)\n";
  try {
    unirl::train::plot_metrics(metrics, (std::filesystem::path(out) / "reward_curve.png").string(),
                               {"reward_mean", "entropy", "staleness"});
  } catch (const unirl::error& e) {
    std::cout << "no reward curve image: " << e.what() << "\n";
  }
  nlohmann::json summary{{"accuracy_before", pre.accuracy_before},
                         {"accuracy_after", acc_after},
                         {"steps", rl_steps},
                         {"pretrain_steps", pre.pretrain_steps},
                         {"seconds", seconds},
                         {"pretrain_seconds", pre.pretrain_seconds},
                         {"rl_seconds", rl_seconds},
                         {"options", unirl::options::to_json(o)},
                         {"split", m.to_json()},
                         {"policy_version", l.version()},
                         {"staleness_mean", rl_steps > 0 ? staleness_sum / static_cast<double>(rl_steps) : 0.0},
                         {"staleness_max", staleness_max},
                         {"dropped", tr.dropped()}};
  std::ofstream(std::filesystem::path(out) / "summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);
  std::cout << "wrote " << out << "/metrics.jsonl, reward_curve.png, summary.json, report.html\n";
  return 0;
}

}  // namespace quickstart_split
