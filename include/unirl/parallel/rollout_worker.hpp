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
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/concepts/reward.hpp>
#include <unirl/concepts/transport.hpp>
#include <unirl/core/batch.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/core/stats.hpp>

namespace unirl::parallel {

/// The tensors a transport carries for a model: its parameters, then its buffers, in order.
template <class M>
std::vector<torch::Tensor> policy_state(const M& m) {
  std::vector<torch::Tensor> out;
  for (auto& [n, t] : m.named_parameters()) out.push_back(t);
  for (auto& [n, t] : m.named_buffers()) out.push_back(t);
  return out;
}

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
  rollout_worker(Model model, Reward reward, const TrainerOptions& opts, Transport& transport, std::int64_t stream = 0)
      : device_(opts.device), models_{std::move(model)}, reward_(std::move(reward)), algorithm_(opts.algorithm),
        transport_(&transport), group_size_(opts.group_size), updates_(opts.epochs * opts.minibatches),
        logprob_chunk_(opts.memory.logprob_chunk), precision_(opts.precision) {
    ::unirl::options::validate(opts);
    UNIRL_CHECK(stream >= 0, "rollout_worker: stream = ", stream, ": expected >= 0");
    torch::manual_seed(static_cast<std::uint64_t>(opts.seed + stream));
    models_.policy.to(device_);
    weights_ = policy_state(models_.policy);
  }

  /// Fetches newer weights (synchronous: waits for the version after the last one used), samples
  /// one batch from `input`, scores it and pushes it. False when the learner has finished.
  template <class Input>
    requires SamplesFrom<Sampler, Model, std::remove_reference_t<Input>>
  bool run_once(Input&& input) {
    const bool sync = transport_->max_staleness() == 0;
    const std::int64_t v = transport_->fetch(weights_, version_, version_ < 0 ? 0 : version_ + (sync ? 1 : 0));
    if (v < 0) return false;
    version_ = v;
    make_reference();
    std::map<std::string, double> extra;
    std::map<std::string, torch::Tensor> pending;
    // Asynchronous: the batch may be trained on by later weights, so the algorithm is told the
    // update is not on-policy (GRPO then keeps the behaviour log-probs, computed here).
    const std::int64_t updates = sync ? updates_ : 0;
    const step_info info{version_, group_size_, device_, &extra, updates, &pending, logprob_chunk_};
    versioned_batch<rollout_type> out;
    {
      torch::NoGradGuard no_grad;
      autocast_scope amp(device_, precision_);
      models_.policy.train(false);
      out.batch = algorithm_.sample(models_, input, info);
      out.rewards = reward_(out.batch);
    }
    UNIRL_CHECK(out.rewards.defined() && out.rewards.dim() == 1 && out.rewards.size(0) == out.batch.size(),
                "rollout_worker: reward returned ", out.rewards.defined() ? out.rewards.sizes() : c10::IntArrayRef{},
                "; expected (", out.batch.size(), ",), one score per sample");
    out.policy_version = version_;
    ++batches_;
    return transport_->push(std::move(out));
  }

  /// The version of the weights the last batch was drawn with (-1 before the first).
  std::int64_t version() const { return version_; }
  std::int64_t batches() const { return batches_; }
  model_set<Model>& models() { return models_; }
  Reward& reward() { return reward_; }

 private:
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
  std::int64_t group_size_, updates_, logprob_chunk_;
  ::unirl::precision precision_;
  std::vector<torch::Tensor> weights_;
  std::int64_t version_ = -1, batches_ = 0;
};

/// The learning side: wraps a trainer and a transport; version 0 is the trainer's initial
/// weights, each `step` publishes the next.
template <class Trainer, class Transport>
class learner {
 public:
  learner(Trainer& t, Transport& tr) : t_(&t), tr_(&tr) {
    static_assert(RolloutTransport<Transport, typename Trainer::rollout_type>,
                  "unirl::parallel::learner: Transport does not model RolloutTransport for the trainer's rollout batch");
    weights_ = policy_state(t_->models().policy);
    tr_->publish(weights_, version_);
  }

  /// Pops `parts` batches (synchronous: one per sampler; they are concatenated), learns from them
  /// with their staleness (the oldest part's), publishes the next version. nullopt when the
  /// samplers have stopped. The statistics carry `extra["staleness"]`.
  std::optional<step_stats> step(std::int64_t parts = 1) {
    UNIRL_CHECK(parts >= 1, "learner::step: parts = ", parts, ": expected >= 1");
    using R = typename Trainer::rollout_type;
    std::vector<versioned_batch<R>> got;
    for (std::int64_t i = 0; i < parts; ++i) {
      auto b = tr_->pop(version_);
      if (!b) return std::nullopt;
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
  Trainer* t_;
  Transport* tr_;
  std::vector<torch::Tensor> weights_;
  std::int64_t version_ = 0;
};

}  // namespace unirl::parallel
