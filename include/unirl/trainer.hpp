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
/// The trainer builds only what the algorithm declares it needs (`requires_reference`,
/// `requires_critic`, `requires_ema_rollout`), owns the optimizer (AdamW with parameter groups),
/// the learning-rate schedule, gradient clipping, the stability guard, metrics and checkpoints
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
#include <cmath>
#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
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
#include <unirl/config.hpp>
#include <unirl/core/batch.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/models/activation_checkpoint.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/parallel/single_device.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/guard.hpp>
#include <unirl/train/loss_scaler.hpp>
#include <unirl/train/memory.hpp>
#include <unirl/train/metrics.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/train/schedule.hpp>

namespace unirl {

/// Run-time settings of a `trainer<..., Algorithm, ...>`; an aggregate for designated initializers.
template <class Algorithm>
struct trainer_options {
  typename Algorithm::options algorithm{};  // the algorithm's own options
  train::optimizer_options optim{};         // AdamW and its parameter groups
  train::schedule_options schedule{};       // warmup + constant / linear / cosine
  train::clip_options clip{};               // global gradient-norm clipping
  train::guard_options guard{};             // NaN/Inf skips, loss and grad-norm spike monitor
  train::memory_options memory{};           // activation checkpointing, reference placement, tracker
  ::unirl::precision precision = ::unirl::precision::fp32;  // forwards and backward: fp32, bf16, fp16 (autocast;
                                                            // float32 master weights and optimizer state)
  train::loss_scale_options loss_scale{};   // dynamic loss scaling (with fp16; any precision with mode = on)
  std::int64_t group_size = Algorithm::requires_group ? 8 : 1;  // samples per prompt / condition
  std::int64_t epochs = 1;        // passes over each rollout batch
  std::int64_t minibatches = 1;   // optimizer steps per pass
  std::int64_t micro_batch_size = 0;  // samples per forward/backward inside a minibatch (gradient
                                      // accumulation, the same update); 0: the whole minibatch at once
  std::int64_t seed = 0;          // seeds LibTorch's generators (plus the rank)
  std::string device = "cpu";     // "cpu", "cuda", "cuda:1"
  std::string metrics_path{};     // JSONL, one object per step; empty: none
  std::string samples_path{};     // JSONL of sampled completions with their rewards (text batches:
                                  // prompt, completion, reference, reward), for the run report; empty: none
  std::int64_t samples_every = 10;  // steps between two writes of samples_path (steps 0, N, 2N, ...)
  std::int64_t samples_count = 4;   // samples written each time (the batch's first ones)
  bool progress = true;           // one-line progress display on stderr
  std::int64_t total_steps = 0;   // for the ETA, and the schedule when its total_steps is 0

  void validate(const std::string& p) const {
    options::require(group_size >= 1, p + "group_size", group_size, ">= 1");
    if constexpr (Algorithm::requires_group)
      options::require(group_size >= 2, p + "group_size", group_size,
                       ">= 2: this algorithm normalises rewards within a group");
    options::require(epochs >= 1, p + "epochs", epochs, ">= 1");
    options::require(minibatches >= 1, p + "minibatches", minibatches, ">= 1");
    options::require(micro_batch_size >= 0, p + "micro_batch_size", micro_batch_size,
                     ">= 0 (0: the whole minibatch in one forward)");
    if constexpr (!Algorithm::supports_multi_update)
      options::require(epochs * minibatches == 1, p + "epochs", epochs,
                       "1 with minibatches = 1: this algorithm is strictly on-policy");
    options::require(total_steps >= 0, p + "total_steps", total_steps, ">= 0");
    options::require(samples_every >= 1, p + "samples_every", samples_every, ">= 1");
    options::require(samples_count >= 1, p + "samples_count", samples_count, ">= 1");
    try {
      (void)torch::Device(device);
    } catch (const std::exception&) {
      throw config_error(p + "device", "value \"" + device + "\" is not a device: expected cpu, cuda or cuda:N");
    }
    check_precision_supported(precision, torch::Device(device), p + "precision");
  }
};

}  // namespace unirl

// trainer_options is a template, so BOOST_HANA_ADAPT_STRUCT cannot adapt it; this is the same
// accessor table the macro would generate.
namespace boost::hana {
template <class A>
struct accessors_impl<unirl::trainer_options<A>> {
#define UNIRL_MEMBER(name) \
  make_pair(BOOST_HANA_STRING(#name), [](auto&& s) -> decltype(auto) { return (static_cast<decltype(s)&&>(s).name); })
  static constexpr auto apply() {
    return make_tuple(UNIRL_MEMBER(algorithm), UNIRL_MEMBER(optim), UNIRL_MEMBER(schedule), UNIRL_MEMBER(clip),
                      UNIRL_MEMBER(guard), UNIRL_MEMBER(memory), UNIRL_MEMBER(precision), UNIRL_MEMBER(loss_scale),
                      UNIRL_MEMBER(group_size), UNIRL_MEMBER(epochs), UNIRL_MEMBER(minibatches),
                      UNIRL_MEMBER(micro_batch_size), UNIRL_MEMBER(seed), UNIRL_MEMBER(device),
                      UNIRL_MEMBER(metrics_path), UNIRL_MEMBER(samples_path), UNIRL_MEMBER(samples_every),
                      UNIRL_MEMBER(samples_count), UNIRL_MEMBER(progress), UNIRL_MEMBER(total_steps));
  }
#undef UNIRL_MEMBER
};
}  // namespace boost::hana

namespace unirl {

namespace detail {
// What a token-track model lacks of CausalLM, member by member (the trainer names the first).
template <class M>
inline constexpr bool on_token_track = requires { requires std::is_same_v<typename M::track, token_track>; };
template <class M>
inline constexpr bool lm_has_cache_type = requires { typename M::cache_type; };
template <class M>
inline constexpr bool lm_has_make_cache = requires(const M& m, std::int64_t n) {
  { m.make_cache(n, n) } -> std::same_as<typename M::cache_type>;
};
template <class M>
inline constexpr bool lm_has_logits_cached = requires(const M& m, const torch::Tensor& t, typename M::cache_type& c) {
  { m.logits_cached(t, t, c) } -> std::same_as<torch::Tensor>;
};
template <class M>
inline constexpr bool lm_has_logits = requires(const M& m, const torch::Tensor& t) {
  { m.logits(t, t) } -> std::same_as<torch::Tensor>;
};
template <class M>
inline constexpr bool lm_has_vocab_size = requires(const M& m) {
  { m.vocab_size() } -> std::convertible_to<std::int64_t>;
};

// The statistics one minibatch adds to its step's, as () float64 tensors (summed over the step).
struct loss_sums {
  torch::Tensor loss, policy, value, kl, entropy, ratio, clip;
  std::map<std::string, torch::Tensor> extra;
};
}  // namespace detail

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
  static_assert(TrainableModule<Model>,
                "unirl::trainer: Model does not model TrainableModule: it needs parameters(), named_parameters(), "
                "named_buffers(), clone(), train(bool) and to(torch::Device) (see unirl::models::module_adapter)");
  static_assert(ModelAdapter<Model>,
                "unirl::trainer: Model does not model ModelAdapter: it needs a `track` member type with a "
                "`rollout_type` (token_track, flow_track, env_track or a track of your own)");
  static_assert(!detail::on_token_track<Model> || detail::lm_has_logits<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks "
                "`torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const`");
  static_assert(!detail::on_token_track<Model> || detail::lm_has_cache_type<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks the "
                "KV-cache member type `cache_type`");
  static_assert(!detail::on_token_track<Model> || !detail::lm_has_cache_type<Model> ||
                    detail::lm_has_make_cache<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks the "
                "KV-cache member `cache_type make_cache(std::int64_t batch, std::int64_t capacity) const`");
  static_assert(!detail::on_token_track<Model> || !detail::lm_has_cache_type<Model> ||
                    detail::lm_has_logits_cached<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks the "
                "KV-cache member `torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, "
                "cache_type& cache) const`");
  static_assert(!detail::on_token_track<Model> || detail::lm_has_vocab_size<Model>,
                "unirl::trainer: a token-track Model must model unirl::CausalLM (concepts/causal_lm.hpp): it lacks "
                "`std::int64_t vocab_size() const`");

 public:
  /// The algorithm the trainer builds: `Algorithm`, or for a family its member for the model's track.
  using algorithm_type = algorithm_for_t<Algorithm, Model>;

 private:
  static_assert(::unirl::Algorithm<algorithm_type>,
                "unirl::trainer: Algorithm does not model unirl::Algorithm: it needs `options`, a constructor "
                "from options, the requires_* flags and supports_track (see concepts/algorithm.hpp)");
  static_assert(AlgorithmFor<Algorithm, Model>,
                "unirl::trainer: Algorithm does not model AlgorithmFor<Algorithm, Model>: it cannot train this "
                "model's track (supports_track, advantage(...) and loss(...) on rollout_t<Model>)");
  static_assert(RewardFor<Reward, rollout_t<Model>>,
                "unirl::trainer: Reward does not model RewardFor<Reward, rollout_t<Model>>: it must be callable "
                "on the model's rollout batch and return torch::Tensor (one score per sample)");
  static_assert(ParallelStrategy<Parallel>,
                "unirl::trainer: Parallel does not model ParallelStrategy (see concepts/parallel.hpp)");

 public:
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
        parallel_(std::move(parallel)),
        models_{std::move(model)},
        reward_(std::move(reward)),
        algorithm_(opts_.algorithm),
        guard_(opts_.guard) {
    check_against_model();
    torch::manual_seed(static_cast<std::uint64_t>(opts_.seed + parallel_.rank()));
    models::enable_checkpointing(models_.policy, opts_.memory.checkpointing);  // the critic copies it
    models_.policy.to(device_);
    if constexpr (algorithm_type::requires_critic && CriticFactory<Model>) {
      models_.critic.emplace(models_.policy.make_critic());
      models_.critic->to(device_);
    }
    // Every rank starts from rank 0's parameters (trainable or frozen) and buffers, before the
    // reference and EMA copies are made from the policy.
    {
      std::vector<torch::Tensor> state;
      for (auto& [n, t] : trainable_state()) {
        (void)n;
        state.push_back(t);
      }
      parallel_.broadcast(state, 0);
    }
    if constexpr (algorithm_type::requires_reference) {
      bool use = true;
      if constexpr (requires(const algorithm_type& a) { { a.uses_reference() } -> std::convertible_to<bool>; })
        use = algorithm_.uses_reference();
      if (use) models_.reference.emplace(reference_of(models_.policy));
      if (models_.reference && !reference_shared_) place_reference();
    }
    if constexpr (algorithm_type::requires_ema_rollout) models_.ema.emplace(frozen_copy(models_.policy));

    named_tensors named = models_.policy.named_parameters();
    if constexpr (algorithm_type::requires_critic && CriticFactory<Model>)
      for (auto& [n, t] : models_.critic->named_parameters()) named.emplace_back("critic." + n, t);
    for (auto& [n, t] : named) {
      (void)n;
      if (t.requires_grad()) params_.push_back(t);
    }
    UNIRL_CHECK(!params_.empty(), "trainer: the model has no trainable parameters");
    if constexpr (ShardedParallelStrategy<Parallel>) {
      // Sharded optimizer state: the optimizer steps this rank's pieces only. The groups with
      // their own clipping are taken from the full layout, so every rank clips the same groups.
      const train::optimizer full(named, opts_.optim);  // the group layout only (no state yet)
      for (std::size_t g = 0; g < full.group_count(); ++g)
        if (full.group_max_grad_norm(g) > 0) shard_clip_groups_.emplace_back(full.group_name(g), full.group_max_grad_norm(g));
      named = parallel_.owned_parameters(named);
    }
    optimizer_ = std::make_unique<train::optimizer>(named, opts_.optim);
    if constexpr (ShardedParallelStrategy<Parallel>) shards_ = optimizer_->parameters();
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
    optimizer_->set_lr_multiplier(train::lr_multiplier(schedule(), step_));
    s.learning_rate = optimizer_->learning_rate();

    if constexpr (requires { input.tokens.at(0).size(); }) check_prompt_lengths(input);  // a prompt_batch
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
    optimizer_->set_lr_multiplier(train::lr_multiplier(schedule(), step_));
    s.learning_rate = optimizer_->learning_rate();
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
    const auto first = read({r64.numel() > 0 ? torch::isfinite(r64).all() : torch::ones({}, f64()), reward_figures(r64)},
                            checks);
    const bool rewards_ok = parallel_.all_agree(first.at(0) != 0.0);
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
    update_result u;
    if (rewards_ok) {
      u = update(*batch, info, s, checks);
    } else {
      ++s.skipped_updates;
      guard_.count_skip();
      std::cerr << "unirl: step " << step_ << ": non-finite reward; update skipped, weights unchanged\n";
    }
    finish_statistics(s, r64, adv, u, pending, checks);
    const auto t4 = clock::now();
    if (opts_.memory.track) memory_.lap(s.extra, "update");
    parallel_.sync_weights(models_.policy.parameters());
    sync_buffers();
    const auto t5 = clock::now();
    if (opts_.memory.track) {
      memory_.lap(s.extra, "sync");
      if (models_.reference) s.extra["memory/reference_mb"] = static_cast<double>(reference_bytes_) / (1024.0 * 1024.0);
    }

    s.time_sample = seconds(t0, t1);
    s.time_reward = seconds(t1, t2);
    s.time_advantage = seconds(t2, t3);
    s.time_update = seconds(t3, t4);
    s.time_sync = seconds(t4, t5);
    s.seconds = seconds(t0, t5);
    s.samples_per_second = s.seconds > 0 ? static_cast<double>(s.samples) / s.seconds : 0.0;
    s.skipped_total = guard_.skipped_total();
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
    if constexpr (requires { input.tokens.at(0).size(); }) check_prompt_lengths(input);
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
    train::save_tensors(a, "policy.", state_of(models_.policy));
    if (models_.reference && !reference_shared_) train::save_tensors(a, "reference.", state_of(*models_.reference));
    if (models_.ema) train::save_tensors(a, "ema.", state_of(*models_.ema));
    if constexpr (algorithm_type::requires_critic && CriticFactory<Model>)
      train::save_tensors(a, "critic.", state_of(*models_.critic));
    torch::serialize::OutputArchive opt, guard;
    optimizer_->save(opt);
    a.write("optimizer", opt);
    guard_.save(guard);
    a.write("guard", guard);
    if (scaling_) {
      torch::serialize::OutputArchive scale;
      scaler_.save(scale);
      a.write("loss_scale", scale);
    }
    if constexpr (requires(const algorithm_type& al, torch::serialize::OutputArchive& ar) { al.save(ar); }) {
      torch::serialize::OutputArchive alg;
      algorithm_.save(alg);
      a.write("algorithm", alg);
    }
    train::save_rng(a);
    a.write("options", text_tensor(::unirl::options::to_json(opts_).dump()));
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
    train::load_tensors(a, "policy.", state_of(models_.policy));
    if (models_.reference && !reference_shared_) train::load_tensors(a, "reference.", state_of(*models_.reference));
    if (models_.ema) train::load_tensors(a, "ema.", state_of(*models_.ema));
    if constexpr (algorithm_type::requires_critic && CriticFactory<Model>)
      train::load_tensors(a, "critic.", state_of(*models_.critic));
    torch::serialize::InputArchive opt, guard;
    a.read("optimizer", opt);
    optimizer_->load(opt);
    a.read("guard", guard);
    guard_.load(guard);
    if (scaling_ && train::has_key(a, "loss_scale")) {
      auto scale = train::read_archive(a, "loss_scale", "trainer::load");
      scaler_.load(scale);
    }
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
      ::unirl::options::from_json(o, nlohmann::json::parse(tensor_text(t)));
    });
    return o;
  }

  model_set<Model>& models() { return models_; }
  const model_set<Model>& models() const { return models_; }
  Reward& reward() { return reward_; }
  algorithm_type& algorithm() { return algorithm_; }
  Parallel& parallel() { return parallel_; }
  const options& settings() const { return opts_; }
  train::optimizer& optimizer() { return *optimizer_; }
  std::int64_t step_count() const { return step_; }
  torch::Device device() const { return device_; }
  /// `key = value` lines of every option (print it at the start of a run).
  std::string describe() const { return ::unirl::options::to_string(opts_); }

 private:
  static options checked(options o) {
    ::unirl::options::validate(o);
    return o;
  }

  // The sampling options of the algorithm (GRPO family: algorithm.sampling; PPO on the token
  // track: algorithm.track.sampling) and their key; nullptr for algorithms without them.
  auto sampling_settings() const {
    if constexpr (requires { opts_.algorithm.sampling.max_new_tokens; })
      return std::pair{&opts_.algorithm.sampling, std::string("algorithm.sampling.")};
    else if constexpr (requires { opts_.algorithm.track.sampling.max_new_tokens; })
      return std::pair{&opts_.algorithm.track.sampling, std::string("algorithm.track.sampling.")};
    else
      return std::pair{static_cast<const int*>(nullptr), std::string()};
  }

  // Settings that cannot work with this model or machine, rejected here rather than at the first
  // step (after a pretraining stage, say): a device that is not there, completions as long as the
  // model's context, stop tokens outside its vocabulary.
  void check_against_model() const {
    const torch::Device d(opts_.device);
    if (d.is_cuda()) {
      const auto n = torch::cuda::is_available() ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
      if (d.index() >= n || n == 0)
        throw config_error("device", detail::concat("value \"", opts_.device, "\" names a CUDA device, but this ",
                                                    "process sees ", n, " CUDA device(s)"));
    }
    const auto [s, p] = sampling_settings();
    if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(*s)>, int>) {
      if constexpr (requires(const Model& m) { { m.max_length() } -> std::convertible_to<std::int64_t>; }) {
        const std::int64_t L = models_.policy.max_length();
        if (s->max_new_tokens >= L)
          throw config_error(p + "max_new_tokens",
                             detail::concat("value ", s->max_new_tokens, " leaves no room for a prompt in the model's ",
                                            "context of max_length() = ", L, " tokens; expected < ", L));
      }
      if constexpr (detail::lm_has_vocab_size<Model>) {
        const std::int64_t V = models_.policy.vocab_size();
        for (const auto t : s->stop_tokens)
          if (t < 0 || t >= V)
            throw config_error(p + "stop_tokens", detail::concat("token id ", t, " is outside the model's vocabulary of ",
                                                                  V, " tokens; expected ids in [0, ", V, ")"));
      }
    }
  }

  // The longest prompt plus max_new_tokens must fit the model's context; checked before sampling.
  template <class Prompts>
  void check_prompt_lengths(const Prompts& in) const {
    if constexpr (requires(const Model& m) { { m.max_length() } -> std::convertible_to<std::int64_t>; }) {
      const auto [s, p] = sampling_settings();
      if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(*s)>, int>) {
        const std::int64_t L = models_.policy.max_length(), T = s->max_new_tokens;
        for (std::size_t i = 0; i < in.tokens.size(); ++i) {
          const auto P = static_cast<std::int64_t>(in.tokens[i].size());
          UNIRL_CHECK(P + T <= L, "trainer::step: prompt ", i, " has ", P, " tokens; with ", p, "max_new_tokens = ", T,
                      " that makes ", P + T, ", more than the model's max_length() = ", L,
                      ": shorten the prompts to at most ", L - T, " tokens or lower max_new_tokens");
        }
      }
    }
  }

  // Moves the frozen reference to `memory.reference_device` (when set) and notes its size.
  void place_reference() {
    if (!opts_.memory.reference_device.empty()) {
      const torch::Device d(opts_.memory.reference_device);
      if (d != device_ && !detail::on_token_track<Model>)
        throw config_error("memory.reference_device",
                           "value \"" + opts_.memory.reference_device + "\" differs from device = \"" + opts_.device +
                               "\", but only the token track computes reference log-probs off the training device; "
                               "expected empty or \"" + opts_.device + "\"");
      if (d.is_cuda() && (!torch::cuda::is_available() || d.index() >= static_cast<int>(torch::cuda::device_count())))
        throw config_error("memory.reference_device", "value \"" + opts_.memory.reference_device +
                                                          "\" names a CUDA device this process does not see");
      models_.reference->to(d);
    }
    reference_bytes_ = train::state_bytes(*models_.reference);
  }

  // The reference model: a frozen copy of the policy, or — for a policy with LoRA adapters — the
  // policy itself (no second copy of the weights), which the algorithms score with the adapters
  // switched off (lora::without_adapters): the base model.
  Model reference_of(const Model& m) {
    if constexpr (std::copy_constructible<Model>) {
      if (lora::has_adapters(m.named_parameters())) {
        if (!opts_.memory.reference_device.empty() && torch::Device(opts_.memory.reference_device) != device_)
          throw config_error("memory.reference_device",
                             "value \"" + opts_.memory.reference_device + "\": the reference of a model with LoRA "
                             "adapters is the policy's own weights with the adapters off; expected empty or \"" +
                                 opts_.device + "\"");
        reference_shared_ = true;
        return m;
      }
    }
    return frozen_copy(m);
  }

  static Model frozen_copy(const Model& m) {
    Model c = m.clone();
    for (auto& p : c.parameters()) p.set_requires_grad(false);
    c.train(false);
    return c;
  }


  // The policy's (and critic's) parameters and buffers: what rank 0 broadcasts at construction.
  named_tensors trainable_state() const {
    named_tensors all = state_of(models_.policy);
    if constexpr (algorithm_type::requires_critic && CriticFactory<Model>)
      for (auto& [n, t] : state_of(*models_.critic)) all.emplace_back("critic." + n, t);
    return all;
  }

  // Buffers (BatchNorm statistics, any registered buffer) change with each rank's own data and
  // get no gradient all-reduce: rank 0's are broadcast after every weight sync, as PyTorch's DDP
  // does with broadcast_buffers. Looked up each time, so a module that replaces a buffer is seen.
  void sync_buffers() {
    if (parallel_.world_size() <= 1) return;
    std::vector<torch::Tensor> buffers;
    for (auto& [n, b] : models_.policy.named_buffers()) {
      (void)n;
      buffers.push_back(b);
    }
    if constexpr (algorithm_type::requires_critic && CriticFactory<Model>)
      for (auto& [n, b] : models_.critic->named_buffers()) {
        (void)n;
        buffers.push_back(b);
      }
    if (!buffers.empty()) parallel_.broadcast(buffers, 0);
  }

  template <class T>
  static named_tensors state_of(const T& m) {
    named_tensors all = m.named_parameters();
    for (auto& b : m.named_buffers()) all.push_back(b);
    return all;
  }

  static torch::Tensor text_tensor(const std::string& s) {
    return torch::from_blob(const_cast<char*>(s.data()), {static_cast<std::int64_t>(s.size())}, torch::kUInt8).clone();
  }
  static std::string tensor_text(const torch::Tensor& t) {
    auto c = t.contiguous();
    return std::string(reinterpret_cast<const char*>(c.data_ptr<std::uint8_t>()), static_cast<std::size_t>(c.numel()));
  }

  train::schedule_options schedule() const {
    auto s = opts_.schedule;
    if (s.total_steps == 0) s.total_steps = opts_.total_steps;
    return s;
  }

  static void check_rewards(const torch::Tensor& r, std::int64_t n) {
    UNIRL_CHECK(r.defined(), "reward returned an undefined tensor; expected (", n, ",) scores");
    UNIRL_CHECK(r.dim() == 1 && r.size(0) == n, "reward returned a tensor of shape ", r.sizes(),
                "; expected (", n, ",), one score per sample of the rollout");
    UNIRL_CHECK(r.is_floating_point(), "reward returned dtype ", r.dtype(), "; expected a floating-point tensor");
  }

  torch::TensorOptions f64() const { return torch::TensorOptions(torch::kFloat64).device(device_); }

  // Reads `parts` (scalars or 1-D, any dtype; undefined ones are left out) and the waiting
  // deferred checks in one host read, throws the first failed check's message, and returns the
  // parts' values in order.
  std::vector<double> read(const std::vector<torch::Tensor>& parts, deferred_checks& checks) const {
    std::vector<torch::Tensor> flat;
    std::size_t n = 0;
    for (const auto& p : parts) {
      if (!p.defined()) continue;
      flat.push_back(p.detach().reshape({-1}).to(device_, torch::kFloat64));
      n += static_cast<std::size_t>(flat.back().numel());
    }
    const auto c = checks.values();
    if (c.defined()) flat.push_back(c.to(device_));
    auto all = flat.empty() ? std::vector<double>{} : to_host(torch::cat(flat));
    if (c.defined()) checks.verify(std::vector<double>(all.begin() + static_cast<std::ptrdiff_t>(n), all.end()));
    all.resize(n);
    return all;
  }

  // Mean, std (unbiased; 0 for one value), min and max of float64 values: (4,), no read.
  torch::Tensor reward_figures(const torch::Tensor& r) const {
    if (r.numel() == 0) return torch::zeros({4}, f64());
    return torch::stack({r.mean(), r.numel() > 1 ? r.std() : torch::zeros({}, f64()), r.min(), r.max()});
  }

  // What `update` hands to the statistics: sums over the optimizer steps taken.
  struct update_result {
    std::int64_t taken = 0;
    double loss = 0, grad_norm = 0;  // read with the per-minibatch flag
    detail::loss_sums sums{};
  };

  // Fills the step's statistics from device tensors with one read: advantage and loss figures
  // (averaged over ranks through `all_reduce_mean`; rewards and advantages from all ranks' counts,
  // sums and sums of squares; the reward range over ranks through `all_reduce_max` when the
  // strategy has it), the algorithm's reported figures and the deferred checks. The `extra`
  // figures are this rank's own.
  void finish_statistics(step_stats& s, const torch::Tensor& r64, const torch::Tensor& adv, const update_result& u,
                         const std::map<std::string, torch::Tensor>& pending, deferred_checks& checks) {
    torch::NoGradGuard ng;
    const auto zero = torch::zeros({}, f64());
    auto sum_or_zero = [&](const torch::Tensor& t) { return t.defined() ? t.to(device_, torch::kFloat64) : zero; };
    const double d = u.taken > 0 ? static_cast<double>(u.taken) : 1.0;
    const auto a_own = adv.defined() ? adv.detach().reshape({-1}).to(device_) : torch::zeros({0}, f64());
    const auto a = a_own.to(torch::kFloat64);
    auto moments = [&](const torch::Tensor& x) {
      return torch::stack({torch::full({}, static_cast<double>(x.numel()), f64()), x.sum(), x.square().sum()});
    };
    std::vector<torch::Tensor> core{moments(r64),
                                    moments(a),
                                    a.numel() > 0 ? a_own.mean().to(torch::kFloat64) : zero,
                                    a.numel() > 1 ? a_own.std().to(torch::kFloat64) : zero,
                                    sum_or_zero(u.sums.policy) / d,
                                    sum_or_zero(u.sums.value) / d,
                                    sum_or_zero(u.sums.kl) / d,
                                    sum_or_zero(u.sums.entropy) / d,
                                    u.taken > 0 ? sum_or_zero(u.sums.ratio) / d : torch::ones({}, f64()),
                                    sum_or_zero(u.sums.clip) / d,
                                    torch::full({}, u.loss / d, f64()),
                                    torch::full({}, u.grad_norm / d, f64())};
    for (auto& c : core) c = c.reshape({-1});
    const bool many = parallel_.world_size() > 1;
    torch::Tensor shared = torch::cat(core);
    if (many) shared = parallel_.all_reduce_mean(shared);  // every rank: the same layout
    torch::Tensor range;
    if constexpr (requires(Parallel& p, const torch::Tensor& t) { p.all_reduce_max(t); })
      if (many) range = parallel_.all_reduce_max(r64.numel() > 0 ? torch::stack({r64.max(), -r64.min()})
                                                                 : torch::full({2}, -1e300, f64()));
    std::vector<torch::Tensor> parts{shared, range};
    std::vector<std::string> keys;
    for (const auto& [k, v] : pending) {
      keys.push_back(k);
      parts.push_back(v);
    }
    for (const auto& [k, v] : u.sums.extra) {
      keys.push_back(k);
      parts.push_back(v / d);
    }
    const auto got = read(parts, checks);
    std::size_t at = static_cast<std::size_t>(shared.numel());
    if (many) {
      auto moment_stats = [](double n, double sum, double sumsq, double& mean, double& sd) {
        if (n <= 0) return;
        mean = sum / n;
        sd = n > 1 ? std::sqrt(std::max(0.0, (sumsq - n * mean * mean) / (n - 1))) : 0.0;
      };
      const double w = parallel_.world_size();
      moment_stats(got[0] * w, got[1] * w, got[2] * w, s.reward_mean, s.reward_std);
      moment_stats(got[3] * w, got[4] * w, got[5] * w, s.advantage_mean, s.advantage_std);
      if (range.defined()) {
        s.reward_max = got[at];
        s.reward_min = -got[at + 1];
        at += 2;
      }
    } else {
      s.advantage_mean = got[6];
      s.advantage_std = got[7];
    }
    if (u.taken > 0) {
      s.policy_loss = got[8];
      s.value_loss = got[9];
      s.kl = got[10];
      s.entropy = got[11];
      s.ratio_mean = got[12];
      s.clip_fraction = got[13];
      s.loss = got[14];
      s.grad_norm = got[15];
    }
    for (const auto& k : keys) s.extra[k] = got[at++];
  }

  // The optimizer steps of one rollout. Per minibatch one host read: the found-non-finite flag
  // (loss and gradients), the loss, the gradient norm and the checks deferred by the loss's ops.
  update_result update(const rollout_type& batch, const step_info& info, step_stats& s, deferred_checks& checks) {
    models_.policy.train(true);
    const std::int64_t n = batch.size();
    const std::int64_t mb_count = std::min(opts_.minibatches, std::max<std::int64_t>(n, 1));
    update_result u;
    auto add = [](torch::Tensor& acc, const torch::Tensor& x) { acc = acc.defined() ? acc + x : x; };
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
        optimizer_->zero_grad();
        loss_terms terms = forward_backward(mb, info);  // terms.total detached; gradients in place
        parallel_.all_reduce_gradients(params_);
        // Under a sharding strategy only this rank's pieces (`shards_`) hold gradients now, and
        // norms are the strategy's global ones.
        constexpr bool sharded = ShardedParallelStrategy<Parallel>;
        const std::vector<torch::Tensor>& live = sharded ? shards_ : params_;
        if (scaling_) scaler_.unscale(live);
        if constexpr (sharded) {
          for (const auto& [name, max_norm] : shard_clip_groups_) {
            std::vector<torch::Tensor> ps;  // this rank's pieces of the group (maybe none)
            for (std::size_t g = 0; g < optimizer_->group_count(); ++g)
              if (optimizer_->group_name(g) == name) ps = optimizer_->group_params(g);
            train::clip_grads(ps, parallel_.grad_norm(ps), max_norm);
          }
        } else {
          for (std::size_t g = 0; g < optimizer_->group_count(); ++g)
            if (optimizer_->group_max_grad_norm(g) > 0)
              train::clip_grads(optimizer_->group_params(g), train::grad_norm_tensor(optimizer_->group_params(g)),
                                optimizer_->group_max_grad_norm(g));
        }
        torch::Tensor norm;
        if constexpr (sharded) norm = parallel_.grad_norm(live);
        else norm = train::grad_norm_tensor(live);
        const torch::Tensor bad_grads = train::stability_guard::nonfinite_grads(live);
        const auto got = read({torch::isfinite(terms.total.detach()).all(),
                               bad_grads.defined() ? bad_grads : torch::zeros({}, torch::kBool),
                               terms.total.detach(), norm},
                              checks);
        const double lv = got.at(2), gn = got.at(3);
        const bool loss_ok = parallel_.all_agree(got.at(0) != 0.0);
        const bool spike = loss_ok && guard_.observe_loss(lv);
        s.loss_spike = s.loss_spike || spike;
        if (!loss_ok || (spike && opts_.guard.skip_loss_spikes)) {
          optimizer_->zero_grad();
          skip(s, loss_ok ? "loss spike" : "non-finite loss");
          continue;
        }
        if (!parallel_.all_agree(got.at(1) == 0.0)) {
          optimizer_->zero_grad();
          if (scaling_) {  // an overflow of the loss scale: lower it and skip (PyTorch's GradScaler)
            const double was = scaler_.value();
            scaler_.update(false);
            skip(s, detail::concat("non-finite gradient under loss scale ", was, "; scale lowered to ",
                                   scaler_.value()).c_str());
          } else {
            skip(s, "non-finite gradient");
          }
          continue;
        }
        if (scaling_) scaler_.update(true);
        if (opts_.clip.max_grad_norm > 0) train::clip_grads(live, norm, opts_.clip.max_grad_norm);
        s.grad_spike = guard_.observe_grad_norm(gn) || s.grad_spike;
        optimizer_->step();
        if constexpr (sharded) parallel_.after_optimizer_step(params_);  // the owners' new values everywhere
        if constexpr (requires(algorithm_type& a) { a.after_optimizer_step(models_); })
          algorithm_.after_optimizer_step(models_);
        ++u.taken;
        u.loss += lv;
        u.grad_norm += gn;
        add(u.sums.policy, terms.policy.tensor(device_));
        add(u.sums.value, terms.value.tensor(device_));
        add(u.sums.kl, terms.kl.tensor(device_));
        add(u.sums.entropy, terms.entropy.tensor(device_));
        add(u.sums.ratio, terms.ratio_mean.tensor(device_));
        add(u.sums.clip, terms.clip_fraction.tensor(device_));
        for (const auto& [k, v] : terms.extra) add(u.sums.extra[k], v.tensor(device_));
      }
    }
    optimizer_->zero_grad();
    s.optimizer_steps = u.taken;
    if (scaling_) s.extra["loss_scale"] = scaler_.value();
    return u;
  }

  // The forward and backward of one minibatch, under the precision's autocast (the backward
  // outside it, as torch.autocast wants), the loss multiplied by the loss scale when scaling is on.
  // With `micro_batch_size` the minibatch runs in micro-batches whose losses weigh
  // n_i / sum_j n_j, n_i the algorithm's `loss_normaliser` (the valid tokens under token_mean,
  // the sequences otherwise; the sample count for an algorithm without one) — the gradients of
  // the whole minibatch's loss — after `prepare_minibatch` took the statistics the micro-batches
  // share (PPO's advantage whitening). Returns the minibatch's terms, `total` detached, the
  // figures weighted the same way.
  loss_terms forward_backward(const rollout_type& mb, const step_info& info) {
    const std::int64_t n = mb.size(), k = opts_.micro_batch_size;
    auto backward = [&](const torch::Tensor& loss) { (scaling_ ? scaler_.scale(loss) : loss).backward(); };
    if (k <= 0 || k >= n) {
      loss_terms t = [&] {
        autocast_scope amp(device_, opts_.precision);
        return algorithm_.loss(models_, mb, info);
      }();
      backward(t.total);
      t.total = t.total.detach();
      return t;
    }
    step_info micro = info;
    micro.micro_batches = (n + k - 1) / k;
    const rollout_type whole = prepared(mb);
    std::vector<rollout_type> parts;
    std::vector<torch::Tensor> mass;
    for (std::int64_t lo = 0; lo < n; lo += k) {
      parts.push_back(whole.select(torch::arange(lo, std::min(n, lo + k), torch::kInt64).to(device_)));
      mass.push_back(normaliser_of(parts.back()));
    }
    const torch::Tensor all = torch::stack(mass).sum();
    loss_terms out;
    auto acc = [&](scalar_stat& into, const scalar_stat& x, const torch::Tensor& w) {
      const torch::Tensor v = x.tensor(device_) * w;
      into = scalar_stat(into.value.defined() ? into.value + v : v);
    };
    scalar_stat total;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const torch::Tensor w = torch::where(all > 0, mass[i] / all, torch::zeros_like(all));  // () float64
      loss_terms t = [&] {
        autocast_scope amp(device_, opts_.precision);
        return algorithm_.loss(models_, parts[i], micro);
      }();
      backward(t.total * w.to(t.total.scalar_type()));
      acc(total, t.total.detach(), w);
      acc(out.policy, t.policy, w);
      acc(out.value, t.value, w);
      acc(out.kl, t.kl, w);
      acc(out.entropy, t.entropy, w);
      acc(out.ratio_mean, t.ratio_mean, w);
      acc(out.clip_fraction, t.clip_fraction, w);
      for (const auto& [key, v] : t.extra) acc(out.extra[key], v, w);
    }
    out.total = total.value;
    return out;
  }

  // The minibatch with the statistics its micro-batches share (the algorithm's prepare_minibatch).
  rollout_type prepared(const rollout_type& mb) const {
    if constexpr (requires(const algorithm_type& a, const rollout_type& r) {
                    { a.prepare_minibatch(r) } -> std::convertible_to<rollout_type>;
                  })
      return algorithm_.prepare_minibatch(mb);
    else
      return mb;
  }

  // What the loss of `b` divides by (the algorithm's loss_normaliser; else its samples): () float64.
  torch::Tensor normaliser_of(const rollout_type& b) const {
    if constexpr (requires(const algorithm_type& a, const rollout_type& r) {
                    { a.loss_normaliser(r) } -> std::convertible_to<torch::Tensor>;
                  })
      return algorithm_.loss_normaliser(b).to(device_, torch::kFloat64).reshape({});
    else
      return torch::full({}, static_cast<double>(b.size()), f64());
  }

  void skip(step_stats& s, const char* why) {
    ++s.skipped_updates;
    guard_.count_skip();
    std::cerr << "unirl: step " << step_ << ": " << why << "; optimizer step skipped, weights unchanged\n";
  }

  void report(const step_stats& s) {
    if (parallel_.rank() != 0) return;
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
      if (opts_.samples_path.empty() || parallel_.rank() != 0 || step_ % opts_.samples_every != 0 ||
          b.completions.empty())
        return;
      if (!samples_) samples_.emplace(opts_.samples_path, resumed_);
      const auto n = std::min<std::int64_t>(opts_.samples_count, static_cast<std::int64_t>(b.completions.size()));
      const torch::Tensor r = rewards.detach().reshape({-1}).slice(0, 0, n).to(torch::kCPU, torch::kFloat64).contiguous();
      for (std::int64_t i = 0; i < n; ++i) {
        const auto k = static_cast<std::size_t>(i);
        samples_->write({{"step", step_},
                         {"sample", i},
                         {"prompt", k < b.prompts.size() ? b.prompts[k] : std::string{}},
                         {"completion", b.completions[k]},
                         {"reference", k < b.references.size() ? b.references[k] : std::string{}},
                         {"reward", r.data_ptr<double>()[i]}});
      }
    }
  }

  options opts_;
  torch::Device device_;
  Parallel parallel_;
  model_set<Model> models_;
  Reward reward_;
  algorithm_type algorithm_;
  train::stability_guard guard_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<train::optimizer> optimizer_;
  std::vector<torch::Tensor> shards_;                               // ShardedParallelStrategy: the optimizer's pieces
  std::vector<std::pair<std::string, double>> shard_clip_groups_;  // ... and the groups clipped on their own
  std::optional<train::metrics_writer> metrics_;
  std::optional<train::metrics_writer> samples_;
  std::optional<train::progress_line> progress_;
  std::int64_t step_ = 0;
  torch::Tensor last_rewards_;
  bool resumed_ = false;
  bool reference_shared_ = false;  // the reference is the policy with its LoRA adapters off
  train::memory_tracker memory_{device_};
  bool scaling_ = opts_.loss_scale.mode == train::loss_scaling::on ||
                  (opts_.loss_scale.mode == train::loss_scaling::automatic && opts_.precision == precision::fp16);
  train::loss_scaler scaler_{opts_.loss_scale};
  std::int64_t reference_bytes_ = 0;
};

}  // namespace unirl
