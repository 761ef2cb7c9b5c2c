#pragma once
/// \file env_policy.hpp
/// Policies of the env track: what `collect` and PPO need from an agent with a value head, and
/// the two small structs its calls return.
///
/// ```cpp
/// static_assert(unirl::EnvPolicy<unirl::models::categorical_actor_critic>);
/// unirl::env_action a = policy.act(obs);                 // obs (B, D) float
/// unirl::env_evaluation e = policy.evaluate(obs, a.action);
/// ```
#include <concepts>

#include <torch/torch.h>

namespace unirl {

/// What a policy returns when it acts: sampled actions with their log-probabilities and values.
struct env_action {
  torch::Tensor action;  // (B,) int64 | (B, A) float
  torch::Tensor logp;    // (B,)
  torch::Tensor value;   // (B,)
};

/// What a policy returns when it re-evaluates stored actions (differentiable).
struct env_evaluation {
  torch::Tensor logp;     // (B,)
  torch::Tensor entropy;  // (B,)
  torch::Tensor value;    // (B,)
};

/// A policy with a value head for the env track.
///
/// Minimal complete definition: `env_action act(const torch::Tensor& obs)` (sample),
/// `env_evaluation evaluate(const torch::Tensor& obs, const torch::Tensor& actions)` and
/// `torch::Tensor value(const torch::Tensor& obs)`, for obs (B, D) float.
template <class P>
concept EnvPolicy = requires(const P& p, const torch::Tensor& t) {
  { p.act(t) } -> std::same_as<env_action>;
  { p.evaluate(t, t) } -> std::same_as<env_evaluation>;
  { p.value(t) } -> std::same_as<torch::Tensor>;
};

}  // namespace unirl
