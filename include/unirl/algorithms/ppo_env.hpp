#pragma once
/// \file ppo_env.hpp
/// PPO on the env track (CleanRL's `ppo.py` / `ppo_continuous_action.py`): `ppo_track<env_track>`
/// collects `rollout_steps` steps of every copy of a vectorised environment, computes GAE over
/// the (T, N) layout with the model's own value head, and evaluates minibatches of transitions
/// for the loss that `ppo` shares with every other track.
///
/// ```cpp
/// #include <unirl/algorithms/ppo_env.hpp>
/// using cartpole_trainer = unirl::trainer<unirl::models::categorical_actor_critic, unirl::algo::ppo<>,
///                                         unirl::rewards::environment_reward>;
/// unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
/// cartpole_trainer t{unirl::models::categorical_actor_critic(4, 2), {},
///                    {.algorithm = {.rollout_steps = 128}, .optim = {.lr = 2.5e-4, .eps = 1e-5},
///                     .epochs = 4, .minibatches = 4}};
/// auto stats = t.step(venv);   // one CleanRL iteration: 512 transitions, 16 optimizer steps
/// ```
#include <cstdint>

#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/algorithms/kl.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/envs/cartpole.hpp>
#include <unirl/envs/pendulum.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/rollout/env.hpp>

namespace unirl::algo {

/// The env track's part of PPO. The model must be an `EnvPolicy` (its value head is the critic).
template <>
struct ppo_track<env_track> {
  /// Steps `env` for `o.rollout_steps` steps with the policy (no gradients) and reports the
  /// episodes that finished (`episode_return`, `episode_length`, `episodes`, `env_steps`).
  template <class M, class Input>
  static env_rollout sample(const ppo_options& o, model_set<M>& models, Input& env, const step_info& info) {
    static_assert(EnvPolicy<M>, "ppo on the env track: the model must model unirl::EnvPolicy (act, evaluate, value)");
    static_assert(VectorEnvironment<Input>,
                  "ppo on the env track: step() takes a vectorised environment (unirl::VectorEnvironment), "
                  "e.g. unirl::envs::vector_env<unirl::envs::cartpole>");
    return collect(models.policy, env, o.rollout_steps, &info);
  }

  /// GAE over the (T, N) layout (ALGORITHMS.md §1); stores advantages and returns in the batch.
  /// With a reference model and `kl_in_reward`, `kl_coef * KL(pi_old || pi_ref)` per step is
  /// subtracted from the rewards first.
  template <class M>
  static torch::Tensor advantage(const ppo_options& o, model_set<M>& models, env_rollout& batch,
                                 const torch::Tensor& rewards, const step_info& info) {
    UNIRL_CHECK(batch.num_steps > 0 && batch.num_envs > 0 && batch.next_value.defined(),
                "ppo on the env track: advantage() needs a whole rollout with its (T, N) layout, got ",
                batch.num_steps, " x ", batch.num_envs);
    const auto T = batch.num_steps, N = batch.num_envs;
    UNIRL_CHECK(rewards.numel() == T * N, "ppo on the env track: ", rewards.numel(), " rewards for a rollout of ",
                T, " x ", N, " = ", T * N, " steps");
    auto r = rewards.to(batch.values.device(), torch::kFloat).reshape({T, N});
    if (models.reference && o.kl_in_reward && o.kl_coef > 0.0) {
      const torch::Tensor ref = models.reference->evaluate(batch.obs, batch.actions).logp;
      const torch::Tensor kl = kl_penalty(batch.logprobs, ref, o.kl).reshape({T, N});
      info.report("kl_reward", kl.mean().item<double>());
      r = r - o.kl_coef * kl;
    }
    const auto g = gae(r, batch.values.view({T, N}), batch.dones.view({T, N}), batch.next_value, batch.next_done,
                       o.gamma, o.lambda);
    batch.advantages = g.advantages.reshape({T * N}).to(torch::kFloat);
    batch.returns = g.returns.reshape({T * N}).to(torch::kFloat);
    return batch.advantages;
  }

  /// Re-evaluates a minibatch of transitions: log-probs, entropy and values under the current
  /// weights, with the stored log-probs, values, advantages and returns.
  template <class M>
  static ppo_eval evaluate(const ppo_options& o, model_set<M>& models, const env_rollout& mb, const step_info&) {
    UNIRL_CHECK(mb.advantages.defined() && mb.returns.defined(),
                "ppo on the env track: the minibatch has no advantages; run advantage() first");
    const env_evaluation e = models.policy.evaluate(mb.obs, mb.actions);
    ppo_eval ev;
    ev.logp = e.logp;
    ev.old_logp = mb.logprobs;
    ev.advantages = mb.advantages;
    ev.mask = torch::ones_like(e.logp);
    ev.values = e.value;
    ev.old_values = mb.values;
    ev.returns = mb.returns;
    ev.entropy = e.entropy;
    if (models.reference && o.kl_coef > 0.0) {
      torch::NoGradGuard ng;
      ev.ref_logp = models.reference->evaluate(mb.obs, mb.actions).logp;
    }
    return ev;
  }
};

static_assert(ppo<>::supports_track<env_track>);
static_assert(AlgorithmFor<ppo<>, models::categorical_actor_critic>);
static_assert(AlgorithmFor<ppo<>, models::gaussian_actor_critic>);
static_assert(SamplesFrom<ppo<>, models::categorical_actor_critic, envs::vector_env<envs::cartpole>>);
static_assert(SamplesFrom<ppo<>, models::gaussian_actor_critic, envs::vector_env<envs::pendulum>>);

}  // namespace unirl::algo
