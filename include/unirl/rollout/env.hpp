#pragma once
/// \file env.hpp
/// The environment (agent) track: `env_track`, its rollout batch `env_rollout`, and `collect`,
/// which steps a vectorised environment with a policy for T steps as CleanRL's `ppo.py` does.
///
/// A rollout holds T steps of N environment copies in (T, N) order, flattened to T*N rows
/// (row t*N + n is copy n at step t), so minibatches index rows as CleanRL's `b_obs[mb_inds]`:
/// ```cpp
/// unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4});
/// unirl::models::categorical_actor_critic policy(4, 2);
/// unirl::env_rollout r = unirl::collect(policy, venv, 128);   // r.size() == 512
/// auto rewards = r.rewards.view({r.num_steps, r.num_envs});     // (T, N)
/// auto mb = r.select(torch::randperm(512).slice(0, 0, 128));   // a minibatch of 128 rows
/// ```
#include <concepts>
#include <cstdint>
#include <limits>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/env_policy.hpp>
#include <unirl/concepts/rollout.hpp>
#include <unirl/concepts/track.hpp>
#include <unirl/concepts/vector_environment.hpp>
#include <unirl/core/batch.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>

namespace unirl {

/// A rollout of a policy in N environment copies; every per-row tensor has T*N rows.
/// Its members are reflected (core/batch.hpp): a new per-row field is one line here and one name
/// in the `BOOST_HANA_ADAPT_STRUCT` below; what describes the whole (T, N) rollout is named in
/// `layout_fields` and dropped by `select` / `batch::concat`.
struct env_rollout {
  torch::Tensor obs;         // (T*N, D) float: observation the action was taken in
  torch::Tensor actions;     // (T*N,) int64 (discrete) | (T*N, A) float (continuous, unclipped sample)
  torch::Tensor logprobs;    // (T*N,) the policy's float type: log pi_old(action | obs)
  torch::Tensor rewards;     // (T*N,) float: reward of that step (normalised when the runner does)
  torch::Tensor dones;       // (T*N,) float: 1 when obs is the first of an episode after a done
  torch::Tensor values;      // (T*N,) the policy's float type: V_old(obs)
  torch::Tensor advantages;  // (T*N,) the values' type: filled by the advantage stage (GAE)
  torch::Tensor returns;     // (T*N,) the values' type: advantages + values
  torch::Tensor next_value;  // (N,) the values' type: V(obs_T), bootstraps GAE; undefined in a minibatch
  torch::Tensor next_done;   // (N,) float: done flag of obs_T; undefined in a minibatch
  std::int64_t num_steps = 0;  // T; 0 for a minibatch (rows no longer form a (T, N) grid)
  std::int64_t num_envs = 0;   // N; 0 for a minibatch

  /// Not per row: the (T, N) grid and the bootstrap values of the whole rollout.
  using layout_fields = batch::fields<"next_value", "next_done", "num_steps", "num_envs">;

  std::int64_t size() const { return obs.defined() ? obs.size(0) : 0; }

  /// The rows at `index` ((n,) int64), in order; the (T, N) layout and bootstrap values are dropped.
  env_rollout select(const torch::Tensor& index) const;
};

}  // namespace unirl

BOOST_HANA_ADAPT_STRUCT(unirl::env_rollout, obs, actions, logprobs, rewards, dones, values, advantages, returns,
                        next_value, next_done, num_steps, num_envs);

namespace unirl {

inline env_rollout env_rollout::select(const torch::Tensor& index) const { return batch::select(*this, index); }

static_assert(RolloutBatch<env_rollout>);

/// Steps `env` with `policy` for `num_steps` steps (CleanRL's rollout phase, without gradients)
/// and bootstraps the value of the last observation. When `info` is given, the episodes that
/// finished during the rollout are reported as `episode_return`, `episode_length` (means) and
/// `episodes` (count), and the runner's total as `env_steps`.
template <EnvPolicy P, VectorEnvironment V>
env_rollout collect(const P& policy, V& env, std::int64_t num_steps, const step_info* info = nullptr) {
  UNIRL_CHECK(num_steps >= 1, "collect: num_steps = ", num_steps, ": expected >= 1");
  torch::NoGradGuard no_grad;
  const std::int64_t n = env.num_envs();
  const std::size_t episodes_before = env.episodes().size();
  torch::Tensor obs = env.observations(), done = env.dones();
  env_rollout r;
  r.num_steps = num_steps;
  r.num_envs = n;
  for (std::int64_t t = 0; t < num_steps; ++t) {
    env_action a = policy.act(obs);
    if (t == 0) {
      const auto dev = a.logp.device();
      const auto fopt = torch::TensorOptions().dtype(torch::kFloat).device(dev);
      std::vector<std::int64_t> act_shape{num_steps * n};
      for (std::int64_t d = 1; d < a.action.dim(); ++d) act_shape.push_back(a.action.size(d));
      r.obs = torch::empty({num_steps * n, obs.size(1)}, fopt);
      r.actions = torch::empty(act_shape, a.action.options());
      // The policy's log-probs and values keep its floating type (float64 policy: float64 rollout).
      auto float_of = [](const torch::Tensor& x) { return x.is_floating_point() ? x.scalar_type() : torch::kFloat; };
      r.logprobs = torch::empty({num_steps * n}, fopt.dtype(float_of(a.logp)));
      r.values = torch::empty({num_steps * n}, fopt.dtype(float_of(a.value)));
      r.rewards = torch::empty({num_steps * n}, fopt);
      r.dones = torch::empty({num_steps * n}, fopt);
    }
    UNIRL_CHECK(a.action.size(0) == n && a.logp.numel() == n && a.value.numel() == n, "collect: the policy acted on ",
                n, " observations but returned ", a.action.size(0), " actions, ", a.logp.numel(), " log-probs and ",
                a.value.numel(), " values");
    r.obs.narrow(0, t * n, n).copy_(obs);
    r.dones.narrow(0, t * n, n).copy_(done);
    r.actions.narrow(0, t * n, n).copy_(a.action);
    r.logprobs.narrow(0, t * n, n).copy_(a.logp.reshape({n}));
    r.values.narrow(0, t * n, n).copy_(a.value.reshape({n}));
    auto out = env.step(a.action);
    r.rewards.narrow(0, t * n, n).copy_(out.rewards);
    obs = env.observations();
    done = out.dones;
  }
  r.next_value = policy.value(obs).reshape({n}).to(r.values.scalar_type());
  r.next_done = done.to(r.values.device(), torch::kFloat);
  if (info) {
    const auto& eps = env.episodes();
    const std::size_t k = eps.size() - episodes_before;
    info->report("env_steps", static_cast<double>(env.env_steps()));
    info->report("episodes", static_cast<double>(k));
    if (k > 0) {
      double ret = 0, len = 0;
      for (std::size_t i = episodes_before; i < eps.size(); ++i) {
        ret += eps[i].episode_return;
        len += static_cast<double>(eps[i].length);
      }
      info->report("episode_return", ret / static_cast<double>(k));
      info->report("episode_length", len / static_cast<double>(k));
    }
  }
  return r;
}

}  // namespace unirl
