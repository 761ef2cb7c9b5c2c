#pragma once
/// \file rollout.hpp
/// Rollout batches: the plain structs of tensors that flow from the sample stage to the loss.
#include <concepts>
#include <cstdint>

#include <torch/torch.h>

namespace unirl {

/// A rollout batch the trainer can split into minibatches.
///
/// Minimal complete definition:
/// - `std::int64_t size() const` — number of samples (sequences, images, transitions);
/// - `B select(const torch::Tensor& index) const` — the samples at `index` ((n,) int64), in order.
///   The trainer passes its minibatch indices on the batch's device, or on the host to a batch
///   adapted with `BOOST_HANA_ADAPT_STRUCT` (whose `batch::select` takes an index on any device
///   and so needs no device round trip).
template <class B>
concept RolloutBatch = std::copy_constructible<B> && requires(const B& b, const torch::Tensor& idx) {
  { b.size() } -> std::convertible_to<std::int64_t>;
  { b.select(idx) } -> std::same_as<B>;
};

}  // namespace unirl
