#pragma once
/// \file flow.hpp
/// The flow track: image / video diffusion and flow-matching models. A `flow_rollout` holds
/// the whole denoising trajectory of every sample with the per-step Gaussian means, standard
/// deviations and log-probabilities the sampler drew it with, so a loss can replay any step.
///
/// ```cpp
/// unirl::rollout::flow_rollout b = unirl::rollout::sample_trajectory(sampler, model, labels, 10);
/// torch::Tensor images = b.samples();                 // (B, C, H, W): the final states
/// auto half = b.select(torch::arange(0, b.size() / 2)); // a minibatch
/// ```
#include <cstdint>

#include <torch/torch.h>

#include <unirl/concepts/rollout.hpp>
#include <unirl/core/error.hpp>

namespace unirl::rollout {

/// A batch of denoising trajectories. `K` is the number of sampler steps, `S...` the sample
/// shape ((C, H, W) for images, (F, C, H, W) for clips). Step `k` goes from
/// `trajectory[:, k]` at time `timesteps[:, k]` to `trajectory[:, k+1]` at `timesteps[:, k+1]`.
struct flow_rollout {
  torch::Tensor conditions;   // (B,) int64 class labels, or (B, D) float embeddings
  torch::Tensor trajectory;   // (B, K+1, S...) states; [:, 0] is the initial noise, [:, K] the sample
  torch::Tensor means;        // (B, K, S...) Gaussian mean of each step under the sampling policy
  torch::Tensor stds;         // (B, K) float64 std of each step; 0 = deterministic step (no log-prob)
  torch::Tensor log_probs;    // (B, K) float log pi_old(x_{k+1} | x_k); 0 on deterministic steps
  torch::Tensor timesteps;    // (B, K+1) float64: flow time 1 -> 0, or DDPM timestep indices
  torch::Tensor advantages{}; // (B,) filled by the algorithm's advantage stage
  torch::Tensor rewards{};    // (B,) filled by the algorithm's advantage stage (for the record)

  /// Number of samples B.
  std::int64_t size() const { return trajectory.defined() ? trajectory.size(0) : 0; }
  /// Number of sampler steps K.
  std::int64_t steps() const { return trajectory.defined() ? trajectory.size(1) - 1 : 0; }
  /// The final states (B, S...): the generated images or clips.
  torch::Tensor samples() const { return trajectory.select(1, trajectory.size(1) - 1); }

  /// The samples at `index` ((n,) int64), in order.
  flow_rollout select(const torch::Tensor& index) const {
    UNIRL_CHECK(index.dim() == 1, "flow_rollout::select: index must be 1-D, got sizes ", index.sizes());
    auto pick = [&](const torch::Tensor& t) {
      return t.defined() ? t.index_select(0, index.to(t.device(), torch::kInt64)) : t;
    };
    return {pick(conditions), pick(trajectory), pick(means),     pick(stds),
            pick(log_probs),  pick(timesteps),  pick(advantages), pick(rewards)};
  }
};
static_assert(RolloutBatch<flow_rollout>);

/// The flow track tag: a model adapter declares `using track = unirl::rollout::flow_track;`.
struct flow_track {
  using rollout_type = flow_rollout;
};

}  // namespace unirl::rollout
