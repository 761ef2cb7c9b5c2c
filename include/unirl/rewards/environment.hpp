#pragma once
/// \file environment.hpp
/// The reward slot of the env track: the environment already scored every step, so the reward
/// is the rollout's collected rewards, one per (step, copy) row.
///
/// ```cpp
/// unirl::trainer<unirl::models::categorical_actor_critic, unirl::algo::ppo<>,
///                unirl::rewards::environment_reward> t{policy, {}, opts};
/// ```
#include <torch/torch.h>

#include <unirl/concepts/reward.hpp>
#include <unirl/core/error.hpp>
#include <unirl/rollout/env.hpp>

namespace unirl::rewards {

/// Returns `batch.rewards` ((T*N,) float), the environment's own rewards.
struct environment_reward {
  torch::Tensor operator()(const env_rollout& batch) const {
    UNIRL_CHECK(batch.rewards.defined() && batch.rewards.dim() == 1 && batch.rewards.size(0) == batch.size(),
                "environment_reward: the rollout's rewards have shape ",
                batch.rewards.defined() ? batch.rewards.sizes() : torch::IntArrayRef{}, ": expected (", batch.size(),
                ",)");
    return batch.rewards.to(torch::kFloat);
  }
};
static_assert(RewardFor<environment_reward, env_rollout>);

}  // namespace unirl::rewards
