#pragma once
// The digits flow example split into one learner and N samplers (docs/parallel.md, "Learner /
// sampler split"), on PyTorch's c10d from torchrun's variables:
//
//   unirl-launch --nproc 3 -- digits_flow --algorithm grpo mode=split --out runs/flow_split
//   unirl-launch --nproc 3 -- digits_flow --algorithm dppo mode=split max_staleness=1 --out runs/flow_async
//
// Rank 0 prepares the classifier, pretrains the flow model (or loads the cache) and learns: each
// step pops the samplers' scored trajectories (synchronous: one batch from every sampler, each of
// conditions / N classes, so a step sees as many samples as a colocated one; asynchronous: the
// next batch of `conditions` classes drawn at most max_staleness versions ago), runs
// trainer::learn and publishes the new weights. The flow batches travel in the wire format
// (parallel/wire.hpp) with their behaviour log-probs; Flow-GRPO's ratio and Flow-DPPO's trust
// region are taken against them. It writes the colocated run's outputs (summary.json with the
// mode, sampler count, policy_version, staleness and dropped batches; metrics.jsonl; the reward
// curve; the sample grids). Ranks 1.. train the same classifier (the reward; seeded, identical on
// every rank), draw classes, sample trajectories with the newest weights they hold and score them.
// Flow-GRPO and Flow-DPPO only: RAM and DiffusionNFT sample from an EMA of the policy, which the
// split does not carry yet.
//
// Included by main.cpp after its helpers (flow_t, class_confidence, evaluate, example_options).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>

#include <unirl/parallel/c10d_transport.hpp>
#include <unirl/parallel/rollout_worker.hpp>

#include "common/split_mode.hpp"

namespace digits_flow_split {

// Classes per sampler batch: a synchronous step gathers one batch from every sampler.
inline std::int64_t classes_per_batch(const example_options& opt, const examples::split_mode& m) {
  const std::int64_t c = std::min<std::int64_t>(opt.conditions, 10);
  if (m.max_staleness > 0) return c;
  UNIRL_CHECK(c % m.samplers() == 0, "mode=split: conditions = ", c, " with ", m.samplers(),
              " samplers: expected a multiple of the sampler count (a synchronous step gathers one batch from "
              "every sampler)");
  return c / m.samplers();
}

template <class Algo>
int run(const examples::split_mode& m, const std::string& name, const typename Algo::options& algo,
        const example_options& opt, const std::string& root) {
  using algorithm_type = unirl::algorithm_for_t<Algo, flow_t>;
  if constexpr (algorithm_type::requires_ema_rollout) {
    throw unirl::config_error("mode", "split with --algorithm " + name +
                                          ": it samples from an EMA of the policy, which the split does not carry "
                                          "yet; expected --algorithm grpo or dppo");
  } else {
    using transport_t = unirl::parallel::c10d_transport<unirl::flow_rollout>;
    using trainer_t = unirl::trainer<flow_t, Algo, class_confidence>;
    const std::string out = root + "/" + name;
    const auto data = std::string(UNIRL_DATA_DIR) + "/digits.csv.gz";
    const std::int64_t per = classes_per_batch(opt, m);

    if (m.sampler()) {
      auto setup = examples::prepare_digits(data);  // the reward's classifier: the same on every rank
      unirl::models::mlp_velocity_net net = make_net(opt);
      auto tr = examples::split_transport<unirl::flow_rollout>(m);  // waits for rank 0's store
      // The learner's trainer options, as far as sampling reads them (no metrics file here).
      const typename trainer_t::options to{
          .algorithm = algo, .group_size = opt.group_size, .minibatches = opt.minibatches, .seed = opt.seed};
      unirl::parallel::rollout_worker<flow_t, Algo, class_confidence, transport_t> w(
          flow_t(net, {1, 8, 8}), class_confidence{setup.clf}, to, tr, tr.rank() - 1);
      while (w.run_once(torch::randperm(10, torch::kInt64).slice(0, 0, per))) {
      }
      std::cout << "sampler " << tr.rank() << ": " << w.batches() << " batches, last weights version " << w.version()
                << "\n";
      return 0;
    }

    std::filesystem::create_directories(out);
    auto setup = examples::prepare_digits(data);
    unirl::models::mlp_velocity_net net = make_net(opt);
    const double pretrain_seconds = pretrain(net, opt, root, setup);

    trainer_t t(flow_t(net, {1, 8, 8}), class_confidence{setup.clf},
                examples::trainer_options<trainer_t>(algo, opt, out));
    std::cout << t.describe() << "\n";
    flow_t reference = t.models().policy.clone();
    const auto before = evaluate(t.models().policy, reference, t.reward(), setup.real_features);
    std::cout << "before: reward " << before.reward << "  frechet " << before.frechet << "\n";

    auto tr = examples::split_transport<unirl::flow_rollout>(m);
    unirl::parallel::learner l{t, tr};  // version 0: the pretrained weights
    std::cout << "split: 1 learner + " << m.samplers() << " samplers, "
              << (m.max_staleness == 0 ? std::string("synchronous")
                                       : "asynchronous (max_staleness " + std::to_string(m.max_staleness) + ")")
              << ", " << per << " classes x " << opt.group_size << " samples per sampler batch\n";
    const auto start = std::chrono::steady_clock::now();
    double staleness_sum = 0, staleness_max = 0;
    for (std::int64_t s = 0; s < opt.steps; ++s) {
      const auto st = l.step(m.parts());
      UNIRL_CHECK(st.has_value(), "digits_flow: the samplers stopped at step ", s,
                  "; expected them to run until the learner finishes");
      const double k = st->extra.at("staleness");
      staleness_sum += k;
      staleness_max = std::max(staleness_max, k);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    l.finish();
    const auto after = evaluate(t.models().policy, reference, t.reward(), setup.real_features);
    std::cout << "\nafter:  reward " << after.reward << "  frechet " << after.frechet << "  kl " << after.kl << "  ("
              << opt.steps << " steps, " << seconds << " s; staleness mean "
              << (opt.steps > 0 ? staleness_sum / static_cast<double>(opt.steps) : 0.0) << ", max " << staleness_max
              << ", " << tr.dropped() << " batches dropped)\n";

    auto summary = examples::summarize(name, algo, before, after, opt);
    summary.seconds = seconds;
    summary.pretrain_seconds = pretrain_seconds;
    summary.classifier_accuracy = setup.accuracy;
    summary.extra = {{"frechet_before", before.frechet},
                     {"frechet_after", after.frechet},
                     {"reward_gain_per_step", (after.reward - before.reward) / static_cast<double>(opt.steps)},
                     {"reward_gain_per_second", (after.reward - before.reward) / seconds},
                     {"samples_per_step", per * m.parts() * opt.group_size},
                     {"split", m.to_json()},
                     {"policy_version", l.version()},
                     {"staleness_mean", opt.steps > 0 ? staleness_sum / static_cast<double>(opt.steps) : 0.0},
                     {"staleness_max", staleness_max},
                     {"dropped", tr.dropped()}};
    examples::write_outputs(out, "samples", before.samples.reshape({100, 8, 8}), after.samples.reshape({100, 8, 8}),
                            10, 10, 4, summary);
    return 0;
  }
}

}  // namespace digits_flow_split
