#pragma once
/// \file colocated.hpp
/// The rollout transport of one process: the learner and its samplers share memory; published
/// weights are copied once, batches wait in a queue. With `max_staleness = 0` and one
/// `rollout_worker` run between learner steps it is today's loop, `trainer::step`, split in two.
///
/// ```cpp
/// unirl::parallel::colocated_transport<bandit::rollout> tr;           // synchronous
/// unirl::parallel::rollout_worker<my_model, my_algo, my_reward, decltype(tr)> w{model, reward, opts, tr};
/// unirl::parallel::learner l{t, tr};
/// for (...) { w.run_once(prompts); l.step(); }
/// ```
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/transport.hpp>
#include <unirl/core/error.hpp>

namespace unirl::parallel {

/// Settings of `colocated_transport`.
struct colocated_options {
  std::int64_t max_staleness = 0;  // versions a popped batch may be behind; 0: synchronous
};

/// In-process `RolloutTransport` (see the file comment).
template <class Batch>
class colocated_transport {
 public:
  explicit colocated_transport(colocated_options o = {}) : o_(o) {
    UNIRL_CHECK(o_.max_staleness >= 0, "colocated_transport: max_staleness = ", o_.max_staleness, ": expected >= 0");
  }

  std::int64_t max_staleness() const { return o_.max_staleness; }

  void publish(const std::vector<torch::Tensor>& weights, std::int64_t version) {
    UNIRL_CHECK(version > version_, "colocated_transport::publish: version ", version, " after ", version_,
                ": expected increasing versions");
    torch::NoGradGuard no_grad;
    weights_.clear();
    for (const auto& w : weights) weights_.push_back(w.detach().clone());
    version_ = version;
  }

  /// One process cannot wait for a version nobody publishes: asking for one that is not there is
  /// an error (the caller's loop order is wrong).
  std::int64_t fetch(const std::vector<torch::Tensor>& weights, std::int64_t have, std::int64_t wait_for) {
    if (finished_) return -1;
    UNIRL_CHECK(version_ >= wait_for, "colocated_transport::fetch: version ", wait_for, " asked for, ", version_,
                " published: in one process the learner must publish before the sampler waits for it");
    if (version_ > have) {
      UNIRL_CHECK(weights.size() == weights_.size(), "colocated_transport::fetch: ", weights.size(),
                  " tensors given, ", weights_.size(), " published: expected the policy's parameters and buffers");
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < weights.size(); ++i) weights[i].detach().copy_(weights_[i]);
    }
    return version_;
  }

  bool push(versioned_batch<Batch> b) {
    if (finished_) return false;
    queue_.push_back(std::move(b));
    return true;
  }

  std::optional<versioned_batch<Batch>> pop(std::int64_t current) {
    while (!queue_.empty()) {
      auto b = std::move(queue_.front());
      queue_.pop_front();
      if (b.policy_version >= current - o_.max_staleness) return b;
      ++dropped_;
    }
    return std::nullopt;
  }

  /// The learner is done: samplers' next fetch returns -1, their next push false.
  void finish() { finished_ = true; }
  /// Batches `pop` dropped as older than `max_staleness` versions.
  std::int64_t dropped() const { return dropped_; }
  /// The number of samplers a synchronous learner step waits for (one process: those it runs).
  int samplers() const { return 1; }

 private:
  colocated_options o_;
  std::vector<torch::Tensor> weights_;
  std::int64_t version_ = -1;
  std::deque<versioned_batch<Batch>> queue_;
  std::int64_t dropped_ = 0;
  bool finished_ = false;
};

}  // namespace unirl::parallel
