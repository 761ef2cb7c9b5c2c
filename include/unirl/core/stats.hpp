#pragma once
/// \file stats.hpp
/// What one `trainer::step()` reports, and what an algorithm's loss returns per minibatch.
#include <cstdint>
#include <map>
#include <string>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/host.hpp>

namespace unirl {

/// A figure of a minibatch's loss, kept as a detached scalar tensor where it was computed so that
/// the trainer reads all of a step's figures at once (one host synchronisation per step). It
/// converts to `double` for the reader who wants one now (that conversion reads it, through
/// `unirl::to_host`); a plain number is stored as is.
/// ```cpp
/// unirl::scalar_stat s = policy_loss.detach();   // no read
/// double v = s;                                  // one read
/// ```
struct scalar_stat {
  torch::Tensor value{};  // () detached; undefined: the number `fallback`
  double fallback = 0.0;

  scalar_stat() = default;
  scalar_stat(double v) : fallback(v) {}                                       // NOLINT: implicit by design
  scalar_stat(const torch::Tensor& t) : value(t.defined() ? t.detach().reshape({}) : t) {}  // NOLINT
  /// Reads the value (one host synchronisation when it is a tensor).
  operator double() const {  // NOLINT: implicit by design
    if (!value.defined()) return fallback;
    const auto v = to_host(value);
    return v.empty() ? fallback : v.front();
  }
  /// The value as a () float64 tensor on `device`, without reading it.
  torch::Tensor tensor(torch::Device device) const {
    return value.defined() ? value.to(device, torch::kFloat64)
                           : torch::full({}, fallback, torch::TensorOptions(torch::kFloat64).device(device));
  }
};

/// The parts of one minibatch's loss. `total` carries the graph; the rest are detached figures
/// (`scalar_stat`: tensors the trainer reads once per step).
struct loss_terms {
  torch::Tensor total;             // () float, differentiable
  scalar_stat policy{};            // policy-gradient part
  scalar_stat value{};             // critic part (PPO)
  scalar_stat kl{};                // KL to the reference (as a loss term or as measured)
  scalar_stat entropy{};           // mean entropy of the policy
  scalar_stat ratio_mean{1.0};     // mean importance ratio pi/pi_old
  scalar_stat clip_fraction{};     // share of (token | step) terms whose ratio was clipped / masked
  std::map<std::string, scalar_stat> extra{};  // algorithm-specific figures, reported as-is
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
