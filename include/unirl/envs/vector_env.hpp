#pragma once
/// \file vector_env.hpp
/// `vector_env<E>` steps N copies of an environment in lock-step with auto-reset (Gym's
/// `SyncVectorEnv`): when a copy's episode ends, its final reward and done flag are returned and
/// its observation is already the first one of the next episode. It records every finished
/// episode's return and length (Gym's `RecordEpisodeStatistics`, on the raw rewards), and can
/// clip box actions into the space (`ClipAction`) and normalise observations and rewards with
/// running statistics (`NormalizeObservation`, `NormalizeReward`, each followed by a clip).
/// `save` / `load` (`unirl::Checkpointable` when `E` is) carry all of it — options, each copy's
/// state and generator, the episode accumulators and records, the running statistics — so a run
/// resumed with `trainer::load(path, venv)` continues bit for bit.
///
/// Two ways to step: `step(tensor)` returns tensors; `step(actions, rewards, dones)` reads and
/// writes plain buffers (the observations are `observation_data()`), allocates nothing, and gives
/// the same numbers bit for bit — what the small-network path (`ppo_agent`, exec::small_net)
/// uses. With `threads` > 1 the copies of a costly simulator step concurrently, with results
/// independent of the thread count (each copy must own its state: copies of `E` share nothing).
///
/// ```cpp
/// unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
/// auto obs = venv.observations();                          // (4, 4) float
/// auto out = venv.step(torch::ones({4}, torch::kLong));    // out.rewards (4,), out.dones (4,)
/// double r = venv.mean_recent_return(20);                  // NaN until an episode ends
/// t.save("run/ckpt.pt", venv);                             // model and environments together
/// ```
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/environment.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/detail/worker_pool.hpp>
#include <unirl/train/checkpoint.hpp>

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
  std::int64_t threads = 1;           // > 1: the copies step on this many threads (one per contiguous
                                      // share, started per step: for simulators whose step costs more
                                      // than tens of microseconds); the results do not depend on it

  void validate(const std::string& prefix) const {
    options::require(num_envs >= 1, prefix + "num_envs", num_envs, ">= 1");
    options::require(threads >= 1, prefix + "threads", threads, ">= 1");
    options::require(observation_clip > 0, prefix + "observation_clip", observation_clip, "> 0");
    options::require(reward_gamma >= 0 && reward_gamma <= 1, prefix + "reward_gamma", reward_gamma, "in [0, 1]");
    options::require(reward_clip > 0, prefix + "reward_clip", reward_clip, "> 0");
  }
};

}  // namespace unirl::envs

BOOST_HANA_ADAPT_STRUCT(unirl::envs::vector_env_options, num_envs, seed, clip_actions, normalize_observation,
                        observation_clip, normalize_reward, reward_gamma, reward_clip, threads);

namespace unirl::envs {

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
    const auto x = batch.to(torch::kDouble).reshape({batch.size(0), -1}).contiguous();
    UNIRL_CHECK(x.size(1) == mean.size(0), "running_mean_std::update: rows of ", x.size(1), " values; expected ",
                mean.size(0));
    update(x.data_ptr<double>(), x.size(0));
  }

  /// Folds in `n` rows of `dim` values, row-major, on plain buffers: no tensor operation, so a
  /// vectorised environment's step pays loops over its rows, not a dozen LibTorch calls. The
  /// batch's mean and (biased) variance are taken in two passes in double. A tensor of `mean` or
  /// `var` held elsewhere keeps its values (they are replaced, not written into, when shared).
  template <class T>
  void update(const T* x, std::int64_t n) {
    if (n <= 0) return;
    if (mean.use_count() > 1) mean = mean.clone();
    if (var.use_count() > 1) var = var.clone();
    const auto dim = mean.size(0);
    double* m = mean.data_ptr<double>();
    double* v = var.data_ptr<double>();
    const double rows = static_cast<double>(n), tot = count + rows;
    for (std::int64_t d = 0; d < dim; ++d) {
      double sum = 0;
      for (std::int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i * dim + d]);
      const double bmean = sum / rows;
      double sq = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const double e = static_cast<double>(x[i * dim + d]) - bmean;
        sq += e * e;
      }
      const double bvar = sq / rows, delta = bmean - m[d];
      m[d] = m[d] + delta * (rows / tot);
      v[d] = (v[d] * count + bvar * rows + delta * delta * (count * rows / tot)) / tot;
    }
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
    if (opts_.normalize_observation) obs_rms_.update(raw_obs_.data_ptr<float>(), opts_.num_envs);
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

  /// Writes everything `load` needs to continue this vector bit for bit: the options (the seed
  /// later episodes derive from, the normalisation settings), each copy's environment state and
  /// generator (`E::save`, under `env.<i>`), the current observations and done flags, the
  /// per-copy return / length / episode counters and discounted returns, every finished episode,
  /// the running observation and return statistics and the step count.
  void save(torch::serialize::OutputArchive& a) const
    requires Checkpointable<E>
  {
    train::write_scalar(a, "vector_env.format", std::int64_t{1});
    train::write_scalar(a, "options", ::unirl::options::to_json(opts_).dump());
    train::write_scalar(a, "observation_size", observation_size);
    for (std::size_t i = 0; i < envs_.size(); ++i) {
      torch::serialize::OutputArchive env;
      envs_[i].save(env);
      a.write("env." + std::to_string(i), env);
    }
    a.write("raw_observations", raw_obs_, true);
    a.write("observations", obs_, true);
    a.write("dones", dones_, true);
    a.write("returns", to_tensor(returns_), true);
    a.write("lengths", to_tensor(lengths_), true);
    a.write("episode_counter", to_tensor(episode_counter_), true);
    a.write("discounted", to_tensor(discounted_), true);
    std::vector<double> ep_return;
    std::vector<std::int64_t> ep_length, ep_env;
    for (const auto& e : episodes_) {
      ep_return.push_back(e.episode_return);
      ep_length.push_back(e.length);
      ep_env.push_back(e.env_index);
    }
    a.write("episodes.return", to_tensor(ep_return), true);
    a.write("episodes.length", to_tensor(ep_length), true);
    a.write("episodes.env", to_tensor(ep_env), true);
    a.write("obs_rms.mean", obs_rms_.mean, true);
    a.write("obs_rms.var", obs_rms_.var, true);
    train::write_scalar(a, "obs_rms.count", obs_rms_.count);
    a.write("ret_rms.mean", ret_rms_.mean, true);
    a.write("ret_rms.var", ret_rms_.var, true);
    train::write_scalar(a, "ret_rms.count", ret_rms_.count);
    train::write_scalar(a, "env_steps", env_steps_);
  }

  /// Restores what `save` wrote, options included: a vector built with any options (another
  /// seed, another number of copies) continues the saved one. Each copy is a copy of this
  /// vector's first environment, then loaded. An archive of another environment type or with a
  /// missing or inconsistent entry throws `unirl::checkpoint_error` naming it, and leaves this
  /// vector unchanged.
  void load(torch::serialize::InputArchive& a)
    requires Checkpointable<E>
  {
    const std::string what = "vector_env::load";
    const auto format = train::read_scalar<std::int64_t>(a, "vector_env.format");
    if (format != 1)
      throw checkpoint_error(what + ": format " + std::to_string(format) + "; this build reads format 1");
    const auto obs_size = train::read_scalar<std::int64_t>(a, "observation_size");
    if (obs_size != observation_size)
      throw checkpoint_error(what + ": the checkpoint's observations have " + std::to_string(obs_size) +
                             " components; this environment's have " + std::to_string(observation_size));
    vector_env_options o;
    try {
      ::unirl::options::from_json(o, nlohmann::json::parse(train::read_scalar<std::string>(a, "options")));
      o.validate("vector_env.");
    } catch (const checkpoint_error&) {
      throw;
    } catch (const std::exception& e) {
      throw checkpoint_error(what + ": the stored options are invalid: " + e.what());
    }
    const auto n = static_cast<std::size_t>(o.num_envs);
    std::vector<E> envs(n, envs_.front());
    for (std::size_t i = 0; i < n; ++i) {
      auto sub = train::read_archive(a, "env." + std::to_string(i), what);
      envs[i].load(sub);
    }
    const auto obs_shape = std::vector<std::int64_t>{o.num_envs, observation_size};
    auto raw = checked(a, "raw_observations", torch::kFloat, obs_shape);
    auto obs = checked(a, "observations", torch::kFloat, obs_shape);
    auto dones = checked(a, "dones", torch::kFloat, {o.num_envs});
    const auto returns = from_tensor<double>(checked(a, "returns", torch::kDouble, {o.num_envs}));
    const auto lengths = from_tensor<std::int64_t>(checked(a, "lengths", torch::kLong, {o.num_envs}));
    const auto counter = from_tensor<std::int64_t>(checked(a, "episode_counter", torch::kLong, {o.num_envs}));
    const auto discounted = from_tensor<double>(checked(a, "discounted", torch::kDouble, {o.num_envs}));
    const auto ep_return = from_tensor<double>(train::read_tensor(a, "episodes.return", what));
    const auto ep_length = from_tensor<std::int64_t>(checked(a, "episodes.length", torch::kLong,
                                                             {static_cast<std::int64_t>(ep_return.size())}));
    const auto ep_env = from_tensor<std::int64_t>(checked(a, "episodes.env", torch::kLong,
                                                          {static_cast<std::int64_t>(ep_return.size())}));
    running_mean_std obs_rms(observation_size), ret_rms(1);
    obs_rms.mean = checked(a, "obs_rms.mean", torch::kDouble, {observation_size});
    obs_rms.var = checked(a, "obs_rms.var", torch::kDouble, {observation_size});
    obs_rms.count = train::read_scalar<double>(a, "obs_rms.count");
    ret_rms.mean = checked(a, "ret_rms.mean", torch::kDouble, {1});
    ret_rms.var = checked(a, "ret_rms.var", torch::kDouble, {1});
    ret_rms.count = train::read_scalar<double>(a, "ret_rms.count");
    const auto env_steps = train::read_scalar<std::int64_t>(a, "env_steps");

    opts_ = o;
    envs_ = std::move(envs);
    raw_obs_ = std::move(raw);
    obs_ = std::move(obs);
    dones_ = std::move(dones);
    returns_ = returns;
    lengths_ = lengths;
    episode_counter_ = counter;
    discounted_ = discounted;
    episodes_.clear();
    for (std::size_t i = 0; i < ep_return.size(); ++i) episodes_.push_back({ep_return[i], ep_length[i], ep_env[i]});
    obs_rms_ = std::move(obs_rms);
    ret_rms_ = std::move(ret_rms);
    env_steps_ = env_steps;
  }

  /// Running return statistics (meaningful when `normalize_reward`).
  const running_mean_std& return_statistics() const { return ret_rms_; }

  /// Steps every copy. `actions`: (N,) integers for a discrete space, (N, A) floats for a box.
  vector_step step(const torch::Tensor& actions) {
    const auto n = opts_.num_envs;
    auto a = actions.detach().to(torch::kCPU);
    auto rewards = torch::empty({n}, torch::kDouble);
    auto dones = torch::zeros({n});
    auto term = torch::zeros({n}, torch::kBool);
    auto trunc = torch::zeros({n}, torch::kBool);
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
    step_copies(a.data_ptr<action_scalar>(), rewards.data_ptr<double>(), dones.data_ptr<float>(), term.data_ptr<bool>(),
                trunc.data_ptr<bool>());
    if (opts_.normalize_reward) rewards = normalize_reward(rewards, dones.data_ptr<float>());
    if (opts_.normalize_observation) obs_rms_.update(raw_obs_.data_ptr<float>(), opts_.num_envs);
    obs_ = normalize_obs(raw_obs_);
    dones_ = dones;
    return {obs_, rewards.to(torch::kFloat), dones, term, trunc};
  }

  /// One action component: `std::int64_t` (discrete) or `float` (box).
  using action_scalar = std::conditional_t<discrete, std::int64_t, float>;
  /// Components per action: 1 (discrete) or the box's dimension.
  static constexpr std::int64_t action_components = [] {
    if constexpr (discrete) return std::int64_t{1};
    else return static_cast<std::int64_t>(E::action_space_type::dim);
  }();

  /// Steps every copy without tensors, for a caller that keeps its rollout in plain buffers (the
  /// small-network path, exec::small_net): `actions` holds N x `action_components` values
  /// row-major, `rewards` and `dones` receive N floats each (the training reward, normalised when
  /// enabled, and 1 where the episode ended), and the next observations are `observation_data()`.
  /// The results are those of `step(tensor)` with the same actions, bit for bit; nothing is
  /// allocated once the first call has run (unless a caller still holds `observations()` /
  /// `dones()` tensors, which keep their values: those are replaced, not overwritten).
  void step(const action_scalar* actions, float* rewards, float* dones) {
    const auto n = static_cast<std::size_t>(opts_.num_envs);
    UNIRL_CHECK(actions != nullptr && rewards != nullptr && dones != nullptr,
                "vector_env::step: a null buffer (actions, rewards and dones must each hold ", n, " rows)");
    if (plain_rewards_.size() != n) {
      plain_rewards_.resize(n);
      plain_term_.resize(n);
      plain_trunc_.resize(n);
    }
    std::fill(dones, dones + n, 0.0f);
    step_copies(actions, plain_rewards_.data(), dones, plain_term_.data(), plain_trunc_.data());
    if (opts_.normalize_reward) {
      const double sd = update_return_statistics(plain_rewards_.data(), dones);
      for (std::size_t i = 0; i < n; ++i)
        rewards[i] = static_cast<float>(std::clamp(plain_rewards_[i] / sd, -opts_.reward_clip, opts_.reward_clip));
    } else {
      for (std::size_t i = 0; i < n; ++i) rewards[i] = static_cast<float>(plain_rewards_[i]);
    }
    if (opts_.normalize_observation) obs_rms_.update(raw_obs_.data_ptr<float>(), opts_.num_envs);
    if (obs_.use_count() > 1) obs_ = torch::empty_like(raw_obs_);
    normalize_obs_into(obs_.data_ptr<float>());
    if (dones_.use_count() > 1) dones_ = torch::empty({opts_.num_envs});
    std::copy(dones, dones + n, dones_.data_ptr<float>());
  }

  /// The current observations, N x D floats row-major (normalised when enabled): the buffer
  /// behind `observations()`, valid until the next `step`.
  const float* observation_data() const { return obs_.data_ptr<float>(); }
  /// The current done flags (N floats, CleanRL's `next_done`): the buffer behind `dones()`.
  const float* done_data() const { return dones_.data_ptr<float>(); }

 private:
  template <class T>
  static torch::Tensor to_tensor(const std::vector<T>& v) {
    auto t = torch::empty({static_cast<std::int64_t>(v.size())}, std::is_same_v<T, double> ? torch::kDouble : torch::kLong);
    if (!v.empty()) std::copy(v.begin(), v.end(), t.template data_ptr<T>());
    return t;
  }
  template <class T>
  static std::vector<T> from_tensor(const torch::Tensor& t) {
    const auto c = t.to(std::is_same_v<T, double> ? torch::kDouble : torch::kLong).contiguous();
    return std::vector<T>(c.template data_ptr<T>(), c.template data_ptr<T>() + c.numel());
  }
  // The tensor under `key`, checked for its dtype and shape (a clone: independent of the archive).
  static torch::Tensor checked(torch::serialize::InputArchive& a, const std::string& key, torch::ScalarType dtype,
                               const std::vector<std::int64_t>& shape) {
    auto t = train::read_tensor(a, key, "vector_env::load");
    if (t.scalar_type() != dtype || t.sizes() != torch::IntArrayRef(shape))
      throw checkpoint_error(c10::str("vector_env::load: tensor '", key, "' is ", t.scalar_type(), " of shape ",
                                      t.sizes(), "; expected ", dtype, " of shape ", torch::IntArrayRef(shape)));
    return t.clone();
  }

  // Steps copy i with actions[i * action_components ...], writing its raw reward, done flag and
  // terminated / truncated flags, recording a finished episode and auto-resetting. With
  // `threads` > 1 the copies are split into that many contiguous shares stepped concurrently on
  // a pool started at the first such step and kept (each copy touches only its own state and
  // rows; one share runs on the calling thread), and the finished episodes are recorded
  // afterwards in copy order — the order of the sequential loop — so nothing depends on it.
  template <class Flag>
  void step_copies(const action_scalar* actions, double* rw, float* dn, Flag* tm, Flag* tr) {
    const auto n = opts_.num_envs;
    const auto workers = std::min<std::int64_t>(opts_.threads, n);
    if (ended_.size() != static_cast<std::size_t>(n)) ended_.assign(static_cast<std::size_t>(n), 0);
    auto one = [&](std::int64_t i) {
      auto& env = envs_[static_cast<std::size_t>(i)];
      step_result<typename E::observation_type> r;
      if constexpr (discrete) {
        r = env.step(actions[i]);
      } else {
        typename E::action_type act;
        const float* p = actions + i * action_components;
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
      ended_[k] = 0;
      if (r.terminated || r.truncated) {
        dn[i] = 1.0f;
        ended_[k] = 1;
        ended_return_[k] = returns_[k];
        ended_length_[k] = lengths_[k];
        returns_[k] = 0.0;
        lengths_[k] = 0;
        ++episode_counter_[k];
        write_obs(k, env.reset(episode_seed(k)));
      } else {
        write_obs(k, r.observation);
      }
    };
    ended_return_.resize(static_cast<std::size_t>(n));
    ended_length_.resize(static_cast<std::size_t>(n));
    if (workers <= 1) {
      for (std::int64_t i = 0; i < n; ++i) {
        one(i);
        if (ended_[static_cast<std::size_t>(i)]) record_episode(i);
      }
    } else {
      if (!pool_.p || pool_.p->size() < workers) pool_.p = std::make_unique<::unirl::detail::worker_pool>(workers - 1);
      std::exception_ptr error;
      try {
        pool_.p->run(workers, [&](std::int64_t w) {
          for (std::int64_t i = w * n / workers; i < (w + 1) * n / workers; ++i) one(i);
        });
      } catch (...) {
        error = std::current_exception();  // after the episodes of the copies that stepped
      }
      for (std::int64_t i = 0; i < n; ++i)
        if (ended_[static_cast<std::size_t>(i)]) record_episode(i);
      if (error) std::rethrow_exception(error);
    }
    env_steps_ += n;
  }

  void record_episode(std::int64_t i) {
    const auto k = static_cast<std::size_t>(i);
    episodes_.push_back({ended_return_[k], ended_length_[k], i});
    ended_[k] = 0;
  }

  // The plain path's normalise_obs: the same double arithmetic, element by element.
  void normalize_obs_into(float* out) const {
    const float* raw = raw_obs_.data_ptr<float>();
    const auto count = opts_.num_envs * observation_size;
    if (!opts_.normalize_observation) {
      std::copy(raw, raw + count, out);
      return;
    }
    const double* mean = obs_rms_.mean.data_ptr<double>();
    const double* var = obs_rms_.var.data_ptr<double>();
    for (std::int64_t i = 0; i < count; ++i) {
      const auto d = i % observation_size;
      const double z = (static_cast<double>(raw[i]) - mean[d]) / std::sqrt(var[d] + 1e-8);
      out[i] = static_cast<float>(std::clamp(z, -opts_.observation_clip, opts_.observation_clip));
    }
  }

  // The plain path's normalize_reward up to the division: folds the discounted returns into the
  // running statistics (resetting those whose episode ended) and returns sqrt(var + 1e-8).
  double update_return_statistics(const double* r, const float* dones) {
    plain_disc_.resize(static_cast<std::size_t>(opts_.num_envs));
    for (std::int64_t i = 0; i < opts_.num_envs; ++i) {
      auto& g = discounted_[static_cast<std::size_t>(i)];
      g = g * opts_.reward_gamma + r[i];
      plain_disc_[static_cast<std::size_t>(i)] = g;
    }
    ret_rms_.update(plain_disc_.data(), opts_.num_envs);
    const double sd = std::sqrt(ret_rms_.var.template data_ptr<double>()[0] + 1e-8);
    for (std::int64_t i = 0; i < opts_.num_envs; ++i)
      if (dones[i] != 0.0f) discounted_[static_cast<std::size_t>(i)] = 0.0;
    return sd;
  }

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
    const double sd = update_return_statistics(rewards.data_ptr<double>(), dones);
    return (rewards / sd).clamp(-opts_.reward_clip, opts_.reward_clip);
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
  // Scratch of the plain step (sized once).
  std::vector<double> plain_rewards_, plain_disc_;
  std::vector<std::uint8_t> plain_term_, plain_trunc_;
  // Episodes that ended in the current step, per copy (recorded in copy order after it).
  std::vector<std::uint8_t> ended_;
  std::vector<double> ended_return_;
  std::vector<std::int64_t> ended_length_;
  // The stepping threads (`threads` > 1), started once; a copy or a moved-to environment starts
  // its own (threads are not shared between environments).
  struct pool_holder {
    std::unique_ptr<::unirl::detail::worker_pool> p;
    pool_holder() = default;
    pool_holder(const pool_holder&) {}
    pool_holder(pool_holder&&) noexcept {}
    pool_holder& operator=(const pool_holder&) { return *this; }
    pool_holder& operator=(pool_holder&&) noexcept { return *this; }
  } pool_;
};

}  // namespace unirl::envs
