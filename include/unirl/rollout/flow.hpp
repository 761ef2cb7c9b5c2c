#pragma once
/// \file flow.hpp
/// The flow track: image / video diffusion and flow-matching models. A `flow_rollout` holds
/// the whole denoising trajectory of every sample with the per-step Gaussian means, standard
/// deviations and log-probabilities the sampler drew it with, so a loss can replay any step.
/// Its tensors keep the sampler's floating type (float64 states give float64 means, log-probs).
///
/// ```cpp
/// unirl::flow_rollout b = unirl::sample_trajectory(sampler, model, labels);
/// torch::Tensor images = b.samples();                 // (B, C, H, W): the final states
/// auto half = b.select(torch::arange(0, b.size() / 2)); // a minibatch
/// ```
#include <cstdint>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/rollout.hpp>
#include <unirl/concepts/track.hpp>
#include <unirl/core/batch.hpp>
#include <unirl/core/error.hpp>

namespace unirl {

/// A batch of denoising trajectories. `K` is the number of sampler steps, `S...` the sample
/// shape ((C, H, W) for images, (F, C, H, W) for clips). Step `k` goes from
/// `trajectory[:, k]` at time `timesteps[:, k]` to `trajectory[:, k+1]` at `timesteps[:, k+1]`.
/// Its members are reflected (core/batch.hpp), every one per sample: a new field is one line
/// here and one name in the `BOOST_HANA_ADAPT_STRUCT` below (`batch::concat`, `batch::to` apply).
struct flow_rollout {
  torch::Tensor conditions;   // (B,) int64 class labels, or (B, D) float embeddings
  torch::Tensor trajectory;   // (B, K+1, S...) states; [:, 0] is the initial noise, [:, K] the sample
  torch::Tensor means;        // (B, K, S...) Gaussian mean of each step under the sampling policy
  torch::Tensor stds;         // (B, K) float64 std of each step; 0 = deterministic step (no log-prob)
  torch::Tensor log_probs;    // (B, K) log pi_old(x_{k+1} | x_k), the states' dtype; 0 on deterministic steps
  torch::Tensor timesteps;    // (B, K+1) float64: flow time 1 -> 0, or DDPM timestep indices
  torch::Tensor advantages{}; // (B,) filled by the algorithm's advantage stage
  torch::Tensor rewards{};    // (B,) filled by the algorithm's advantage stage (for the record)

  /// Number of samples B.
  std::int64_t size() const { return trajectory.defined() ? trajectory.size(0) : 0; }
  /// Number of sampler steps K.
  std::int64_t steps() const { return trajectory.defined() ? trajectory.size(1) - 1 : 0; }
  /// The final states (B, S...): the generated images or clips.
  torch::Tensor samples() const { return trajectory.select(1, trajectory.size(1) - 1); }

  /// The samples at `index` ((n,) int64), in order (`batch::select`: every member is per sample).
  flow_rollout select(const torch::Tensor& index) const;
};

}  // namespace unirl

BOOST_HANA_ADAPT_STRUCT(unirl::flow_rollout, conditions, trajectory, means, stds, log_probs, timesteps,
                        advantages, rewards);

namespace unirl {

inline flow_rollout flow_rollout::select(const torch::Tensor& index) const { return batch::select(*this, index); }

static_assert(RolloutBatch<flow_rollout>);

}  // namespace unirl
