#pragma once
/// \file agent.hpp
/// `ppo_agent`: PPO on a vectorised C++ environment (CleanRL's `ppo.py` /
/// `ppo_continuous_action.py`) behind a small API a host program drives — `collect(venv)` steps
/// the environments, `update()` learns from what was collected, `step(venv)` is both — on one of
/// two paths chosen at construction by the execution policy:
/// - **small-network kernels** (`exec::small_net`, ops/small_net.hpp): the rollout in plain
///   buffers, sampling, GAE, the PPO loss with its hand-written gradient, gradient clipping and
///   Adam on Eigen — no tensor and no allocation per step;
/// - **LibTorch** (`exec::reference`, `exec::cpu`): the `trainer` with `algo::ppo`, the reference.
///
/// `exec::automatic` (the default) takes the kernels when the policy is of the forms they know
/// (`models::categorical_actor_critic`, `models::gaussian_actor_critic` on the CPU), the options
/// use only what they implement (no KL term, dual clip, weight decay, parameter groups,
/// micro-batches, mixed precision or loss scaling) and the network is small
/// (`exec::small_net_fits`: widths <= 256, <= 100k parameters); otherwise LibTorch.
/// `exec::small_net` insists (an option the kernels lack is an error naming it). The options are
/// the trainer's, so one configuration runs on either path.
///
/// ```cpp
/// using agent_t = unirl::ppo_agent<unirl::models::categorical, unirl::envs::cartpole>;
/// unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
/// agent_t agent(unirl::models::categorical_actor_critic(4, 2),
///               {.algorithm = {.track = {.rollout_steps = 128}}, .optim = {.lr = 2.5e-4, .eps = 1e-5},
///                .clip = {.max_grad_norm = 0.5}, .epochs = 4, .minibatches = 4});
/// agent.collect(venv);                  // 512 transitions
/// unirl::step_stats s = agent.update(); // 16 minibatch updates
/// auto policy = agent.policy();         // a LibTorch actor-critic with the current weights
/// ```
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/algorithms/ppo_env.hpp>
#include <unirl/concepts/environment.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/ops/small_net.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/metrics.hpp>
#include <unirl/train/schedule.hpp>
#include <unirl/trainer.hpp>

namespace unirl {

/// PPO on `envs::vector_env<E>` with `models::actor_critic<Dist>`, on the small-network kernels
/// or on LibTorch (see the file comment). `Scalar` is the kernels' floating type.
template <class Dist, Environment E, ExecutionPolicy Exec = exec::automatic, class Scalar = float>
class ppo_agent {
  static constexpr bool explicit_kernels = std::is_same_v<Exec, exec::small_net>;
  static_assert(!explicit_kernels || models::has_small_net<Dist>,
                "unirl::ppo_agent: exec::small_net needs an actor-critic the kernels implement (categorical or "
                "diag_gaussian); use exec::automatic or exec::reference for this one");
  // The LibTorch path's algorithm: the agent's policy, or automatic under exec::small_net.
  using torch_exec = std::conditional_t<explicit_kernels, exec::automatic, Exec>;

 public:
  using policy_type = models::actor_critic<Dist>;
  using env_type = envs::vector_env<E>;
  using trainer_type = trainer<policy_type, algo::ppo<torch_exec>, rewards::environment_reward>;
  /// The trainer's options (those of `trainer<policy_type, algo::ppo<>, environment_reward>`,
  /// whatever `Exec`: one configuration for every path).
  using options = typename trainer<policy_type, algo::ppo<>, rewards::environment_reward>::options;
  using action_scalar = typename env_type::action_scalar;

  /// Builds the agent on the path the policy `Exec` selects for `policy` and `o` (see the file
  /// comment); the kernels start from `policy`'s weights.
  ppo_agent(policy_type policy, options o) : opts_(std::move(o)), policy_(std::move(policy)) {
    ::unirl::options::validate(opts_);
    const std::string unsupported = kernel_gap();
    if constexpr (explicit_kernels)
      UNIRL_CHECK(unsupported.empty(), "ppo_agent<exec::small_net>: ", unsupported,
                  ": the small-network kernels do not implement it (use exec::automatic or exec::reference)");
    bool kernels = false;
    if constexpr (models::has_small_net<Dist>) {
      kernels = unsupported.empty() && (explicit_kernels || (exec::decides_by_size<Exec> && small_enough()));
    }
    if (kernels) {
      if constexpr (models::has_small_net<Dist>) build_kernels();
    } else {
      typename trainer_type::options to;  // the same fields (under another algorithm type when Exec is not automatic)
      if constexpr (std::is_same_v<typename trainer_type::options, options>) to = opts_;
      else ::unirl::options::from_json(to, ::unirl::options::to_json(opts_));
      trainer_.emplace(policy_, rewards::environment_reward{}, to);
    }
  }

  /// True when the small-network kernels run this agent; false on the LibTorch path.
  bool uses_small_net() const { return !trainer_.has_value(); }
  /// "small_net" or "libtorch".
  std::string path() const { return uses_small_net() ? "small_net" : "libtorch"; }
  const options& opts() const { return opts_; }
  /// Updates done so far (the trainer's `step_count`).
  std::int64_t step_count() const { return trainer_ ? trainer_->step_count() : step_; }
  /// The options, one per line (the trainer's `describe`), with the path.
  std::string describe() const { return "path: " + path() + "\n" + ::unirl::options::to_string(opts_); }

  /// Steps `venv` for `rollout_steps` steps with the current policy and keeps the rollout for
  /// `update`. Episode figures are reported by the next `update`.
  void collect(env_type& venv) {
    const auto t0 = clock::now();
    const std::size_t before = venv.episodes().size();
    if (trainer_) torch_batch_.emplace(trainer_->rollout(venv));
    else if constexpr (models::has_small_net<Dist>) collect_kernels(venv);
    // The rollout's episodes, reported with the next update (as the trainer's step reports them).
    pending_.clear();
    pending_["time_collect"] = std::chrono::duration<double>(clock::now() - t0).count();
    const auto& eps = venv.episodes();
    const std::size_t k = eps.size() - before;
    pending_["env_steps"] = static_cast<double>(venv.env_steps());
    pending_["episodes"] = static_cast<double>(k);
    if (k > 0) {
      double ret = 0, len = 0;
      for (std::size_t i = before; i < eps.size(); ++i) {
        ret += eps[i].episode_return;
        len += static_cast<double>(eps[i].length);
      }
      pending_["episode_return"] = ret / static_cast<double>(k);
      pending_["episode_length"] = len / static_cast<double>(k);
    }
  }

  /// GAE and `epochs` x `minibatches` PPO updates on the last `collect`'s rollout; returns the
  /// statistics (losses averaged over the updates, as the trainer's `step`).
  step_stats update() {
    if (trainer_) {
      UNIRL_CHECK(torch_batch_.has_value(), "ppo_agent::update: nothing collected; call collect(venv) first");
      auto batch = std::move(*torch_batch_);
      torch_batch_.reset();
      const auto rewards = batch.rewards;
      auto s = trainer_->learn(std::move(batch), rewards);
      for (const auto& [k, v] : pending_) s.extra[k] = v;
      s.time_sample = pending_["time_collect"];
      return s;
    }
    if constexpr (models::has_small_net<Dist>) return update_kernels();
    else return {};
  }

  /// `collect(venv)` then `update()`: one PPO iteration.
  step_stats step(env_type& venv) {
    collect(venv);
    return update();
  }

  /// The policy with the current weights (on the kernels' path, copied out of their buffer).
  policy_type policy() const {
    if (trainer_) return trainer_->models().policy;
    if constexpr (models::has_small_net<Dist>) models::copy_parameters(*net_, const_cast<policy_type&>(policy_));
    return policy_;
  }

  /// Replaces the current weights with `p`'s (same architecture), e.g. a policy trained on the
  /// other path or loaded from a model checkpoint. The optimizer state is kept.
  void load_policy(const policy_type& p) {
    if (trainer_) {
      torch::NoGradGuard ng;
      auto dst = trainer_->models().policy.net()->named_parameters();
      for (const auto& kv : p.net()->named_parameters()) {
        auto* d = dst.find(kv.key());
        UNIRL_CHECK(d != nullptr && d->sizes() == kv.value().sizes(), "ppo_agent::load_policy: parameter '",
                    kv.key(), "' of shape ", kv.value().sizes(), " does not match this agent's policy");
        d->copy_(kv.value());
      }
      return;
    }
    if constexpr (models::has_small_net<Dist>) models::copy_parameters(p, *net_);
  }

  /// Checkpoints the agent (weights, optimizer state, generator, step) and each of `extras`
  /// (e.g. the `vector_env`) in one file, atomically. On the LibTorch path this is the trainer's
  /// checkpoint; a checkpoint is read back by an agent on the same path (the weights move between
  /// paths through `policy()` / `load_policy`).
  /// ```cpp
  /// agent.save("run/ckpt.pt", venv);   // resume: agent.load("run/ckpt.pt", venv);
  /// ```
  template <class... Extras>
  void save(const std::string& path, const Extras&... extras) const {
    if (trainer_) trainer_->save(path, extras...);
    else train::save_with_extras(path, *this, extras...);
  }

  /// Restores what `save` wrote (a checkpoint of the other path throws `checkpoint_error`).
  template <class... Extras>
  void load(const std::string& path, Extras&... extras) {
    if (trainer_) trainer_->load(path, extras...);
    else train::load_with_extras(path, *this, "ppo_agent::load", extras...);
  }

  /// The kernels' state into `a` (`save(path)` on the small-network path).
  void save(torch::serialize::OutputArchive& a) const {
    UNIRL_CHECK(!trainer_, "ppo_agent::save(archive): the LibTorch path saves through save(path, ...)");
    train::write_scalar(a, "ppo_agent.path", std::string("small_net"));
    train::write_scalar(a, "step", step_);
    if constexpr (models::has_small_net<Dist>) {
      const auto n = net_->parameter_count();
      a.write("parameters", buffer_tensor(net_->parameters(), n), true);
      a.write("adam.first", buffer_tensor(adam_->first().data(), n), true);
      a.write("adam.second", buffer_tensor(adam_->second().data(), n), true);
      train::write_scalar(a, "adam.steps", adam_->steps());
    }
    std::ostringstream rng;
    rng << rng_;
    train::write_scalar(a, "rng", rng.str());
  }

  /// Restores what `save(archive)` wrote; checks everything before changing anything.
  void load(torch::serialize::InputArchive& a) {
    UNIRL_CHECK(!trainer_, "ppo_agent::load(archive): the LibTorch path loads through load(path, ...)");
    const std::string what = "ppo_agent::load";
    if (!train::has_key(a, "ppo_agent.path"))
      throw checkpoint_error(what + ": not a small-network agent checkpoint (a trainer's? load it with the same "
                                    "execution policy that saved it)");
    if constexpr (models::has_small_net<Dist>) {
      const auto n = net_->parameter_count();
      const auto p = checked_buffer(a, "parameters", n, what);
      const auto m = checked_buffer(a, "adam.first", n, what);
      const auto v = checked_buffer(a, "adam.second", n, what);
      const auto steps = train::read_scalar<std::int64_t>(a, "adam.steps");
      const auto step = train::read_scalar<std::int64_t>(a, "step");
      std::istringstream rng(train::read_scalar<std::string>(a, "rng"));
      std::mt19937_64 g;
      rng >> g;
      if (rng.fail()) throw checkpoint_error(what + ": the stored generator state is unreadable");
      std::copy(p.begin(), p.end(), net_->parameters());
      std::copy(m.begin(), m.end(), adam_->first().begin());
      std::copy(v.begin(), v.end(), adam_->second().begin());
      adam_->set_steps(steps);
      step_ = step;
      rng_ = g;
      collected_ = false;
      resumed_ = true;
    }
  }

 private:
  // The first option the kernels do not implement, named; empty when they implement all.
  std::string kernel_gap() const {
    const auto& al = opts_.algorithm;
    if (al.kl_coef != 0.0) return "algorithm.kl_coef = " + std::to_string(al.kl_coef);
    if (al.dual_clip != 0.0) return "algorithm.dual_clip = " + std::to_string(al.dual_clip);
    if (al.agg != algo::loss_agg::token_mean) return "algorithm.agg (only token_mean)";
    if (opts_.optim.weight_decay != 0.0) return "optim.weight_decay = " + std::to_string(opts_.optim.weight_decay);
    if (!opts_.optim.groups.empty()) return "optim.groups";
    if (opts_.micro_batch_size != 0) return "micro_batch_size = " + std::to_string(opts_.micro_batch_size);
    if (opts_.precision != precision::fp32) return "precision (only fp32)";
    if (opts_.device != "cpu") return "device = " + opts_.device;
    if (!policy_.device().is_cpu()) return "a policy on " + policy_.device().str();
    return {};
  }

  bool small_enough() const {
    std::int64_t width = 0;
    for (auto h : policy_.net()->options().hidden) width = std::max(width, h);
    std::int64_t params = 0;
    for (const auto& p : policy_.parameters()) params += p.numel();
    return exec::small_net_fits(width, params);
  }

  // For a form the kernels lack, a categorical head stands in the type: it is never built.
  using head_type = typename std::conditional_t<models::has_small_net<Dist>, models::small_net_head_of<Dist>,
                                                std::type_identity<ops::categorical_head>>::type;
  using net_type = ops::small_actor_critic<Scalar, head_type>;

  void build_kernels() {
    net_.emplace(models::small_net_like<Scalar>(policy_, 128));
    models::copy_parameters(policy_, *net_);
    adam_.emplace(net_->parameter_count(), opts_.optim.beta1, opts_.optim.beta2, opts_.optim.eps);
    rng_.seed(static_cast<std::uint64_t>(opts_.seed));
  }

  // Sizes the rollout buffers for `n` copies (once; again only if the copy count changes).
  void size_buffers(std::int64_t n) {
    if (n == num_envs_) return;
    num_envs_ = n;
    const auto rows = static_cast<std::size_t>(opts_.algorithm.track.rollout_steps * n);
    obs_.assign(rows * static_cast<std::size_t>(env_type::observation_size), 0.0f);
    actions_.assign(rows * static_cast<std::size_t>(env_type::action_components), action_scalar{});
    logp_.assign(rows, Scalar(0));
    values_.assign(rows, Scalar(0));
    advantages_.assign(rows, Scalar(0));
    returns_.assign(rows, Scalar(0));
    rewards_.assign(rows, 0.0f);
    dones_.assign(rows, 0.0f);
    next_value_.assign(static_cast<std::size_t>(n), Scalar(0));
    next_done_.assign(static_cast<std::size_t>(n), 0.0f);
    perm_.resize(rows);
    const auto mb = (static_cast<std::int64_t>(rows) + opts_.minibatches - 1) / std::max<std::int64_t>(opts_.minibatches, 1);
    net_->reserve(std::max<std::int64_t>({mb, n, 1}));
  }

  void collect_kernels(env_type& venv) {
    const auto n = venv.num_envs();
    size_buffers(n);
    const auto T = opts_.algorithm.track.rollout_steps;
    constexpr auto D = env_type::observation_size;
    constexpr auto C = env_type::action_components;
    for (std::int64_t t = 0; t < T; ++t) {
      const auto row = t * n;
      std::copy(venv.observation_data(), venv.observation_data() + n * D, obs_.data() + row * D);
      std::copy(venv.done_data(), venv.done_data() + n, dones_.data() + row);
      net_->act(obs_.data() + row * D, n, rng_, actions_.data() + row * C, logp_.data() + row, values_.data() + row);
      venv.step(actions_.data() + row * C, rewards_.data() + row, next_done_.data());
    }
    net_->values(venv.observation_data(), n, next_value_.data());
    collected_ = true;
  }

  step_stats update_kernels() {
    UNIRL_CHECK(collected_, "ppo_agent::update: nothing collected; call collect(venv) first");
    collected_ = false;
    const auto t0 = clock::now();
    step_stats s;
    s.step = step_;
    for (const auto& [k, v] : pending_) s.extra[k] = v;
    s.time_sample = pending_["time_collect"];
    const auto& al = opts_.algorithm;
    const auto T = al.track.rollout_steps, n = num_envs_, rows = T * n;
    s.samples = rows;
    auto sched = opts_.schedule;
    if (sched.total_steps == 0) sched.total_steps = opts_.total_steps;
    const double lr = opts_.optim.lr * train::lr_multiplier(sched, step_);
    s.learning_rate = lr;

    // GAE over the (T, N) layout in double (as algo::gae's fused loop), stored in Scalar.
    for (std::int64_t e = 0; e < n; ++e) {
      double last = 0.0;
      for (std::int64_t t = T - 1; t >= 0; --t) {
        const auto i = t * n + e;
        const double nonterminal = 1.0 - (t == T - 1 ? next_done_[e] : dones_[i + n]);
        const double next_v = t == T - 1 ? next_value_[e] : values_[i + n];
        const double delta = rewards_[i] + al.gamma * next_v * nonterminal - values_[i];
        last = delta + al.gamma * al.lambda * nonterminal * last;
        advantages_[i] = static_cast<Scalar>(last);
        returns_[i] = advantages_[i] + values_[i];
      }
    }
    double rs = 0, rq = 0, as = 0, aq = 0;
    s.reward_min = s.reward_max = rewards_[0];
    for (std::int64_t i = 0; i < rows; ++i) {
      rs += rewards_[i];
      rq += static_cast<double>(rewards_[i]) * rewards_[i];
      as += advantages_[i];
      aq += static_cast<double>(advantages_[i]) * advantages_[i];
      s.reward_min = std::min<double>(s.reward_min, rewards_[i]);
      s.reward_max = std::max<double>(s.reward_max, rewards_[i]);
    }
    const double dn = static_cast<double>(rows);
    s.reward_mean = rs / dn;
    s.reward_std = rows > 1 ? std::sqrt(std::max(0.0, (rq - rs * rs / dn) / (dn - 1))) : 0.0;
    s.advantage_mean = as / dn;
    s.advantage_std = rows > 1 ? std::sqrt(std::max(0.0, (aq - as * as / dn) / (dn - 1))) : 0.0;

    const ops::small_ppo_settings ps{.clip_low = al.clip_low,
                                     .clip_high = al.clip_high,
                                     .value_clip = al.value_clip,
                                     .vf_coef = al.vf_coef,
                                     .ent_coef = al.ent_coef,
                                     .norm_adv = al.norm_adv};
    ops::small_ppo_batch<Scalar> mb{.obs = obs_.data(),
                                    .old_logp = logp_.data(),
                                    .old_values = values_.data(),
                                    .advantages = advantages_.data(),
                                    .returns = returns_.data()};
    if constexpr (env_type::discrete) mb.actions = actions_.data();
    else mb.box_actions = actions_.data();
    const std::int64_t mb_count = std::min(opts_.minibatches, rows);
    std::iota(perm_.begin(), perm_.end(), std::int64_t{0});
    double loss = 0, pl = 0, vl = 0, ent = 0, ratio = 0, clip = 0, kl = 0, gn = 0;
    std::int64_t taken = 0;
    for (std::int64_t ep = 0; ep < opts_.epochs; ++ep) {
      if (mb_count > 1 || opts_.epochs > 1) std::shuffle(perm_.begin(), perm_.end(), rng_);
      for (std::int64_t m = 0; m < mb_count; ++m) {
        const std::int64_t lo = m * rows / mb_count, hi = (m + 1) * rows / mb_count;
        if (hi <= lo) continue;
        mb.index = perm_.data() + lo;
        mb.size = hi - lo;
        const auto r = net_->loss_and_gradient(ps, mb);
        const double norm = ops::clip_gradient_norm(net_->gradients(), net_->parameter_count(),
                                                    opts_.clip.max_grad_norm);
        if (!std::isfinite(r.loss) || !std::isfinite(norm)) {
          ++s.skipped_updates;
          continue;
        }
        adam_->step(net_->parameters(), net_->gradients(), lr);
        ++taken;
        loss += r.loss;
        pl += r.policy_loss;
        vl += r.value_loss;
        ent += r.entropy;
        ratio += r.ratio_mean;
        clip += r.clip_fraction;
        kl += r.approx_kl;
        gn += norm;
      }
    }
    if (taken > 0) {
      const double k = static_cast<double>(taken);
      s.loss = loss / k;
      s.policy_loss = pl / k;
      s.value_loss = vl / k;
      s.entropy = ent / k;
      s.ratio_mean = ratio / k;
      s.clip_fraction = clip / k;
      s.grad_norm = gn / k;
      s.extra["approx_kl"] = kl / k;
    }
    s.optimizer_steps = taken;
    s.time_update = std::chrono::duration<double>(clock::now() - t0).count();
    s.seconds = s.time_sample + s.time_update;
    s.samples_per_second = s.seconds > 0 ? static_cast<double>(rows) / s.seconds : 0.0;
    skipped_total_ += s.skipped_updates;
    s.skipped_total = skipped_total_;
    ++step_;
    // Opened at the first update (as the trainer does): appended to after a load, else truncated.
    if (!opts_.metrics_path.empty() && !metrics_) metrics_.emplace(opts_.metrics_path, resumed_);
    if (metrics_) metrics_->write(s.to_json());
    return s;
  }

  static torch::Tensor buffer_tensor(const Scalar* p, std::int64_t n) {
    constexpr auto dtype = std::is_same_v<Scalar, float> ? torch::kFloat : torch::kDouble;
    return torch::from_blob(const_cast<Scalar*>(p), {n}, dtype).clone();
  }
  static std::vector<Scalar> checked_buffer(torch::serialize::InputArchive& a, const std::string& key,
                                            std::int64_t n, const std::string& what) {
    constexpr auto dtype = std::is_same_v<Scalar, float> ? torch::kFloat : torch::kDouble;
    const auto t = train::read_tensor(a, key, what);
    if (t.scalar_type() != dtype || t.dim() != 1 || t.numel() != n)
      throw checkpoint_error(c10::str(what, ": tensor '", key, "' is ", t.scalar_type(), " of shape ", t.sizes(),
                                      "; expected ", dtype, " of shape (", n, ")"));
    const auto c = t.contiguous();
    return std::vector<Scalar>(c.template data_ptr<Scalar>(), c.template data_ptr<Scalar>() + n);
  }

  using clock = std::chrono::steady_clock;
  options opts_;
  policy_type policy_;
  std::optional<trainer_type> trainer_;
  std::optional<rollout_t<policy_type>> torch_batch_;
  // The kernels' path.
  std::optional<net_type> net_;
  std::optional<ops::small_adam<Scalar>> adam_;
  std::mt19937_64 rng_;
  std::optional<train::metrics_writer> metrics_;
  std::int64_t step_ = 0, num_envs_ = 0, skipped_total_ = 0;
  bool collected_ = false, resumed_ = false;
  std::map<std::string, double> pending_;  // figures of the last collect
  std::vector<float> obs_, rewards_, dones_, next_done_;
  std::vector<action_scalar> actions_;
  std::vector<Scalar> logp_, values_, advantages_, returns_, next_value_;
  std::vector<std::int64_t> perm_;
};

}  // namespace unirl
