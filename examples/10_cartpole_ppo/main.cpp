// CartPole-v1 with PPO, CleanRL `ppo.py` hyper-parameters (docs/environments.md): 4 copies x 128
// steps per iteration, GAE (0.99, 0.95), 4 epochs x 4 minibatches, clip 0.2, entropy 0.01,
// value 0.5, max grad norm 0.5, Adam (eps 1e-5) at 2.5e-4 annealed linearly to 0, two tanh
// layers of 64 with orthogonal init. CleanRL reports an episodic return of 490 +- 6 at 500k steps.
//
// It trains with `unirl::ppo_agent`, which by default (`--exec automatic`) runs this small
// network on the small-network kernels (exec::small_net: Eigen forward, backward, PPO loss and
// Adam, the rollout in plain buffers; docs/performance.md); `--exec reference` takes the LibTorch
// path (the trainer with algo::ppo), the reference.
//
//   cartpole_ppo [--exec automatic|reference] [--total-steps 500000] [--seed 2] [--out runs/cartpole_ppo]
//                [--save PATH] [--resume PATH] [key=value ...]
//
// --save PATH checkpoints the trainer and the vector of environments together (one atomic file)
// every 50 iterations; --resume PATH continues such a run bit for bit (give it the same options).
// key=value arguments override trainer options (e.g. optim.lr=3e-4, algorithm.ent_coef=0).
// Writes <out>/summary.json: final_mean_return (mean of the last 20 finished episodes),
// env_steps, seconds, steps_per_second, and <out>/metrics.jsonl (one line per iteration).
#include <cstdint>
#include <exception>
#include <iostream>
#include <ostream>

#include <torch/torch.h>

#include <string>

#include <unirl/agent.hpp>
#include <unirl/envs/cartpole.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>

#include "common/env_example.hpp"

using policy_t = unirl::models::categorical_actor_critic;

template <class Agent>
int run(int argc, char** argv, const std::string& exec) {
  typename Agent::options opts{
      .algorithm = {.clip_low = 0.2, .clip_high = 0.2, .value_clip = 0.2, .vf_coef = 0.5, .ent_coef = 0.01,
                    .gamma = 0.99, .lambda = 0.95, .norm_adv = true, .track = {.rollout_steps = 128}},
      .optim = {.lr = 2.5e-4, .eps = 1e-5},
      .schedule = {.kind = unirl::train::schedule_kind::linear},
      .clip = {.max_grad_norm = 0.5},
      .epochs = 4,
      .minibatches = 4,
      .progress = false,
  };
  const auto run = examples::parse_env_run(
      opts, argc, argv, {.total_env_steps = 500000, .seed = 2, .num_envs = 4, .out = "runs/cartpole_ppo"},
      {{"exec", exec}});

  unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = run.num_envs, .seed = run.seed});
  torch::manual_seed(static_cast<std::uint64_t>(run.seed));
  Agent t(policy_t(4, 2), opts);
  std::cout << t.describe();

  const double seconds = examples::train_env(t, venv, run, 50, [](std::ostream& os, const auto& s) {
    os << "  policy_loss " << s.policy_loss << "  value_loss " << s.value_loss << "  entropy " << s.entropy << "  lr "
       << s.learning_rate;
  });
  examples::write_env_summary(run, "CartPole-v1", venv, seconds,
                              {{"final_mean_length", venv.mean_recent_length(20)}, {"path", t.path()}});
  return 0;
}

int main(int argc, char** argv) try {
  const std::string exec = examples::exec_flag(argc, argv);
  if (exec == "reference")
    return run<unirl::ppo_agent<unirl::models::categorical, unirl::envs::cartpole, unirl::exec::reference>>(argc, argv,
                                                                                                          exec);
  return run<unirl::ppo_agent<unirl::models::categorical, unirl::envs::cartpole>>(argc, argv, exec);
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
