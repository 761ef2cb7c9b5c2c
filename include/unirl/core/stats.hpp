#pragma once
/// \file stats.hpp
/// What one `trainer::step()` reports, and what an algorithm's loss returns per minibatch.
#include <cstdint>
#include <map>
#include <string>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace unirl {

/// The parts of one minibatch's loss. `total` carries the graph; the rest are detached figures.
struct loss_terms {
  torch::Tensor total;        // () float, differentiable
  double policy = 0.0;        // policy-gradient part
  double value = 0.0;         // critic part (PPO)
  double kl = 0.0;            // KL to the reference (as a loss term or as measured)
  double entropy = 0.0;       // mean entropy of the policy
  double ratio_mean = 1.0;    // mean importance ratio pi/pi_old
  double clip_fraction = 0.0; // share of (token | step) terms whose ratio was clipped / masked
  std::map<std::string, double> extra{};  // algorithm-specific figures, reported as-is
};

/// Statistics of one training step: the loop's five stages, the loss parts, and the guard.
struct step_stats {
  std::int64_t step = 0;
  std::int64_t samples = 0;
  double reward_mean = 0, reward_std = 0, reward_min = 0, reward_max = 0;
  double advantage_mean = 0, advantage_std = 0;
  double loss = 0, policy_loss = 0, value_loss = 0, kl = 0, entropy = 0;
  double ratio_mean = 1, clip_fraction = 0;
  double grad_norm = 0, learning_rate = 0;
  double time_sample = 0, time_reward = 0, time_advantage = 0, time_update = 0, time_sync = 0;
  double seconds = 0, samples_per_second = 0;
  std::int64_t optimizer_steps = 0;   // optimizer steps taken in this step
  std::int64_t skipped_updates = 0;   // updates skipped by the stability guard in this step
  std::int64_t skipped_total = 0;     // ... since the start of training
  bool loss_spike = false, grad_spike = false;
  std::map<std::string, double> extra{};  // per-reward-component means, algorithm figures

  /// One flat JSON object (the `extra` figures merged in), as written to metrics.jsonl.
  nlohmann::json to_json() const;
};
}  // namespace unirl

BOOST_HANA_ADAPT_STRUCT(unirl::step_stats, step, samples, reward_mean, reward_std, reward_min,
                        reward_max, advantage_mean, advantage_std, loss, policy_loss, value_loss,
                        kl, entropy, ratio_mean, clip_fraction, grad_norm, learning_rate,
                        time_sample, time_reward, time_advantage, time_update, time_sync, seconds,
                        samples_per_second, optimizer_steps, skipped_updates, skipped_total,
                        loss_spike, grad_spike);

inline nlohmann::json unirl::step_stats::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  boost::hana::for_each(boost::hana::accessors<step_stats>(), [&](auto pair) {
    j[boost::hana::to<const char*>(boost::hana::first(pair))] = boost::hana::second(pair)(*this);
  });
  for (const auto& [k, v] : extra) j[k] = v;
  return j;
}
