#pragma once
/// \file env.hpp
/// Everything the agent (env) track needs, with the trainer: PPO on the env track, CartPole and
/// Pendulum, the episodic-environment base, the vector runner, the categorical and Gaussian
/// actor-critics, the environment's own reward and the rollout batch.
///
/// ```cpp
/// #include <unirl/env.hpp>
/// using trainer_t = unirl::trainer<unirl::models::categorical_actor_critic, unirl::algo::ppo<>,
///                                  unirl::rewards::environment_reward>;
/// unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
/// trainer_t t{unirl::models::categorical_actor_critic(4, 2), {}, {.algorithm = {.track = {.rollout_steps = 128}}}};
/// auto stats = t.step(venv);
/// ```
#include <unirl/trainer.hpp>

#include <unirl/algorithms/ppo_env.hpp>
#include <unirl/concepts/env_policy.hpp>
#include <unirl/concepts/environment.hpp>
#include <unirl/concepts/vector_environment.hpp>
#include <unirl/envs/cartpole.hpp>
#include <unirl/envs/canvas_click.hpp>
#include <unirl/envs/episodic_env.hpp>
#include <unirl/envs/pendulum.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/rollout/env.hpp>
