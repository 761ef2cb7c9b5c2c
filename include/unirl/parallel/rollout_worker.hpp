#pragma once
/// \file rollout_worker.hpp
/// The two sides of the learner / sampler split (docs/parallel.md): `rollout_worker` samples
/// and scores batches from its own copy of the model with the newest weights the transport
/// gives it; `learner` pops those batches into `trainer::learn` and publishes the weights after
/// each step with the next version.
///
/// ```cpp
/// using tr_t = unirl::parallel::c10d_transport<bandit::rollout>;
/// auto tr = tr_t::from_environment({.max_staleness = 1});
/// if (tr.is_learner()) {
///   my_trainer t{model, reward, opts};
///   unirl::parallel::learner l{t, tr};                 // publishes version 0
///   for (int s = 0; s < steps; ++s) l.step();          // pop (gather), learn, publish
///   l.finish();
/// } else {
///   unirl::parallel::rollout_worker<my_model, my_algo, my_reward, tr_t> w{model, reward, opts, tr, tr.rank() - 1};
///   while (w.run_once(next_prompts())) {}
/// }
/// ```
/// Synchronous (`max_staleness() == 0`): the worker waits for each new version before it
/// samples again, and a learner step gathers one batch per sampler (`batch::concat`), all drawn
/// with its current weights — the colocated `trainer::step` on the same batches. Asynchronous:
/// the worker samples with the newest weights it has without waiting; the learner takes the next
/// batch no older than `max_staleness` versions and trains on it against its behaviour
/// log-probs (`trainer::learn` with the staleness).
///
/// `worker_options::overlap_scoring` (asynchronous mode): batch k is scored on another thread (or
/// by `submit` on a reward that has one, e.g. `rewards::remote_scorer`) while the worker fetches
/// weights and samples batch k+1; batch k is pushed, with its own `policy_version`, once batch k+1
/// is sampled (pushes stay in order; `flush` pushes the last one). Synchronous mode scores in line
/// whatever the option says: the next batch needs the weights trained on this one's rewards.
///
/// Restarts (docs/parallel.md, "Faults"; the chaos loop in tests/crash). With
/// `worker_options::seed_per_version` each batch's random stream is a function of the seed, the
/// stream and the weight version alone, and `run_once(input_of)` asks for the input of the
/// version it fetched: a sampler killed and started again — or a replacement — draws, from a
/// learner resumed at its checkpoint (`learner{t, tr, t.step_count()}`), the very batches the
/// lost one would have drawn. `save` / `load` keep the rest of a worker's state (its batch count
/// and random generators) in an atomically written checkpoint.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/train/checkpoint.hpp>

#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/concepts/reward.hpp>
#include <unirl/concepts/transport.hpp>
#include <unirl/core/batch.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/rewards/scorer.hpp>
#include <unirl/rollout/partial.hpp>

namespace unirl::parallel {

/// The tensors a transport carries for a model: its parameters, then its buffers, in order.
template <class M>
std::vector<torch::Tensor> policy_state(const M& m) {
  std::vector<torch::Tensor> out;
  for (auto& [n, t] : m.named_parameters()) out.push_back(t);
  for (auto& [n, t] : m.named_buffers()) out.push_back(t);
  return out;
}

/// Settings of `rollout_worker` that are not the trainer's (docs/parallel.md, "Reward overlap and
/// reward ranks").
struct worker_options {
  /// Asynchronous mode (`max_staleness() > 0`): score batch k while sampling batch k+1. The
  /// reward then runs on another thread (with no autograd and the trainer's precision, as in
  /// line); it must not be called from elsewhere meanwhile. Ignored in synchronous mode.
  bool overlap_scoring = false;
  /// Reseed before each batch from (seed, stream, weight version) instead of drawing one stream
  /// seeded once with seed + stream: the batch drawn for a version and an input does not depend
  /// on what the worker drew before, so a restarted sampler draws what the killed one drew.
  /// Off by default: then sampler 0 draws the random stream of a colocated trainer.
  bool seed_per_version = false;
  /// Asynchronous mode: partial rollouts (rollout/partial.hpp). The worker's engine keeps its groups
  /// in flight across batches; a batch is the `partial_batch_groups` groups that finished first
  /// (the input's prompts are the over-sampling: the live groups are topped up to their number), and
  /// newer weights are fetched between engine steps, so the sequences in flight go on under them. Each token records
  /// its version (`token_rollout::token_version`); a batch's `policy_version` is its oldest token,
  /// so the learner's staleness counts from it and `max_staleness` bounds every token; a group
  /// that would fall behind it is drawn again. Token samplers on the engine only (the GRPO family).
  bool partial_rollouts = false;
  /// With `partial_rollouts`: at a weight update the sequences in flight prefill again under the
  /// new weights (each token's behaviour log-prob is its version's); false keeps their keys and values.
  bool recompute_kv = true;
  /// With `partial_rollouts`: groups per batch (at most the input's prompts); 0: the input's prompts
  /// (no over-sampling: nothing is left in flight, so a batch waits for its slowest group).
  std::int64_t partial_batch_groups = 0;
  /// With `partial_rollouts`: a group whose oldest token falls more than this many versions behind
  /// the newest weights the worker holds is drawn again. -1: `max_staleness - 1`, because the
  /// learner usually publishes once more between the push and the pop, and `pop` drops a batch
  /// whose oldest token is more than `max_staleness` versions behind the learner.
  std::int64_t partial_max_token_age = -1;
};

namespace detail {
// SplitMix64 over (seed, stream, version): the seed of one batch's stream (worker_options::seed_per_version).
inline std::uint64_t version_seed(std::int64_t seed, std::int64_t stream, std::int64_t version) {
  std::uint64_t z = static_cast<std::uint64_t>(seed);
  for (const std::int64_t x : {stream, version}) {
    z += 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(x);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
  }
  return z;
}
}  // namespace detail

}  // namespace unirl::parallel
BOOST_HANA_ADAPT_STRUCT(unirl::parallel::worker_options, overlap_scoring, seed_per_version, partial_rollouts,
                        recompute_kv, partial_batch_groups, partial_max_token_age);
namespace unirl::parallel {

/// The sampling side: `Sampler` is the algorithm (or family) whose `sample` draws the batches —
/// the learner's trainer uses the same one, with the same `trainer_options`.
template <class Model, class Sampler, class Reward, class Transport>
class rollout_worker {
 public:
  using algorithm_type = algorithm_for_t<Sampler, Model>;
  using rollout_type = rollout_t<Model>;
  static_assert(RolloutTransport<Transport, rollout_type>,
                "unirl::parallel::rollout_worker: Transport does not model RolloutTransport for the model's rollout "
                "batch (concepts/transport.hpp)");
  static_assert(RewardFor<Reward, rollout_type>,
                "unirl::parallel::rollout_worker: Reward does not model RewardFor<Reward, rollout_t<Model>>");
  static_assert(!algorithm_type::requires_ema_rollout,
                "unirl::parallel::rollout_worker: algorithms that sample from an EMA of the policy are not split yet "
                "(docs/parallel.md, what is left)");

  /// `opts` are the learner's `trainer_options` (the algorithm's options, group_size, epochs,
  /// minibatches, seed, device, precision, memory.logprob_chunk are read). `stream` (0 for the
  /// first sampler) offsets the seed: sampler 0 draws the random stream a colocated trainer with
  /// the same options draws. The transport outlives the worker.
  template <class TrainerOptions>
    requires requires(const TrainerOptions& o) {
      { o.algorithm } -> std::convertible_to<typename algorithm_type::options>;
      { o.group_size + o.epochs * o.minibatches + o.seed + o.memory.logprob_chunk } -> std::convertible_to<std::int64_t>;
      torch::Device(o.device);
      { o.precision } -> std::convertible_to<::unirl::precision>;
    }
  rollout_worker(Model model, Reward reward, const TrainerOptions& opts, Transport& transport, std::int64_t stream = 0,
                 worker_options wo = {})
      : device_(opts.device), models_{std::move(model)}, reward_(std::move(reward)), algorithm_(opts.algorithm),
        transport_(&transport), group_size_(opts.group_size), updates_(opts.epochs * opts.minibatches),
        logprob_chunk_(opts.memory.logprob_chunk), seed_(opts.seed), stream_(stream), precision_(opts.precision),
        wo_(wo) {
    ::unirl::options::validate(opts);
    UNIRL_CHECK(stream >= 0, "rollout_worker: stream = ", stream, ": expected >= 0");
    torch::manual_seed(static_cast<std::uint64_t>(opts.seed + stream));
    models_.policy.to(device_);
    weights_ = policy_state(models_.policy);
    if (wo_.partial_rollouts) {
      UNIRL_CHECK(transport.max_staleness() > 0, "rollout_worker: worker_options::partial_rollouts needs the ",
                  "asynchronous split (the transport's max_staleness >= 1; it is 0)");
      UNIRL_CHECK(!wo_.seed_per_version, "rollout_worker: worker_options::partial_rollouts with seed_per_version: a ",
                  "batch with groups carried from earlier versions is not a function of one version; expected one of them");
      UNIRL_CHECK(wo_.partial_batch_groups >= 0, "rollout_worker: worker_options::partial_batch_groups = ",
                  wo_.partial_batch_groups, ": expected >= 0");
      UNIRL_CHECK(wo_.partial_max_token_age >= -1, "rollout_worker: worker_options::partial_max_token_age = ",
                  wo_.partial_max_token_age, ": expected >= 0, or -1 (max_staleness - 1)");
      partial_.emplace(::unirl::rollout::partial_options{.recompute_kv = wo_.recompute_kv,
                                                         .max_token_age = wo_.partial_max_token_age >= 0
                                                                              ? wo_.partial_max_token_age
                                                                              : transport.max_staleness() - 1,
                                                         .batch_groups = wo_.partial_batch_groups},
                       [this] {
                         // The newest weights, copied into the policy in place (-1: the learner finished;
                         // the next push says so).
                         const auto v = transport_->fetch(weights_, version_, version_);
                         if (v > version_) version_ = v;
                         return version_;
                       });
    }
  }

  rollout_worker(rollout_worker&&) = delete;  // a scoring in flight refers to this worker's reward

  /// Fetches newer weights (synchronous: waits for the version after the last one used), samples
  /// one batch from `input`, scores it and pushes it. False when the learner has finished.
  /// With `overlap_scoring` in asynchronous mode it starts scoring the new batch and, before
  /// that, pushes the previous one (waiting for its scores): the scoring of batch k runs during
  /// the fetch and sampling of batch k+1.
  template <class Input>
    requires SamplesFrom<Sampler, Model, std::remove_reference_t<Input>>
  bool run_once(Input&& input) {
    return run([&input](std::int64_t) -> decltype(auto) { return (input); });
  }

  /// As `run_once(input)`, with the input of the weight version fetched: `input_of(version)`.
  /// With `seed_per_version` the batch is then a function of the version alone, whichever
  /// version a (restarted) learner publishes first.
  ///
  /// ```cpp
  /// while (w.run_once([&](std::int64_t v) { return prompts_of_step(v); })) {}
  /// ```
  template <class InputOf>
    requires std::invocable<InputOf&, std::int64_t> &&
             SamplesFrom<Sampler, Model, std::remove_cvref_t<std::invoke_result_t<InputOf&, std::int64_t>>>
  bool run_once(InputOf&& input_of) {
    return run([&input_of](std::int64_t v) -> decltype(auto) { return std::invoke(input_of, v); });
  }

  /// Writes the worker's state to `path` atomically (`train::write_checkpoint`: a crash inside the
  /// save leaves the previous file whole): the version of its last batch, the batches drawn, its
  /// seed and stream, the random generators. Not the weights: those are the learner's. Refused
  /// while a batch is being scored (`flush` first).
  void save(const std::string& path) const {
    UNIRL_CHECK(!pending_, "rollout_worker::save: a batch is being scored (overlap_scoring); call flush() first");
    ::unirl::train::write_checkpoint(path, [&](torch::serialize::OutputArchive& a) {
      a.write("worker/version", c10::IValue(version_));
      a.write("worker/batches", c10::IValue(batches_));
      a.write("worker/seed", c10::IValue(seed_));
      a.write("worker/stream", c10::IValue(stream_));
      a.write("worker/seed_per_version", c10::IValue(wo_.seed_per_version));
      ::unirl::train::save_rng(a);
    });
  }

  /// Restores what `save` wrote — the batch count and the random generators — and returns the
  /// version of the last batch saved. The next `run_once` takes the weights the learner publishes
  /// (a learner resumed from an older checkpoint republishes from its step). Throws
  /// `unirl::checkpoint_error` for a missing, truncated or corrupt file, and `unirl::error` when it
  /// was written by a worker of another seed, stream or `seed_per_version`.
  std::int64_t load(const std::string& path) {
    UNIRL_CHECK(!pending_, "rollout_worker::load: a batch is being scored (overlap_scoring); call flush() first");
    std::int64_t version = -1;
    ::unirl::train::read_checkpoint(path, [&](torch::serialize::InputArchive& a) {
      auto integer = [&](const char* k) {
        c10::IValue v;
        UNIRL_CHECK(a.try_read(k, v) && v.isInt(), "rollout_worker::load: '", path, "' has no integer '", k,
                    "': expected a checkpoint written by rollout_worker::save");
        return v.toInt();
      };
      c10::IValue per;
      UNIRL_CHECK(a.try_read("worker/seed_per_version", per) && per.isBool(), "rollout_worker::load: '", path,
                  "' has no 'worker/seed_per_version': expected a checkpoint written by rollout_worker::save");
      const std::int64_t seed = integer("worker/seed"), stream = integer("worker/stream");
      UNIRL_CHECK(seed == seed_ && stream == stream_ && per.toBool() == wo_.seed_per_version, "rollout_worker::load: '",
                  path, "' was written by the worker of seed ", seed, ", stream ", stream, ", seed_per_version ",
                  per.toBool(), "; this one has seed ", seed_, ", stream ", stream_, ", seed_per_version ",
                  wo_.seed_per_version);
      version = integer("worker/version");
      batches_ = integer("worker/batches");
      ::unirl::train::load_rng(a);
    });
    return version;
  }

  /// Pushes the batch whose scoring is in flight (`overlap_scoring`), waiting for its scores; true

  /// when there was none. Call it after the last `run_once` so the last batch is not lost. False
  /// when the learner has finished; rethrows the reward's error.
  bool flush() {
    if (!pending_) return true;
    auto out = std::move(*pending_);
    pending_.reset();
    out.rewards = scoring_.get();
    check_rewards(out);
    return transport_->push(std::move(out));
  }

  /// True while a batch's scoring is in flight (`overlap_scoring`, asynchronous mode).
  bool scoring() const { return pending_.has_value(); }

  /// The version of the weights the last batch was drawn with (-1 before the first).
  std::int64_t version() const { return version_; }
  std::int64_t batches() const { return batches_; }
  model_set<Model>& models() { return models_; }
  Reward& reward() { return reward_; }
  const worker_options& settings() const { return wo_; }
  /// The algorithm's figures of the last batch sampled (what `step_info::report` received, e.g.
  /// the rollout engine's `engine/steps`, or `sampler_logp_max_diff`); its tensor figures are read
  /// here, when asked, not while sampling.
  std::map<std::string, double> figures() const {
    auto out = figures_;
    for (const auto& [k, v] : tensor_figures_) out[k] = to_host(v).at(0);
    return out;
  }

  ~rollout_worker() { discard_pending(); }

 private:
  // One round of run_once: `input_of(version)` is the input of the weights fetched.
  template <class InputOf>
  bool run(InputOf&& input_of) {
    const bool sync = transport_->max_staleness() == 0;
    const std::int64_t v = transport_->fetch(weights_, version_, version_ < 0 ? 0 : version_ + (sync ? 1 : 0));
    if (v < 0) {
      discard_pending();
      return false;
    }
    version_ = v;
    if (wo_.seed_per_version) torch::manual_seed(detail::version_seed(seed_, stream_, version_));
    make_reference();
    std::map<std::string, double> extra;
    std::map<std::string, torch::Tensor> pending;
    // Asynchronous: the batch may be trained on by later weights, so the algorithm is told the
    // update is not on-policy (GRPO then keeps the behaviour log-probs, computed here).
    const std::int64_t updates = sync ? updates_ : 0;
    step_info info{version_, group_size_, device_, &extra, updates, &pending, logprob_chunk_};
    info.partial = partial_ ? &*partial_ : nullptr;
    const std::int64_t draws = partial_ ? partial_->draws() : 0;
    if (partial_) partial_->mark();
    versioned_batch<rollout_type> out;
    {
      torch::NoGradGuard no_grad;
      autocast_scope amp(device_, precision_);
      models_.policy.train(false);
      out.batch = algorithm_.sample(models_, input_of(version_), info);
      if (!overlapping()) out.rewards = reward_(out.batch);
    }
    figures_ = std::move(extra);
    tensor_figures_ = std::move(pending);
    out.policy_version = version_;
    if (partial_) {
      UNIRL_CHECK(partial_->draws() > draws, "rollout_worker: worker_options::partial_rollouts, but the algorithm's ",
                  "sampler did not draw through them (only token samplers on the rollout engine do: the GRPO family)");
      out.policy_version = partial_->oldest_since_mark();  // the batch's oldest token, over all its draws
    }
    ++batches_;
    if (!overlapping()) {
      check_rewards(out);
      return transport_->push(std::move(out));
    }
    if (!flush()) return false;  // batch k-1: scored while batch k was sampled
    pending_ = std::move(out);
    if constexpr (requires(Reward& r, const rollout_type& b) {
                    { r.submit(b) } -> std::same_as<std::future<torch::Tensor>>;
                  })
      scoring_ = reward_.submit(pending_->batch);  // e.g. rewards::remote_scorer: its own request threads
    else
      scoring_ = ::unirl::rewards::score_async(in_line_, pending_->batch);
    return true;
  }

  bool overlapping() const { return wo_.overlap_scoring && transport_->max_staleness() > 0; }

  void check_rewards(const versioned_batch<rollout_type>& out) const {
    UNIRL_CHECK(out.rewards.defined() && out.rewards.dim() == 1 && out.rewards.size(0) == out.batch.size(),
                "rollout_worker: reward returned ", out.rewards.defined() ? out.rewards.sizes() : c10::IntArrayRef{},
                "; expected (", out.batch.size(), ",), one score per sample");
  }

  // The learner has finished (or the worker goes away): the scores are not needed, but the reward
  // must not be running when the worker is destroyed; its error, if any, is moot.
  void discard_pending() noexcept {
    if (!pending_) return;
    try {
      if (scoring_.valid()) scoring_.wait();
    } catch (...) {
    }
    pending_.reset();
    scoring_ = {};
  }

  // The reward as `run_once` calls it in line, for a scoring thread: no autograd, the trainer's
  // precision (both are per thread in LibTorch).
  struct in_line_scorer {
    rollout_worker* w;
    torch::Tensor operator()(const rollout_type& b) const {
      torch::NoGradGuard no_grad;
      autocast_scope amp(w->device_, w->precision_);
      return w->reward_(b);
    }
  };

  // The reference is the learner's initial policy: copied once the first weights arrived.
  void make_reference() {
    if constexpr (algorithm_type::requires_reference) {
      bool use = true;
      if constexpr (requires(const algorithm_type& a) { { a.uses_reference() } -> std::convertible_to<bool>; })
        use = algorithm_.uses_reference();
      if (use && !models_.reference) {
        Model c = models_.policy.clone();
        for (auto& p : c.parameters()) p.set_requires_grad(false);
        c.train(false);
        models_.reference.emplace(std::move(c));
      }
    }
  }

  torch::Device device_;
  model_set<Model> models_;
  Reward reward_;
  algorithm_type algorithm_;
  Transport* transport_;
  std::int64_t group_size_, updates_, logprob_chunk_, seed_, stream_;
  ::unirl::precision precision_;
  worker_options wo_;
  std::vector<torch::Tensor> weights_;
  std::int64_t version_ = -1, batches_ = 0;
  in_line_scorer in_line_{this};
  std::optional<versioned_batch<rollout_type>> pending_;  // sampled, being scored (overlap_scoring)
  std::map<std::string, double> figures_;                  // the last sampling's reports
  std::map<std::string, torch::Tensor> tensor_figures_;    // ... of tensors, read by figures()
  std::future<torch::Tensor> scoring_;
  std::optional<::unirl::rollout::partial_rollouts> partial_;  // worker_options::partial_rollouts
};

/// The learning side: wraps a trainer and a transport; version `first_version` (0 unless
/// resumed) is the trainer's weights now, each `step` publishes the next. A learner resumed from
/// a checkpoint passes the trainer's step count, so that version v is always the weights after v
/// steps (what `worker_options::seed_per_version` keys the samplers' streams on):
///
/// ```cpp
/// if (auto last = run.latest()) t.load(last->path.string());
/// unirl::parallel::learner l{t, tr, t.step_count()};
/// ```
template <class Trainer, class Transport>
class learner {
 public:
  learner(Trainer& t, Transport& tr, std::int64_t first_version = 0) : t_(&t), tr_(&tr), version_(first_version) {
    static_assert(RolloutTransport<Transport, typename Trainer::rollout_type>,
                  "unirl::parallel::learner: Transport does not model RolloutTransport for the trainer's rollout batch");
    UNIRL_CHECK(first_version >= 0, "learner: first_version = ", first_version, ": expected >= 0");
    weights_ = policy_state(t_->models().policy);
    tr_->publish(weights_, version_);
  }

  /// Pops `parts` batches (synchronous: one per sampler; they are concatenated), learns from them
  /// with their staleness (the oldest part's), publishes the next version. nullopt when the
  /// samplers have stopped. The statistics carry `extra["staleness"]`, and with a transport that
  /// counts lost samplers (`c10d_transport`, `sampler_loss::carry_on`) `extra["samplers_lost"]`:
  /// after a loss a synchronous step learns from the batches of the live samplers (fewer parts).
  std::optional<step_stats> step(std::int64_t parts = 1) {
    UNIRL_CHECK(parts >= 1, "learner::step: parts = ", parts, ": expected >= 1");
    using R = typename Trainer::rollout_type;
    std::vector<versioned_batch<R>> got;
    for (std::int64_t i = 0; i < parts; ++i) {
      auto b = tr_->pop(version_);
      if (!b) {
        if (got.empty() || lost() == 0) return std::nullopt;
        break;  // a sampler was lost: the live ones delivered theirs
      }
      got.push_back(std::move(*b));
    }
    // In the samplers' order, whatever order they arrived in: the gathered batch is reproducible.
    std::stable_sort(got.begin(), got.end(), [](const auto& a, const auto& b) { return a.source < b.source; });
    std::vector<R> batches;
    std::vector<torch::Tensor> rewards;
    std::int64_t oldest = version_;
    for (auto& b : got) {
      oldest = std::min(oldest, b.policy_version);
      batches.push_back(std::move(b.batch));
      rewards.push_back(b.rewards);
    }
    R batch;
    if (batches.size() == 1) {
      batch = std::move(batches.front());
    } else {
      if constexpr (boost::hana::Struct<R>::value) batch = ::unirl::batch::concat(batches);
      else UNIRL_CHECK(false, "learner::step: parts = ", parts, ": gathering needs a reflected batch (core/batch.hpp)");
    }
    step_stats s = t_->learn(std::move(batch), torch::cat(rewards), version_ - oldest);
    if constexpr (requires(const Transport& x) { x.samplers_lost(); })
      s.extra["samplers_lost"] = static_cast<double>(tr_->samplers_lost());
    tr_->publish(weights_, ++version_);
    return s;
  }

  /// Stops the samplers (the transport's `finish`).
  void finish() {
    if constexpr (requires(Transport& x) { x.finish(); }) tr_->finish();
  }

  /// The version the trainer's weights have now.
  std::int64_t version() const { return version_; }

 private:
  std::int64_t lost() const {
    if constexpr (requires(const Transport& x) { x.samplers_lost(); }) return tr_->samplers_lost();
    else return 0;
  }

  Trainer* t_;
  Transport* tr_;
  std::vector<torch::Tensor> weights_;
  std::int64_t version_;
};

}  // namespace unirl::parallel
