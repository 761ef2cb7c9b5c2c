#pragma once
/// \file trainer.hpp
/// The entry point: `unirl::trainer<Model, Algorithm, Reward, Parallel>` runs one loop for every
/// modality — sample → reward → advantage → update → sync — one `step()` per iteration.
///
/// ```cpp
/// using my_trainer = unirl::trainer<my_model, unirl::algo::grpo<>, my_reward>;
/// my_trainer t{my_model{net}, my_reward{}, {.algorithm = {.clip_high = 0.28f},
///                                            .optim = {.lr = 1e-5}, .group_size = 8}};
/// for (const auto& prompts : loader) {
///   unirl::step_stats s = t.step(prompts);
/// }
/// t.save("run/checkpoint.pt");
/// ```
/// The trainer is the loop over one `train::update_engine` (train/update_engine.hpp: parameters
/// and groups, AdamW, schedule, clipping, guard, loss scale, autocast, micro-batches and the
/// parallel / sharding policy), which `supervised_trainer` shares. It builds only what the
/// algorithm declares it needs (`requires_reference`, `requires_critic`, `requires_ema_rollout`;
/// train/model_set_builder.hpp), asks the algorithm's optional hooks to check its settings
/// against the model and each input (`check_model`, `check_input`), and owns metrics and checkpoints
/// (with `save(path, extras...)` / `load(path, extras...)` for states that must resume with the
/// model, such as the environments: `unirl::Checkpointable`). With a data-parallel strategy every
/// rank starts from rank 0's parameters and buffers, rank 0's buffers are broadcast after every
/// weight sync, and the step statistics are averaged over ranks.
///
/// `step(input)` samples and scores a batch, then runs `learn(batch, rewards)`; the learner /
/// sampler split (parallel/rollout_worker.hpp, docs/parallel.md) calls `learn` with batches drawn
/// by other processes, with their staleness.
///
/// This header is the loop alone; `<unirl/token.hpp>`, `<unirl/flow.hpp>`, `<unirl/env.hpp>` and
/// `<unirl/rewards.hpp>` bring each track's algorithms, models and rewards with it.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/concepts/parallel.hpp>
#include <unirl/concepts/reward.hpp>
#include <unirl/concepts/rollout.hpp>
#include <unirl/concepts/track.hpp>
#include <unirl/concepts/trainer.hpp>
#include <unirl/config.hpp>
#include <unirl/core/batch.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/parallel/single_device.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/memory.hpp>
#include <unirl/train/metrics.hpp>
#include <unirl/train/model_set_builder.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/train/step_statistics.hpp>
#include <unirl/train/trainer_options.hpp>
#include <unirl/train/update_engine.hpp>

namespace unirl {

/// The composed trainer. Slots: a `ModelAdapter`, an `Algorithm` for the model's track
/// (`AlgorithmFor`; a family such as `algo::ppo<>` is bound to the track, `algorithm_for_t`), a
/// reward for the track's rollout batch (`RewardFor`), a `ParallelStrategy`.
///
/// Host synchronisations of a step: the reward read (its finiteness, its statistics and the
/// checks deferred during sampling), one read per minibatch (the found-non-finite flag with the
/// loss and the gradient norm), and one read of the step's statistics — plus what the sampler
/// and the algorithm need on the host (decoding stops, dynamic sampling).
template <class Model, class Algorithm, class Reward, class Parallel = parallel::single_device>
class trainer {
  static_assert(trainer_slots_checked<Model, Algorithm, Reward, Parallel>);

 public:
  /// The algorithm the trainer builds: `Algorithm`, or for a family its member for the model's track.
  using algorithm_type = algorithm_for_t<Algorithm, Model>;
  using model_type = Model;
  using reward_type = Reward;
  using parallel_type = Parallel;
  using rollout_type = rollout_t<Model>;
  using options = trainer_options<algorithm_type>;

  /// Builds the models the algorithm needs, the optimizer and the guard. Throws
  /// `config_error` naming the key for an invalid option.
  trainer(Model model, Reward reward, options opts = {}, Parallel parallel = {})
      : opts_(checked(std::move(opts))),
        device_(opts_.device),
        engine_(engine_options(opts_), device_, std::move(parallel)),
        models_{std::move(model)},
        reward_(std::move(reward)),
        algorithm_(opts_.algorithm) {
    check_against_model();
    torch::manual_seed(static_cast<std::uint64_t>(opts_.seed + engine_.parallel().rank()));
    // The critic, the reference and the EMA copy the algorithm needs, from rank 0's weights.
    layout_ = train::build_model_set(models_, algorithm_, opts_.memory, device_, opts_.device, engine_.parallel());
    engine_.bind(train::trainable_parameters(models_), "trainer");  // under a sharding strategy: this rank's pieces
  }

  /// One iteration of the loop on `input` (prompts, conditions, an environment): sample and
  /// score a batch, then learn from it — exactly what `learn(batch, rewards)` does with a batch
  /// drawn and scored elsewhere (a `parallel::rollout_worker`), minus its staleness handling.
  template <class Input>
    requires SamplesFrom<Algorithm, Model, std::remove_reference_t<Input>>
  step_stats step(Input&& input) {
    step_stats s;
    s.step = step_;
    deferred_checks checks;                        // checks of device values wait for this step's reads
    std::map<std::string, torch::Tensor> pending;  // tensor figures the algorithm reports, read at the end
    const step_info info = info_for(s, pending, opts_.epochs * opts_.minibatches);
    s.learning_rate = engine_.begin_step(step_);
    check_input(input);
    const auto t0 = clock::now();
    if (opts_.memory.track) memory_.start();
    std::optional<rollout_type> batch;
    {
      torch::NoGradGuard no_grad;
      autocast_scope amp(device_, opts_.precision);
      models_.policy.train(false);
      batch.emplace(algorithm_.sample(models_, input, info));
    }
    const auto t1 = clock::now();
    if (opts_.memory.track) memory_.lap(s.extra, "sample");
    torch::Tensor rewards;
    {
      torch::NoGradGuard no_grad;
      rewards = reward_(*batch);
    }
    check_rewards(rewards, batch->size());
    last_rewards_ = rewards;
    record_samples(*batch, rewards);
    if constexpr (ReportsComponents<Reward>)
      for (const auto& [k, v] : reward_.last_components()) s.extra["reward/" + k] = v;
    const auto t2 = clock::now();
    if (opts_.memory.track) memory_.lap(s.extra, "reward");
    return learn_stages(*batch, rewards, s, info, checks, pending, {t0, t1, t2});
  }

  /// The learner's side of a step: rewards → advantage → update → weight sync, on a batch that a
  /// sampler drew (`parallel::rollout_worker`) and scored with `rewards` ((B,) floating). `staleness`
  /// is how many versions the weights that drew it are behind this trainer's (0: on-policy); it is
  /// reported as `extra["staleness"]`, and a stale batch is trained against the behaviour
  /// log-probs it carries (the algorithm is told the update is off-policy: `step_info::updates`
  /// = 0, so GRPO does not take pi_old from the update's own forward; the ratio clip then
  /// truncates the importance weight). The batch is moved to the trainer's device (reflected
  /// batches, core/batch.hpp). `step(input)` is `rollout`, the reward, then this with staleness 0.
  step_stats learn(rollout_type batch, const torch::Tensor& rewards, std::int64_t staleness = 0) {
    UNIRL_CHECK(staleness >= 0, "trainer::learn: staleness = ", staleness, ": expected >= 0 (versions behind)");
    step_stats s;
    s.step = step_;
    deferred_checks checks;
    std::map<std::string, torch::Tensor> pending;
    const step_info info = info_for(s, pending, staleness > 0 ? 0 : opts_.epochs * opts_.minibatches);
    s.learning_rate = engine_.begin_step(step_);
    if constexpr (boost::hana::Struct<rollout_type>::value) batch = ::unirl::batch::to(batch, device_);
    check_rewards(rewards, batch.size());
    last_rewards_ = rewards;
    s.extra["staleness"] = static_cast<double>(staleness);
    const auto t0 = clock::now();
    if (opts_.memory.track) memory_.start();
    return learn_stages(batch, rewards, s, info, checks, pending, {t0, t0, t0});
  }

 private:
  using clock = std::chrono::steady_clock;

  step_info info_for(step_stats& s, std::map<std::string, torch::Tensor>& pending, std::int64_t updates) const {
    return step_info{step_, opts_.group_size, device_, &s.extra, updates, &pending, opts_.memory.logprob_chunk};
  }

  // Rewards → advantage → update → sync → statistics of one step, after the batch was drawn
  // (t[0] to t[1]) and scored (t[1] to t[2]).
  step_stats learn_stages(rollout_type& batch_ref, const torch::Tensor& rewards, step_stats& s, const step_info& info,
                          deferred_checks& checks, std::map<std::string, torch::Tensor>& pending,
                          std::array<clock::time_point, 3> t) {
    auto seconds = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
    const auto t0 = t[0], t1 = t[1], t2 = t[2];
    rollout_type* batch = &batch_ref;
    s.samples = batch->size();
    // One read: whether the rewards are finite, their statistics, and the checks deferred while sampling.
    const torch::Tensor r64 = rewards.detach().to(device_, torch::kFloat64);
    const auto first = train::read_figures(
        {r64.numel() > 0 ? torch::isfinite(r64).all() : torch::ones({}, f64()), train::reward_figures(r64, device_)},
        &checks, device_);
    const bool rewards_ok = engine_.parallel().all_agree(first.at(0) != 0.0);
    if (r64.numel() > 0) {
      s.reward_mean = first.at(1);
      s.reward_std = first.at(2);
      s.reward_min = first.at(3);
      s.reward_max = first.at(4);
    }

    torch::Tensor adv;
    if (rewards_ok) {
      torch::NoGradGuard no_grad;
      autocast_scope amp(device_, opts_.precision);
      adv = algorithm_.advantage(models_, *batch, rewards.to(device_), info);
    }
    const auto t3 = clock::now();
    if (opts_.memory.track) memory_.lap(s.extra, "advantage");
    train::update_sums u;
    if (rewards_ok) {
      u = update(*batch, info, s, checks);
    } else {
      ++s.skipped_updates;
      engine_.guard().count_skip();
      std::cerr << "unirl: step " << step_ << ": non-finite reward; update skipped, weights unchanged\n";
    }
    train::finish_step_statistics(s, engine_.parallel(), device_, r64, adv, u, pending, checks);
    const auto t4 = clock::now();
    if (opts_.memory.track) memory_.lap(s.extra, "update");
    engine_.parallel().sync_weights(models_.policy.parameters());
    train::sync_buffers(models_, engine_.parallel());
    const auto t5 = clock::now();
    if (opts_.memory.track) {
      memory_.lap(s.extra, "sync");
      if (models_.reference) s.extra["memory/reference_mb"] = static_cast<double>(layout_.reference_bytes) / (1024.0 * 1024.0);
    }

    s.time_sample = seconds(t0, t1);
    s.time_reward = seconds(t1, t2);
    s.time_advantage = seconds(t2, t3);
    s.time_update = seconds(t3, t4);
    s.time_sync = seconds(t4, t5);
    s.seconds = seconds(t0, t5);
    s.samples_per_second = s.seconds > 0 ? static_cast<double>(s.samples) / s.seconds : 0.0;
    s.skipped_total = engine_.guard().skipped_total();
    // A model's own figures of the step (optional hook), e.g. a VLM's vision_tower_calls.
    if constexpr (requires(const Model& m, std::map<std::string, double>& e) { m.report_stats(e); })
      models_.policy.report_stats(s.extra);
    ++step_;
    report(s);
    return s;
  }

 public:

  /// Sampling alone: the rollout batch `step(input)` would draw first (the policy in evaluation
  /// mode, no gradient, the run's precision), with no reward, update or step count — for
  /// evaluation, and for a model upstream of a trained one that is frozen in this stage
  /// (`joint::chain`). Draws from the same random stream as `step`.
  template <class Input>
    requires SamplesFrom<Algorithm, Model, std::remove_reference_t<Input>>
  rollout_type rollout(Input&& input) {
    check_input(input);
    std::map<std::string, double> extra;
    std::map<std::string, torch::Tensor> pending;
    const step_info info{step_, opts_.group_size, device_, &extra, opts_.epochs * opts_.minibatches, &pending,
                         opts_.memory.logprob_chunk};
    torch::NoGradGuard no_grad;
    autocast_scope amp(device_, opts_.precision);
    models_.policy.train(false);
    return algorithm_.sample(models_, input, info);
  }

  /// The rewards of the last `step`'s batch, one per sample in the batch's order, on the reward's
  /// device (undefined before the first step): what a model upstream is rewarded with when this
  /// trainer's step is its reward (`joint::chain`).
  const torch::Tensor& last_rewards() const { return last_rewards_; }

  /// Writes a checkpoint atomically (temporary file, then rename): models, optimizer, guard,
  /// RNG states, step, options, the algorithm's own state, and each of `extras` (every one a
  /// `Checkpointable`, e.g. the `envs::vector_env` the run steps) under `extra.<i>` in the same
  /// file, so that the model and its environments can never be out of step.
  /// ```cpp
  /// t.save("run/ckpt.pt", venv);   // resume: t.load("run/ckpt.pt", venv);
  /// ```
  template <class... Extras>
  void save(const std::string& path, const Extras&... extras) const {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::trainer::save: every extra must model unirl::Checkpointable: "
                  "void save(torch::serialize::OutputArchive&) const and void load(torch::serialize::InputArchive&) "
                  "(e.g. unirl::envs::vector_env of a checkpointable environment)");
    train::save_with_extras(path, *this, extras...);
  }

  /// The same state into an archive: a trainer is itself `Checkpointable`, so one trainer's
  /// checkpoint can carry another's (`lm.save(path, generator)`, as `joint::chain` does).
  void save(torch::serialize::OutputArchive& a) const {
    a.write("unirl.format", torch::tensor(std::int64_t{1}));
    a.write("unirl.step", torch::tensor(step_));
    train::save_models(a, models_, layout_);
    engine_.save(a);  // optimizer, guard, loss scale
    if constexpr (requires(const algorithm_type& al, torch::serialize::OutputArchive& ar) { al.save(ar); }) {
      torch::serialize::OutputArchive alg;
      algorithm_.save(alg);
      a.write("algorithm", alg);
    }
    train::save_rng(a);
    a.write("options", train::text_tensor(::unirl::options::to_json(opts_).dump()));
  }

  /// Restores a checkpoint written by `save`, and each of `extras` from what the same position of
  /// `save`'s extras wrote; training continues bit for bit on CPU. A missing, truncated or
  /// corrupted file throws `checkpoint_error`, and so does a number of extras other than the one
  /// the checkpoint was saved with (before anything is changed), naming what is missing.
  template <class... Extras>
  void load(const std::string& path, Extras&... extras) {
    static_assert((Checkpointable<Extras> && ...),
                  "unirl::trainer::load: every extra must model unirl::Checkpointable: "
                  "void save(torch::serialize::OutputArchive&) const and void load(torch::serialize::InputArchive&) "
                  "(e.g. a non-const unirl::envs::vector_env of a checkpointable environment)");
    train::load_with_extras(path, *this, "trainer::load", extras...);
  }

  /// Restores what `save(OutputArchive&)` wrote.
  void load(torch::serialize::InputArchive& a) {
    torch::Tensor t;
    a.read("unirl.step", t);
    step_ = t.item<std::int64_t>();
    train::load_models(a, models_, layout_);
    engine_.load(a, "trainer::load");
    if constexpr (requires(algorithm_type& al, torch::serialize::InputArchive& ar) { al.load(ar); }) {
      torch::serialize::InputArchive alg;
      a.read("algorithm", alg);
      algorithm_.load(alg);
    }
    train::load_rng(a);
    resumed_ = true;
  }

  /// The options stored in a checkpoint (to resume a run with the settings it was started with).
  static options checkpoint_options(const std::string& path) {
    options o;
    train::read_checkpoint(path, [&](torch::serialize::InputArchive& a) {
      torch::Tensor t;
      a.read("options", t);
      ::unirl::options::from_json(o, nlohmann::json::parse(train::tensor_text(t)));
    });
    return o;
  }

  model_set<Model>& models() { return models_; }
  const model_set<Model>& models() const { return models_; }
  Reward& reward() { return reward_; }
  algorithm_type& algorithm() { return algorithm_; }
  Parallel& parallel() { return engine_.parallel(); }
  const options& settings() const { return opts_; }
  train::optimizer& optimizer() { return engine_.optim(); }
  /// The update engine (optimizer, schedule, guard, loss scale, clipping, micro-batches, parallel policy).
  train::update_engine<Parallel>& engine() { return engine_; }
  std::int64_t step_count() const { return step_; }
  /// Continues the count of updates from `step`, as `load` does from a checkpoint's: the
  /// learning-rate schedule and the metrics' step numbers follow it, and the metrics file is
  /// appended to. For a state restored from elsewhere (`ppo_agent` loading a checkpoint of the
  /// small-network kernels into the LibTorch path).
  void resume_at_step(std::int64_t step) {
    UNIRL_CHECK(step >= 0, "trainer::resume_at_step: step = ", step, ": expected >= 0");
    step_ = step;
    resumed_ = true;
  }
  torch::Device device() const { return device_; }
  /// `key = value` lines of every option (print it at the start of a run).
  std::string describe() const { return ::unirl::options::to_string(opts_); }

 private:
  static options checked(options o) {
    ::unirl::options::validate(o);
    return o;
  }

  // Settings that cannot work with this machine or model, rejected here rather than at the first
  // step (after a pretraining stage, say): a device that is not there, and what the algorithm's
  // optional `check_model` hook rejects (the token track: completions as long as the model's
  // context, stop tokens outside its vocabulary).
  void check_against_model() const {
    const torch::Device d(opts_.device);
    if (d.is_cuda()) {
      const auto n = torch::cuda::is_available() ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
      if (d.index() >= n || n == 0)
        throw config_error("device", detail::concat("value \"", opts_.device, "\" names a CUDA device, but this ",
                                                    "process sees ", n, " CUDA device(s)"));
    }
    if constexpr (requires { algorithm_.check_model(models_.policy, std::string()); })
      algorithm_.check_model(models_.policy, "algorithm.");
  }

  // The algorithm's optional check of an input before sampling (the token track: prompt lengths).
  template <class Input>
  void check_input(const Input& in) const {
    if constexpr (requires { algorithm_.check_input(models_.policy, in, std::string()); })
      algorithm_.check_input(models_.policy, in, "algorithm.");
  }

  // What the engine is built with: the options' optimizer, schedule (its total_steps the run's
  // when 0), clipping, guard, precision, loss scale and micro-batch size.
  static train::update_options engine_options(const options& o) {
    train::update_options e{o.optim, o.schedule, o.clip, o.guard, o.precision, o.loss_scale, o.micro_batch_size, {}};
    if (e.schedule.total_steps == 0) e.schedule.total_steps = o.total_steps;
    return e;
  }

  static void check_rewards(const torch::Tensor& r, std::int64_t n) {
    UNIRL_CHECK(r.defined(), "reward returned an undefined tensor; expected (", n, ",) scores");
    UNIRL_CHECK(r.dim() == 1 && r.size(0) == n, "reward returned a tensor of shape ", r.sizes(),
                "; expected (", n, ",), one score per sample of the rollout");
    UNIRL_CHECK(r.is_floating_point(), "reward returned dtype ", r.dtype(), "; expected a floating-point tensor");
  }

  torch::TensorOptions f64() const { return torch::TensorOptions(torch::kFloat64).device(device_); }

  // The optimizer steps of one rollout, each one `engine_.step` on a minibatch (one host read: the
  // found-non-finite flag, the loss, the gradient norm and the checks deferred by the loss's ops).
  train::update_sums update(const rollout_type& batch, const step_info& info, step_stats& s, deferred_checks& checks) {
    models_.policy.train(true);
    const std::int64_t n = batch.size();
    const std::int64_t mb_count = std::min(opts_.minibatches, std::max<std::int64_t>(n, 1));
    train::update_sums u;
    auto loss = [&](const rollout_type& b, std::int64_t micro_batches) {
      if (micro_batches == 1) return algorithm_.loss(models_, b, info);
      step_info micro = info;
      micro.micro_batches = micro_batches;
      return algorithm_.loss(models_, b, micro);
    };
    // What a micro-batch's loss divides by (the algorithm's loss_normaliser: the valid tokens under
    // token_mean, the sequences otherwise; else the samples), and the minibatch with the statistics
    // its micro-batches share (the algorithm's prepare_minibatch, e.g. PPO's advantage whitening).
    auto normaliser = [&](const rollout_type& b) -> torch::Tensor {
      if constexpr (requires { { algorithm_.loss_normaliser(b) } -> std::convertible_to<torch::Tensor>; })
        return algorithm_.loss_normaliser(b);
      else
        return torch::full({}, static_cast<double>(b.size()), f64());
    };
    auto prepare = [&](const rollout_type& b) -> rollout_type {
      if constexpr (requires { { algorithm_.prepare_minibatch(b) } -> std::convertible_to<rollout_type>; })
        return algorithm_.prepare_minibatch(b);
      else
        return b;
    };
    for (std::int64_t e = 0; e < opts_.epochs; ++e) {
      const auto perm = mb_count > 1 || opts_.epochs > 1 ? torch::randperm(n, torch::kInt64)
                                                          : torch::arange(n, torch::kInt64);
      for (std::int64_t m = 0; m < mb_count; ++m) {
        const std::int64_t lo = m * n / mb_count, hi = (m + 1) * n / mb_count;
        if (hi <= lo) continue;
        // A reflected batch (core/batch.hpp: batch::select takes an index on any device) gets the
        // host index: no device round trip for its host members; any other on the device.
        const auto mb = batch.select(boost::hana::Struct<rollout_type>::value ? perm.slice(0, lo, hi)
                                                                              : perm.slice(0, lo, hi).to(device_));
        auto r = engine_.step(mb, loss, normaliser, prepare, &checks);
        s.loss_spike = s.loss_spike || r.loss_spike;
        if (r.skipped) {
          ++s.skipped_updates;
          continue;
        }
        s.grad_spike = r.grad_spike || s.grad_spike;
        if constexpr (requires(algorithm_type& a) { a.after_optimizer_step(models_); })
          algorithm_.after_optimizer_step(models_);
        u.add(r, device_);
      }
    }
    engine_.zero_grad();
    s.optimizer_steps = u.taken;
    if (engine_.scaling()) s.extra["loss_scale"] = engine_.loss_scale();
    return u;
  }

  void report(const step_stats& s) {
    if (engine_.parallel().rank() != 0) return;
    if (!opts_.metrics_path.empty() && !metrics_) metrics_.emplace(opts_.metrics_path, resumed_);
    if (metrics_) metrics_->write(s.to_json());
    if (!progress_) progress_.emplace(opts_.total_steps, opts_.progress);
    progress_->update(s);
  }

  // Every `samples_every` steps, the first `samples_count` samples of a text batch (one with
  // decoded completions) and their rewards as rows of `samples_path` (rank 0; appended after a
  // resume). One read of the rewards on those steps only.
  void record_samples(const rollout_type& b, const torch::Tensor& rewards) {
    if constexpr (requires { b.completions; b.prompts; b.references; }) {
      if (opts_.samples_path.empty() || engine_.parallel().rank() != 0 || step_ % opts_.samples_every != 0 ||
          b.completions.empty())
        return;
      if (!samples_) samples_.emplace(opts_.samples_path, resumed_);
      train::write_sample_rows(*samples_, step_, b, rewards, opts_.samples_count);
    }
  }

  options opts_;
  torch::Device device_;
  train::update_engine<Parallel> engine_;  // parameters, optimizer, schedule, guard, precision, parallel policy
  model_set<Model> models_;
  Reward reward_;
  algorithm_type algorithm_;
  std::optional<train::metrics_writer> metrics_;
  std::optional<train::metrics_writer> samples_;
  std::optional<train::progress_line> progress_;
  std::int64_t step_ = 0;
  torch::Tensor last_rewards_;
  bool resumed_ = false;
  train::model_set_layout layout_{};  // whether the reference is the policy with its LoRA adapters off
  train::memory_tracker memory_{device_};
};

}  // namespace unirl
