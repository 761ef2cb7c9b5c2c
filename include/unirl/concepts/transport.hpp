#pragma once
/// \file transport.hpp
/// The rollout transport between the learner and its samplers (docs/parallel.md, "Learner /
/// sampler split"): weights go one way with a version, scored batches come back with the version
/// that drew them.
///
/// ```cpp
/// unirl::parallel::colocated_transport<unirl::token_rollout> tr{{.max_staleness = 1}};
/// static_assert(unirl::RolloutTransport<decltype(tr), unirl::token_rollout>);
/// tr.publish(weights, 0);                              // learner
/// std::int64_t v = tr.fetch(my_weights, -1, 0);        // sampler: copies version 0 in
/// tr.push({batch, rewards, v});                        // sampler
/// auto got = tr.pop(0);                                // learner: a batch no older than 0 - max_staleness
/// ```
#include <concepts>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace unirl {

/// A scored rollout batch as it travels from a sampler to the learner: the batch keeps the
/// behaviour log-probs the sampler computed, `policy_version` names the weights that drew it.
template <class Batch>
struct versioned_batch {
  Batch batch{};
  torch::Tensor rewards{};          // (B,) floating: the sampler's reward of each sample
  std::int64_t policy_version = 0;  // the version of the weights that drew the batch
  int source = 0;                   // who pushed it (the sampler's rank; 0 in one process)
};

/// A rollout transport for batches of type `Batch`.
///
/// Minimal complete definition:
/// - `std::int64_t max_staleness() const` — how many versions a popped batch may be behind
///   (0: synchronous);
/// - `void publish(const std::vector<torch::Tensor>& weights, std::int64_t version)` — the
///   learner's weights (parameters then buffers of the policy), versions increasing;
/// - `std::int64_t fetch(const std::vector<torch::Tensor>& weights, std::int64_t have,
///   std::int64_t wait_for)` — a sampler: waits until a version >= `wait_for` is published,
///   copies the newest into `weights` when it is newer than `have`, returns the version held;
///   -1 when the learner has finished (the sampler stops);
/// - `bool push(versioned_batch<Batch> b)` — a sampler: false when the learner has finished
///   (the batch is discarded and the sampler stops);
/// - `std::optional<versioned_batch<Batch>> pop(std::int64_t current)` — the learner: the next
///   batch drawn with a version >= `current - max_staleness()` (older ones are dropped and
///   counted); nullopt when no sampler can send one.
template <class T, class Batch>
concept RolloutTransport = requires(T& t, const T& ct, const std::vector<torch::Tensor>& w, std::int64_t v,
                                    versioned_batch<Batch> b) {
  { ct.max_staleness() } -> std::convertible_to<std::int64_t>;
  t.publish(w, v);
  { t.fetch(w, v, v) } -> std::same_as<std::int64_t>;
  { t.push(std::move(b)) } -> std::same_as<bool>;
  { t.pop(v) } -> std::same_as<std::optional<versioned_batch<Batch>>>;
};

}  // namespace unirl
