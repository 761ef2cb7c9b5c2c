// Pendulum-v1 with PPO and the diagonal-Gaussian policy. Two presets:
//
// - `--preset tuned` (default): 4 copies x 512 steps per iteration, gamma 0.9, lr 1e-3, 400k
//   steps (~1.5 minutes); reaches about -350 (RL Zoo's tuned PPO also uses gamma 0.9 for
//   Pendulum's short horizon).
// - `--preset cleanrl`: CleanRL `ppo_continuous_action.py` exactly: 1 copy x 2048 steps,
//   gamma 0.99, lr 3e-4, 1M steps. It stays near -1000 (the pendulum hangs) on this task.
//
// Common to both: GAE lambda 0.95, 10 epochs x 32 minibatches, clip 0.2 (value clipped too),
// no entropy bonus, value coefficient 0.5, max grad norm 0.5, Adam (eps 1e-5) annealed
// linearly, two tanh layers of 64, state-independent log-std starting at 0; actions clipped
// into [-2, 2], observations and rewards normalised with running statistics and clipped to
// +-10 (Gym's ClipAction / NormalizeObservation / NormalizeReward wrappers).
//
// It trains with `unirl::ppo_agent`, which by default (`--exec automatic`) runs this small
// network on the small-network kernels (exec::small_net; docs/performance.md); `--exec
// reference` takes the LibTorch path (the trainer with algo::ppo), the reference.
//
//   pendulum_ppo [--exec automatic|reference] [--preset tuned|cleanrl] [--total-steps N] [--seed 1]
//                [--num-envs N] [--out runs/pendulum_ppo] [--save PATH] [--resume PATH] [key=value ...]
//
// --save PATH checkpoints the trainer and the environments (their running normalisation
// statistics included) together every 20 iterations; --resume PATH continues such a run bit for
// bit (give it the same options).
// key=value arguments override trainer options after the preset (e.g. algorithm.gamma=0.95).
// Writes <out>/summary.json: final_mean_return (mean raw return of the last 20 episodes),
// env_steps, seconds, steps_per_second; and <out>/metrics.jsonl.
#include <exception>
#include <iostream>
#include <ostream>
#include <string>

#include <torch/torch.h>

#include <unirl/agent.hpp>
#include <unirl/envs/pendulum.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>

#include "common/env_example.hpp"

using policy_t = unirl::models::gaussian_actor_critic;

template <class Agent>
int run(int argc, char** argv, const std::string& exec) {
  // The preset is read first, so that key=value overrides apply on top of it.
  const std::string preset = examples::flag_value(argc, argv, "preset", "tuned");
  if (preset != "tuned" && preset != "cleanrl")
    throw unirl::config_error("--preset", "value '" + preset + "': expected tuned or cleanrl");
  const bool cleanrl = preset == "cleanrl";
  typename Agent::options opts{
      .algorithm = {.clip_low = 0.2, .clip_high = 0.2, .value_clip = 0.2, .vf_coef = 0.5, .ent_coef = 0.0,
                    .gamma = cleanrl ? 0.99 : 0.9, .lambda = 0.95, .norm_adv = true,
                    .track = {.rollout_steps = cleanrl ? 2048 : 512}},
      .optim = {.lr = cleanrl ? 3e-4 : 1e-3, .eps = 1e-5},
      .schedule = {.kind = unirl::train::schedule_kind::linear},
      .clip = {.max_grad_norm = 0.5},
      .epochs = 10,
      .minibatches = 32,
      .progress = false,
  };
  const auto run = examples::parse_env_run(opts, argc, argv,
                                           {.total_env_steps = cleanrl ? 1000000 : 400000,
                                            .seed = 1,
                                            .num_envs = cleanrl ? 1 : 4,
                                            .out = "runs/pendulum_ppo"},
                                           {{"preset", preset}, {"exec", exec}});

  unirl::envs::vector_env<unirl::envs::pendulum> venv(
      {}, {.num_envs = run.num_envs,
           .seed = run.seed,
           .clip_actions = true,
           .normalize_observation = true,
           .normalize_reward = true,
           .reward_gamma = opts.algorithm.gamma});
  torch::manual_seed(static_cast<std::uint64_t>(run.seed));  // the policy's initial weights
  Agent t(policy_t(3, 1), opts);
  std::cout << t.describe();

  const double seconds = examples::train_env(t, venv, run, 20, [](std::ostream& os, const auto& s) {
    os << "  value_loss " << s.value_loss << "  entropy " << s.entropy << "  lr " << s.learning_rate;
  });
  examples::write_env_summary(run, "Pendulum-v1", venv, seconds, {{"preset", preset}, {"path", t.path()}});
  return 0;
}

int main(int argc, char** argv) try {
  const std::string exec = examples::exec_flag(argc, argv);
  if (exec == "reference")
    return run<unirl::ppo_agent<unirl::models::diag_gaussian, unirl::envs::pendulum, unirl::exec::reference>>(
        argc, argv, exec);
  return run<unirl::ppo_agent<unirl::models::diag_gaussian, unirl::envs::pendulum>>(argc, argv, exec);
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
