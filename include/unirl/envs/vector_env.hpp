#pragma once
/// \file vector_env.hpp
/// `vector_env<E>` steps N copies of an environment in lock-step with auto-reset (Gym's
/// `SyncVectorEnv`): when a copy's episode ends, its final reward and done flag are returned and
/// its observation is already the first one of the next episode. It records every finished
/// episode's return and length (Gym's `RecordEpisodeStatistics`, on the raw rewards), and can
/// clip box actions into the space (`ClipAction`) and normalise observations and rewards with
/// running statistics (`NormalizeObservation`, `NormalizeReward`, each followed by a clip).
///
/// ```cpp
/// unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
/// auto obs = venv.observations();                          // (4, 4) float
/// auto out = venv.step(torch::ones({4}, torch::kLong));    // out.rewards (4,), out.dones (4,)
/// double r = venv.mean_recent_return(20);                  // NaN until an episode ends
/// ```
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/environment.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::envs {

/// Settings of a `vector_env`.
struct vector_env_options {
  std::int64_t num_envs = 4;          // copies stepped together
  std::int64_t seed = 1;              // copy i starts from seed + i; later episodes from derived seeds
  bool clip_actions = true;           // box actions are clipped into the space before stepping
  bool normalize_observation = false; // running mean / std of observations (shared by the copies)
  double observation_clip = 10.0;     // |normalised observation| <= this
  bool normalize_reward = false;      // rewards / std of the discounted return
  double reward_gamma = 0.99;         // discount of that return
  double reward_clip = 10.0;          // |normalised reward| <= this

  void validate(const std::string& prefix) const {
    options::require(num_envs >= 1, prefix + "num_envs", num_envs, ">= 1");
    options::require(observation_clip > 0, prefix + "observation_clip", observation_clip, "> 0");
    options::require(reward_gamma >= 0 && reward_gamma <= 1, prefix + "reward_gamma", reward_gamma, "in [0, 1]");
    options::require(reward_clip > 0, prefix + "reward_clip", reward_clip, "> 0");
  }
};

/// One finished episode: undiscounted raw return, length in steps, and which copy ran it.
struct episode_record {
  double episode_return = 0.0;
  std::int64_t length = 0;
  std::int64_t env_index = 0;
};

/// Running mean and variance over batches (Chan et al.'s parallel update, as Gym's `RunningMeanStd`).
struct running_mean_std {
  torch::Tensor mean, var;  // float64
  double count = 1e-4;

  explicit running_mean_std(std::int64_t dim = 1)
      : mean(torch::zeros({dim}, torch::kDouble)), var(torch::ones({dim}, torch::kDouble)) {}

  /// Folds in a (n, dim) batch.
  void update(const torch::Tensor& batch) {
    const auto x = batch.to(torch::kDouble).reshape({batch.size(0), -1});
    const double n = static_cast<double>(x.size(0));
    const auto bmean = x.mean(0);
    const auto bvar = x.var(0, /*unbiased=*/false);
    const auto delta = bmean - mean;
    const double tot = count + n;
    mean = mean + delta * (n / tot);
    var = (var * count + bvar * n + delta * delta * (count * n / tot)) / tot;
    count = tot;
  }
};

/// The result of one `vector_env::step`.
struct vector_step {
  torch::Tensor observations;  // (N, D) float: next observations (first of a new episode after a done)
  torch::Tensor rewards;       // (N,) float: rewards used for training (normalised when enabled)
  torch::Tensor dones;         // (N,) float: 1 where the episode ended (terminated or truncated)
  torch::Tensor terminated;    // (N,) bool
  torch::Tensor truncated;     // (N,) bool
};

/// N copies of `E` with auto-reset and episode statistics.
template <Environment E>
class vector_env {
 public:
  using env_type = E;
  static constexpr bool discrete = DiscreteEnvironment<E>;
  static constexpr std::int64_t observation_size = static_cast<std::int64_t>(E::observation_size);

  /// Copies `prototype` `opts.num_envs` times and resets copy i with seed `opts.seed + i`.
  explicit vector_env(const E& prototype = E{}, vector_env_options opts = {})
      : opts_(opts), obs_rms_(observation_size) {
    opts_.validate("vector_env.");
    envs_.assign(static_cast<std::size_t>(opts_.num_envs), prototype);
    raw_obs_ = torch::zeros({opts_.num_envs, observation_size});
    returns_.assign(envs_.size(), 0.0);
    lengths_.assign(envs_.size(), 0);
    episode_counter_.assign(envs_.size(), 0);
    discounted_.assign(envs_.size(), 0.0);
    for (std::size_t i = 0; i < envs_.size(); ++i) write_obs(i, envs_[i].reset(episode_seed(i)));
    if (opts_.normalize_observation) obs_rms_.update(raw_obs_);
    dones_ = torch::zeros({opts_.num_envs});
    obs_ = normalize_obs(raw_obs_);
  }

  std::int64_t num_envs() const { return opts_.num_envs; }
  const vector_env_options& options() const { return opts_; }
  typename E::action_space_type action_space() const { return envs_.front().action_space(); }
  /// Number of discrete actions (discrete spaces) or the action dimension (box spaces).
  std::int64_t action_dim() const {
    if constexpr (discrete) return action_space().n;
    else return static_cast<std::int64_t>(E::action_space_type::dim);
  }

  /// The current observations (N, D) float, normalised when enabled.
  const torch::Tensor& observations() const { return obs_; }
  /// 1 where the current observation is the first of an episode that followed a done (CleanRL's `next_done`).
  const torch::Tensor& dones() const { return dones_; }
  /// Environment steps taken so far, over all copies.
  std::int64_t env_steps() const { return env_steps_; }
  /// Every episode finished so far, in the order they ended.
  const std::vector<episode_record>& episodes() const { return episodes_; }
  /// Mean raw return of the last `k` finished episodes (NaN when none has finished).
  double mean_recent_return(std::size_t k) const {
    if (episodes_.empty()) return std::numeric_limits<double>::quiet_NaN();
    const std::size_t n = std::min(k, episodes_.size());
    double s = 0;
    for (std::size_t i = episodes_.size() - n; i < episodes_.size(); ++i) s += episodes_[i].episode_return;
    return s / static_cast<double>(n);
  }
  /// Mean length of the last `k` finished episodes (NaN when none has finished).
  double mean_recent_length(std::size_t k) const {
    if (episodes_.empty()) return std::numeric_limits<double>::quiet_NaN();
    const std::size_t n = std::min(k, episodes_.size());
    double s = 0;
    for (std::size_t i = episodes_.size() - n; i < episodes_.size(); ++i) s += static_cast<double>(episodes_[i].length);
    return s / static_cast<double>(n);
  }
  /// Running observation statistics (meaningful when `normalize_observation`).
  const running_mean_std& observation_statistics() const { return obs_rms_; }

  /// Steps every copy. `actions`: (N,) integers for a discrete space, (N, A) floats for a box.
  vector_step step(const torch::Tensor& actions) {
    const auto n = opts_.num_envs;
    auto a = actions.detach().to(torch::kCPU);
    auto rewards = torch::empty({n}, torch::kDouble);
    auto dones = torch::zeros({n});
    auto term = torch::zeros({n}, torch::kBool);
    auto trunc = torch::zeros({n}, torch::kBool);
    auto* rw = rewards.data_ptr<double>();
    auto* dn = dones.data_ptr<float>();
    auto* tm = term.data_ptr<bool>();
    auto* tr = trunc.data_ptr<bool>();
    if constexpr (discrete) {
      UNIRL_CHECK(a.dim() == 1 && a.size(0) == n && !a.is_floating_point(), "vector_env::step: actions of shape ",
                  a.sizes(), " and type ", a.scalar_type(), ": expected (", n, ",) integers for a discrete space");
      a = a.to(torch::kLong).contiguous();
    } else {
      constexpr auto d = static_cast<std::int64_t>(E::action_space_type::dim);
      UNIRL_CHECK(a.dim() == 2 && a.size(0) == n && a.size(1) == d && a.is_floating_point(),
                  "vector_env::step: actions of shape ", a.sizes(), " and type ", a.scalar_type(), ": expected (", n,
                  ", ", d, ") floats for a box space");
      a = a.to(torch::kFloat).contiguous();
    }
    for (std::int64_t i = 0; i < n; ++i) {
      auto& env = envs_[static_cast<std::size_t>(i)];
      step_result<typename E::observation_type> r;
      if constexpr (discrete) {
        r = env.step(a.data_ptr<std::int64_t>()[i]);
      } else {
        typename E::action_type act;
        const float* p = a.data_ptr<float>() + i * static_cast<std::int64_t>(act.size());
        std::copy(p, p + act.size(), act.begin());
        if (opts_.clip_actions) act = env.action_space().clip(act);
        r = env.step(act);
      }
      const auto k = static_cast<std::size_t>(i);
      returns_[k] += r.reward;
      lengths_[k] += 1;
      rw[i] = r.reward;
      tm[i] = r.terminated;
      tr[i] = r.truncated;
      if (r.terminated || r.truncated) {
        dn[i] = 1.0f;
        episodes_.push_back({returns_[k], lengths_[k], i});
        returns_[k] = 0.0;
        lengths_[k] = 0;
        ++episode_counter_[k];
        write_obs(k, env.reset(episode_seed(k)));
      } else {
        write_obs(k, r.observation);
      }
    }
    env_steps_ += n;
    if (opts_.normalize_reward) rewards = normalize_reward(rewards, dn);
    if (opts_.normalize_observation) obs_rms_.update(raw_obs_);
    obs_ = normalize_obs(raw_obs_);
    dones_ = dones;
    return {obs_, rewards.to(torch::kFloat), dones, term, trunc};
  }

 private:
  // splitmix64 of (seed, copy, episode): distinct, reproducible start states for every episode.
  std::uint64_t episode_seed(std::size_t i) const {
    if (episode_counter_[i] == 0) return static_cast<std::uint64_t>(opts_.seed) + i;
    std::uint64_t z = static_cast<std::uint64_t>(opts_.seed) * 0x9E3779B97F4A7C15ULL + (i << 32) +
                      static_cast<std::uint64_t>(episode_counter_[i]);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  void write_obs(std::size_t i, const typename E::observation_type& o) {
    float* p = raw_obs_.data_ptr<float>() + static_cast<std::int64_t>(i) * observation_size;
    std::copy(o.begin(), o.end(), p);
  }
  torch::Tensor normalize_obs(const torch::Tensor& raw) const {
    if (!opts_.normalize_observation) return raw.clone();
    auto z = (raw.to(torch::kDouble) - obs_rms_.mean) / torch::sqrt(obs_rms_.var + 1e-8);
    return z.clamp(-opts_.observation_clip, opts_.observation_clip).to(torch::kFloat);
  }
  torch::Tensor normalize_reward(const torch::Tensor& rewards, const float* dones) {
    auto disc = torch::empty({opts_.num_envs}, torch::kDouble);
    const auto* r = rewards.data_ptr<double>();
    for (std::int64_t i = 0; i < opts_.num_envs; ++i) {
      auto& g = discounted_[static_cast<std::size_t>(i)];
      g = g * opts_.reward_gamma + r[i];
      disc.data_ptr<double>()[i] = g;
    }
    ret_rms_.update(disc.reshape({-1, 1}));
    auto out = (rewards / std::sqrt(ret_rms_.var.item<double>() + 1e-8)).clamp(-opts_.reward_clip, opts_.reward_clip);
    for (std::int64_t i = 0; i < opts_.num_envs; ++i)
      if (dones[i] != 0.0f) discounted_[static_cast<std::size_t>(i)] = 0.0;
    return out;
  }

  vector_env_options opts_;
  std::vector<E> envs_;
  torch::Tensor raw_obs_, obs_, dones_;
  std::vector<double> returns_;
  std::vector<std::int64_t> lengths_;
  std::vector<std::int64_t> episode_counter_;
  std::vector<double> discounted_;
  std::vector<episode_record> episodes_;
  running_mean_std obs_rms_, ret_rms_{1};
  std::int64_t env_steps_ = 0;
};

}  // namespace unirl::envs

BOOST_HANA_ADAPT_STRUCT(unirl::envs::vector_env_options, num_envs, seed, clip_actions, normalize_observation,
                        observation_clip, normalize_reward, reward_gamma, reward_clip);
