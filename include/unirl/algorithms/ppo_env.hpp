#pragma once
/// \file ppo_env.hpp
/// PPO on the env track (CleanRL's `ppo.py` / `ppo_continuous_action.py`): `ppo_track<env_track>`
/// collects `rollout_steps` steps of every copy of a vectorised environment, computes GAE over
/// the (T, N) layout with the model's own value head, and evaluates minibatches of transitions
/// for the loss that `ppo` shares with every other track. Its own options (`ppo_env_options`:
/// `rollout_steps`) sit under `.algorithm.track`.
///
/// The algorithm names no concrete model or environment (concepts/env_policy.hpp and
/// concepts/vector_environment.hpp say what it needs); a program includes the ones it uses:
/// ```cpp
/// #include <unirl/algorithms/ppo_env.hpp>
/// #include <unirl/envs/cartpole.hpp>
/// #include <unirl/envs/vector_env.hpp>
/// #include <unirl/models/actor_critic.hpp>
/// #include <unirl/rewards/environment.hpp>
/// #include <unirl/trainer.hpp>
/// using cartpole_trainer = unirl::trainer<unirl::models::categorical_actor_critic, unirl::algo::ppo<>,
///                                         unirl::rewards::environment_reward>;
/// unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
/// cartpole_trainer t{unirl::models::categorical_actor_critic(4, 2), {},
///                    {.algorithm = {.track = {.rollout_steps = 128}}, .optim = {.lr = 2.5e-4, .eps = 1e-5},
///                     .epochs = 4, .minibatches = 4}};
/// auto stats = t.step(venv);   // one CleanRL iteration: 512 transitions, 16 optimizer steps
/// ```
#include <cstdint>
#include <string>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/algorithms/kl.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/concepts/env_policy.hpp>
#include <unirl/concepts/track.hpp>
#include <unirl/concepts/vector_environment.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rollout/env.hpp>

namespace unirl::algo {

/// The env track's own options of `ppo` (`.algorithm = {.track = {.rollout_steps = 128}}`).
struct ppo_env_options {
  std::int64_t rollout_steps = 128;  // steps per environment per rollout

  void validate(const std::string& prefix) const {
    options::require(rollout_steps >= 1, prefix + "rollout_steps", rollout_steps, ">= 1");
  }
};

}  // namespace unirl::algo

BOOST_HANA_ADAPT_STRUCT(unirl::algo::ppo_env_options, rollout_steps);

namespace unirl::algo {

/// The env track's part of PPO. The model must be an `EnvPolicy` (its value head is the critic).
template <>
struct ppo_track<env_track> {
  using options = ppo_env_options;
  using settings = basic_ppo_options<options>;

  /// Steps `env` for `o.track.rollout_steps` steps with the policy (no gradients) and reports the
  /// episodes that finished (`episode_return`, `episode_length`, `episodes`, `env_steps`).
  /// The model must model `EnvPolicy` (act, evaluate, value), the input `VectorEnvironment` (e.g.
  /// `envs::vector_env<envs::cartpole>`): `SamplesFrom` says so.
  template <ExecutionPolicy Exec, EnvPolicy M, VectorEnvironment Input>
  static env_rollout sample(const settings& o, model_set<M>& models, Input& env, const step_info& info) {
    return collect(models.policy, env, o.track.rollout_steps, &info);
  }

  /// GAE over the (T, N) layout (docs/algorithms/ppo.md); stores advantages and returns in the batch,
  /// in the values' dtype.
  /// With a reference model and `kl_in_reward`, `kl_coef * KL(pi_old || pi_ref)` per step is
  /// subtracted from the rewards first.
  template <ExecutionPolicy Exec, EnvPolicy M>
  static torch::Tensor advantage(const settings& o, model_set<M>& models, env_rollout& batch,
                                 const torch::Tensor& rewards, const step_info& info) {
    UNIRL_CHECK(batch.num_steps > 0 && batch.num_envs > 0 && batch.next_value.defined(),
                "ppo on the env track: advantage() needs a whole rollout with its (T, N) layout, got ",
                batch.num_steps, " x ", batch.num_envs);
    const auto T = batch.num_steps, N = batch.num_envs;
    UNIRL_CHECK(rewards.numel() == T * N, "ppo on the env track: ", rewards.numel(), " rewards for a rollout of ",
                T, " x ", N, " = ", T * N, " steps");
    // In the values' floating type (the model's: a float64 policy gives float64 advantages).
    const auto dtype = batch.values.is_floating_point() ? batch.values.scalar_type() : torch::kFloat;
    auto r = rewards.to(batch.values.device(), dtype).reshape({T, N});
    if (models.reference && o.kl_in_reward && o.kl_coef > 0.0) {
      const torch::Tensor ref = models.reference->evaluate(batch.obs, batch.actions).logp;
      const torch::Tensor kl = kl_penalty<Exec>(batch.logprobs, ref, o.kl).reshape({T, N});
      info.report("kl_reward", kl.mean());
      r = r - o.kl_coef * kl;
    }
    const auto g = gae<Exec>(r, batch.values.view({T, N}), batch.dones.view({T, N}), batch.next_value, batch.next_done,
                       o.gamma, o.lambda);
    batch.advantages = g.advantages.reshape({T * N});
    batch.returns = g.returns.reshape({T * N});
    return batch.advantages;
  }

  /// Re-evaluates a minibatch of transitions: log-probs, entropy and values under the current
  /// weights, with the stored log-probs, values, advantages and returns.
  template <ExecutionPolicy Exec, EnvPolicy M>
  static ppo_eval evaluate(const settings& o, model_set<M>& models, const env_rollout& mb, const step_info&) {
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

static_assert(Algorithm<ppo<>::for_track<env_track>>);
static_assert(ppo<>::for_track<env_track>::supports_track<env_track>);
// That ppo<> trains the built-in actor-critics on vector_env<cartpole> / <pendulum> is asserted
// where those are included (tests/unit/env), not here: an algorithm names no concrete model.

}  // namespace unirl::algo
