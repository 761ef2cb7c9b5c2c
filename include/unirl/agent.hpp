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
/// the trainer's, so one configuration runs on either path. A checkpoint (`save(path, venv)`:
/// weights, Adam moments and step count, the update count, the environments' running
/// statistics) loads on either path, and `rollout()` / `set_rollout` hand one collected rollout
/// to another agent, so both paths can continue from the same state on the same data.
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
#include <memory>
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
#include <unirl/concepts/checkpoint.hpp>
#include <unirl/concepts/environment.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/detail/compat.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/ops/small_net.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/rollout/env.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/metrics.hpp>
#include <unirl/train/optimizer.hpp>
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
  /// (e.g. the `vector_env`, with its running normalisation statistics) in one file, atomically.
  /// On the LibTorch path this is the trainer's checkpoint. A checkpoint of either path loads on
  /// either path (see `load`).
  /// ```cpp
  /// agent.save("run/ckpt.pt", venv);   // resume: agent.load("run/ckpt.pt", venv);
  /// ```
  template <class... Extras>
  void save(const std::string& path, const Extras&... extras) const {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::ppo_agent::save: every extra must model unirl::Checkpointable (e.g. the vector_env)");
    train::save_with_extras(path, *this, extras...);
  }

  /// Restores what `save` wrote, on this agent's path or the other one. From the same path the
  /// run continues bit for bit. From the other path the weights, the Adam moments and step count
  /// and the update count (hence the learning-rate schedule) convert, and `extras` load as
  /// always; the random generator does not (the paths draw differently: the kernels keep theirs,
  /// the LibTorch path keeps LibTorch's), so the continued run equals the other path's on the
  /// same rollouts (`set_rollout`), not on the same draws. A checkpoint of another architecture
  /// or optimizer layout throws `checkpoint_error` naming the tensor or entry, before anything
  /// is changed.
  template <class... Extras>
  void load(const std::string& path, Extras&... extras) {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::ppo_agent::load: every extra must model unirl::Checkpointable (e.g. a non-const vector_env)");
    train::load_with_extras(path, *this, "ppo_agent::load", extras...);
  }

  /// The agent's state into `a` (what `save(path)` writes besides the extras).
  void save(torch::serialize::OutputArchive& a) const {
    if (trainer_) {
      trainer_->save(a);
      return;
    }
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

  /// Restores what `save(archive)` wrote on either path (see `load(path)`); checks everything
  /// before changing anything.
  void load(torch::serialize::InputArchive& a) {
    const std::string what = "ppo_agent::load";
    const bool kernels_file = train::has_key(a, "ppo_agent.path");
    if (!kernels_file && !train::has_key(a, "unirl.format"))
      throw checkpoint_error(what + ": neither a small-network agent's checkpoint nor a trainer's (no entry "
                                    "'ppo_agent.path' or 'unirl.format')");
    if (trainer_) {
      if (kernels_file) load_kernels_file_into_trainer(a, what);
      else trainer_->load(a);
      return;
    }
    if constexpr (models::has_small_net<Dist>) {
      const auto n = net_->parameter_count();
      std::vector<Scalar> p, m, v;
      std::int64_t steps = 0, step = 0;
      std::optional<std::mt19937_64> g;
      if (kernels_file) {
        p = to_vector(checked_flat(a, "parameters", n, what));
        m = to_vector(checked_flat(a, "adam.first", n, what));
        v = to_vector(checked_flat(a, "adam.second", n, what));
        steps = train::read_scalar<std::int64_t>(a, "adam.steps");
        step = train::read_scalar<std::int64_t>(a, "step");
        std::istringstream rng(train::read_scalar<std::string>(a, "rng"));
        g.emplace();
        rng >> *g;
        if (rng.fail()) throw checkpoint_error(what + ": the stored generator state is unreadable");
      } else {
        read_trainer_file(a, what, p, m, v, steps, step);
      }
      if (steps < 0 || step < 0)
        throw checkpoint_error(c10::str(what, ": adam.steps = ", steps, ", step = ", step, ": expected >= 0"));
      std::copy(p.begin(), p.end(), net_->parameters());
      std::copy(m.begin(), m.end(), adam_->first().begin());
      std::copy(v.begin(), v.end(), adam_->second().begin());
      adam_->set_steps(steps);
      step_ = step;
      if (g) rng_ = *g;
      collected_ = false;
      resumed_ = true;
    }
  }

  /// The rollout the last `collect` gathered and no `update` has learned from yet, as an
  /// `env_rollout` (on the kernels' path, tensors copied from their buffers): to learn from the
  /// same data on another agent (`set_rollout`), or to look at it.
  env_rollout rollout() const {
    if (trainer_) {
      UNIRL_CHECK(torch_batch_.has_value(), "ppo_agent::rollout: nothing collected; call collect(venv) first");
      return *torch_batch_;
    }
    UNIRL_CHECK(collected_, "ppo_agent::rollout: nothing collected; call collect(venv) first");
    const auto T = opts_.algorithm.track.rollout_steps, n = num_envs_, rows = T * n;
    constexpr auto D = env_type::observation_size;
    constexpr auto C = env_type::action_components;
    const auto copy = [](const auto* p, std::vector<std::int64_t> shape) {
      using T_ = std::remove_cvref_t<decltype(*p)>;
      constexpr auto dt = std::is_same_v<T_, float>    ? torch::kFloat
                          : std::is_same_v<T_, double> ? torch::kDouble
                                                       : torch::kLong;
      return torch::from_blob(const_cast<T_*>(p), shape, dt).clone();
    };
    env_rollout r;
    r.obs = copy(obs_.data(), {rows, D});
    r.actions = env_type::discrete ? copy(actions_.data(), {rows}) : copy(actions_.data(), {rows, C});
    r.logprobs = copy(logp_.data(), {rows});
    r.rewards = copy(rewards_.data(), {rows});
    r.dones = copy(dones_.data(), {rows});
    r.values = copy(values_.data(), {rows});
    r.next_value = copy(next_value_.data(), {n});
    r.next_done = copy(next_done_.data(), {n});
    r.num_steps = T;
    r.num_envs = n;
    return r;
  }

  /// Takes `r` as the rollout the next `update` learns from, in place of `collect(venv)`:
  /// `algorithm.track.rollout_steps` steps of N copies in `env_rollout`'s layout (obs, actions,
  /// logprobs, rewards, dones, values per row; next_value, next_done per copy), e.g. another
  /// agent's `rollout()`. A field of another shape or type throws naming it.
  /// ```cpp
  /// kernels.collect(venv);
  /// libtorch.set_rollout(kernels.rollout());   // both now learn from the same transitions
  /// ```
  void set_rollout(const env_rollout& r) {
    const auto T = opts_.algorithm.track.rollout_steps, n = r.num_envs;
    constexpr auto D = env_type::observation_size;
    constexpr auto C = env_type::action_components;
    UNIRL_CHECK(r.num_steps == T, "ppo_agent::set_rollout: num_steps = ", r.num_steps,
                ": expected algorithm.track.rollout_steps = ", T);
    UNIRL_CHECK(n >= 1, "ppo_agent::set_rollout: num_envs = ", n, ": expected >= 1");
    const auto rows = T * n;
    const auto check = [](const char* name, const torch::Tensor& t, std::vector<std::int64_t> shape, bool integral) {
      UNIRL_CHECK(t.defined() && t.sizes() == torch::IntArrayRef(shape) && t.is_floating_point() != integral,
                  "ppo_agent::set_rollout: ", name, " is ",
                  t.defined() ? c10::str(t.scalar_type(), " of shape ", t.sizes()) : std::string("undefined"),
                  "; expected ", integral ? "integers" : "floating point", " of shape ", torch::IntArrayRef(shape));
    };
    check("obs", r.obs, {rows, D}, false);
    if constexpr (env_type::discrete) check("actions", r.actions, {rows}, true);
    else check("actions", r.actions, {rows, C}, false);
    check("logprobs", r.logprobs, {rows}, false);
    check("rewards", r.rewards, {rows}, false);
    check("dones", r.dones, {rows}, false);
    check("values", r.values, {rows}, false);
    check("next_value", r.next_value, {n}, false);
    check("next_done", r.next_done, {n}, false);
    pending_.clear();
    pending_["time_collect"] = 0.0;
    if (trainer_) {
      const auto dt = trainer_->models().policy.net()->anchor().scalar_type();
      env_rollout b;
      b.obs = r.obs.to(torch::kCPU, torch::kFloat).contiguous();
      b.actions = r.actions.to(torch::kCPU, env_type::discrete ? torch::kLong : torch::kFloat).contiguous();
      b.logprobs = r.logprobs.to(torch::kCPU, dt).contiguous();
      b.rewards = r.rewards.to(torch::kCPU, torch::kFloat).contiguous();
      b.dones = r.dones.to(torch::kCPU, torch::kFloat).contiguous();
      b.values = r.values.to(torch::kCPU, dt).contiguous();
      b.next_value = r.next_value.to(torch::kCPU, dt).contiguous();
      b.next_done = r.next_done.to(torch::kCPU, torch::kFloat).contiguous();
      b.num_steps = T;
      b.num_envs = n;
      torch_batch_.emplace(std::move(b));
      return;
    }
    if constexpr (models::has_small_net<Dist>) {
      size_buffers(n);
      const auto into = [](const torch::Tensor& t, auto& buffer) {
        using T_ = typename std::remove_cvref_t<decltype(buffer)>::value_type;
        constexpr auto dt = std::is_same_v<T_, float>    ? torch::kFloat
                            : std::is_same_v<T_, double> ? torch::kDouble
                                                         : torch::kLong;
        const auto c = t.to(torch::kCPU, dt).contiguous();
        std::copy(c.template data_ptr<T_>(), c.template data_ptr<T_>() + c.numel(), buffer.begin());
      };
      into(r.obs, obs_);
      into(r.actions, actions_);
      into(r.logprobs, logp_);
      into(r.rewards, rewards_);
      into(r.dones, dones_);
      into(r.values, values_);
      into(r.next_value, next_value_);
      into(r.next_done, next_done_);
      collected_ = true;
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
  // The 1-D floating tensor `key` of `n` elements (float or double: either path's Scalar).
  static torch::Tensor checked_flat(torch::serialize::InputArchive& a, const std::string& key, std::int64_t n,
                                    const std::string& what) {
    const auto t = train::read_tensor(a, key, what);
    if (!t.is_floating_point() || t.dim() != 1 || t.numel() != n)
      throw checkpoint_error(c10::str(what, ": tensor '", key, "' is ", t.scalar_type(), " of shape ", t.sizes(),
                                      "; expected a floating tensor of shape (", n,
                                      ") (this agent's network; was the checkpoint's another architecture?)"));
    return t;
  }
  static std::vector<Scalar> to_vector(const torch::Tensor& t) {
    constexpr auto dtype = std::is_same_v<Scalar, float> ? torch::kFloat : torch::kDouble;
    const auto c = t.to(dtype).contiguous();
    return std::vector<Scalar>(c.template data_ptr<Scalar>(), c.template data_ptr<Scalar>() + c.numel());
  }

  // A trainer's checkpoint (the LibTorch path's) read into the kernels' layout: the policy's
  // tensors `policy.<name>`, the AdamW state of the one parameter group by parameter name, the
  // update count. Nothing is changed here.
  void read_trainer_file(torch::serialize::InputArchive& a, const std::string& what, std::vector<Scalar>& p,
                         std::vector<Scalar>& m, std::vector<Scalar>& v, std::int64_t& steps, std::int64_t& step) {
    const auto n = net_->parameter_count();
    p.assign(static_cast<std::size_t>(n), Scalar(0));
    m.assign(static_cast<std::size_t>(n), Scalar(0));
    v.assign(static_cast<std::size_t>(n), Scalar(0));
    const auto shape_of = [](const ops::small_net_tensor& t) { return torch::IntArrayRef(t.shape); };
    const auto put = [](const torch::Tensor& src, const ops::small_net_tensor& t, std::vector<Scalar>& into) {
      const auto c = to_vector(src.reshape({-1}));
      std::copy(c.begin(), c.end(), into.begin() + t.offset);
    };
    for (const auto& t : net_->tensors()) {
      const auto key = "policy." + t.name;
      const auto src = train::read_tensor(a, key, what);
      if (src.sizes() != shape_of(t))
        throw checkpoint_error(c10::str(what, ": tensor '", key, "' has shape ", src.sizes(),
                                        " in the checkpoint; this agent's network has ", shape_of(t)));
      put(src, t, p);
    }
    {
      torch::Tensor s;
      if (!a.try_read("unirl.step", s)) throw checkpoint_error(what + ": the checkpoint has no entry 'unirl.step'");
      step = s.item<std::int64_t>();
    }
    auto opt = train::read_archive(a, "optimizer", what);
    const auto groups = train::read_scalar<std::int64_t>(opt, "optimizer/groups");
    if (groups != 1)
      throw checkpoint_error(c10::str(what, ": the checkpoint's optimizer has ", groups,
                                      " parameter groups; the small-network kernels have one"));
    const auto count = train::read_scalar<std::int64_t>(opt, "optimizer/g0/count");
    const auto& ts = net_->tensors();
    if (count != static_cast<std::int64_t>(ts.size()))
      throw checkpoint_error(c10::str(what, ": the checkpoint's optimizer holds ", count,
                                      " parameters; this agent's network has ", ts.size()));
    std::optional<std::int64_t> first_steps;
    for (std::int64_t i = 0; i < count; ++i) {
      const auto pk = "optimizer/g0/p" + std::to_string(i);
      const auto name = train::read_scalar<std::string>(opt, pk + "/name");
      const auto it = std::find_if(ts.begin(), ts.end(), [&](const auto& t) { return t.name == name; });
      if (it == ts.end())
        throw checkpoint_error(what + ": the checkpoint's optimizer has a parameter '" + name +
                               "' that this agent's network does not have");
      std::int64_t s = 0;
      if (train::has_key(opt, pk + "/step")) {
        s = train::read_scalar<std::int64_t>(opt, pk + "/step");
        const auto m1 = train::read_tensor(opt, pk + "/exp_avg", what);
        const auto m2 = train::read_tensor(opt, pk + "/exp_avg_sq", what);
        if (m1.sizes() != shape_of(*it) || m2.sizes() != shape_of(*it))
          throw checkpoint_error(c10::str(what, ": the Adam moments of '", name, "' have shapes ", m1.sizes(), " and ",
                                          m2.sizes(), "; the parameter has ", shape_of(*it)));
        put(m1, *it, m);
        put(m2, *it, v);
      }
      if (!first_steps) first_steps = s;
      if (s != *first_steps)
        throw checkpoint_error(c10::str(what, ": parameter '", name, "' took ", s, " Adam steps, the first one ",
                                        *first_steps, "; the small-network kernels step every parameter together"));
    }
    steps = first_steps.value_or(0);
  }

  // A kernels' checkpoint into the trainer (the LibTorch path): weights, AdamW state and the
  // update count, all checked first.
  void load_kernels_file_into_trainer(torch::serialize::InputArchive& a, const std::string& what) {
    if constexpr (!models::has_small_net<Dist>) {
      throw checkpoint_error(what + ": a small-network kernels' checkpoint cannot hold this policy's distribution");
    } else {
      const auto layout = models::small_net_like<Scalar>(policy_, 1);
      const auto n = layout.parameter_count();
      const auto p = checked_flat(a, "parameters", n, what);
      const auto m = checked_flat(a, "adam.first", n, what);
      const auto v = checked_flat(a, "adam.second", n, what);
      const auto steps = train::read_scalar<std::int64_t>(a, "adam.steps");
      const auto step = train::read_scalar<std::int64_t>(a, "step");
      if (steps < 0 || step < 0)
        throw checkpoint_error(c10::str(what, ": adam.steps = ", steps, ", step = ", step, ": expected >= 0"));
      auto& opt = trainer_->optimizer();
      if (opt.group_count() != 1)
        throw checkpoint_error(c10::str(what, ": this agent's optimizer has ", opt.group_count(),
                                        " parameter groups (optim.groups); a kernels' checkpoint has one"));
      const auto& names = opt.group_param_names(0);
      const auto& params = opt.group_params(0);
      std::vector<const ops::small_net_tensor*> of(names.size());
      for (std::size_t i = 0; i < names.size(); ++i) {
        for (const auto& t : layout.tensors())
          if (t.name == names[i]) of[i] = &t;
        if (!of[i] || params[i].sizes() != torch::IntArrayRef(of[i]->shape))
          throw checkpoint_error(c10::str(what, ": this agent's parameter '", names[i], "' of shape ",
                                          params[i].sizes(), " has no counterpart in the kernels' layout"));
      }
      const auto slice = [](const torch::Tensor& flat, const ops::small_net_tensor& t, const torch::Tensor& like) {
        return flat.slice(0, t.offset, t.offset + t.size).view(t.shape).to(like.device(), like.scalar_type()).contiguous();
      };
      auto& state = opt.torch_optimizer().state();
      torch::NoGradGuard ng;
      for (std::size_t i = 0; i < names.size(); ++i) {
        params[i].copy_(slice(p, *of[i], params[i]));
        const auto key = ::unirl::detail::compat::optimizer_state_key_of(params[i]);
        if (steps == 0) {
          state.erase(key);
          continue;
        }
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(steps);
        s->exp_avg(slice(m, *of[i], params[i]));
        s->exp_avg_sq(slice(v, *of[i], params[i]));
        state[key] = std::move(s);
      }
      trainer_->resume_at_step(step);
    }
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
