// CartPole-v1 with PPO, CleanRL `ppo.py` hyper-parameters (ALGORITHMS.md §5): 4 copies x 128
// steps per iteration, GAE (0.99, 0.95), 4 epochs x 4 minibatches, clip 0.2, entropy 0.01,
// value 0.5, max grad norm 0.5, Adam (eps 1e-5) at 2.5e-4 annealed linearly to 0, two tanh
// layers of 64 with orthogonal init. CleanRL reports an episodic return of 490 +- 6 at 500k steps.
//
//   cartpole_ppo [--total-steps 500000] [--seed 2] [--out runs/cartpole_ppo] [key=value ...]
//
// key=value arguments override trainer options (e.g. optim.lr=3e-4, algorithm.ent_coef=0).
// Writes <out>/summary.json: final_mean_return (mean of the last 20 finished episodes),
// env_steps, seconds, steps_per_second, and <out>/metrics.jsonl (one line per iteration).
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/ppo_env.hpp>
#include <unirl/envs/cartpole.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/trainer.hpp>

using policy_t = unirl::models::categorical_actor_critic;
using trainer_t = unirl::trainer<policy_t, unirl::algo::ppo<>, unirl::rewards::environment_reward>;

int main(int argc, char** argv) try {
  std::int64_t total_env_steps = 500000, seed = 2, num_envs = 4;
  std::string out = "runs/cartpole_ppo";
  trainer_t::options opts{
      .algorithm = {.clip_low = 0.2, .clip_high = 0.2, .value_clip = 0.2, .vf_coef = 0.5, .ent_coef = 0.01,
                    .gamma = 0.99, .lambda = 0.95, .norm_adv = true, .rollout_steps = 128},
      .optim = {.lr = 2.5e-4, .eps = 1e-5},
      .schedule = {.kind = unirl::train::schedule_kind::linear},
      .clip = {.max_grad_norm = 0.5},
      .epochs = 4,
      .minibatches = 4,
      .progress = false,
  };
  auto flags = unirl::options::parse_command_line(
      opts, argc, argv,
      {{"total-steps", std::to_string(total_env_steps)}, {"seed", std::to_string(seed)},
       {"num-envs", std::to_string(num_envs)}, {"out", out}});
  total_env_steps = unirl::options::parse_value<std::int64_t>("--total-steps", flags["total-steps"]);
  seed = unirl::options::parse_value<std::int64_t>("--seed", flags["seed"]);
  num_envs = unirl::options::parse_value<std::int64_t>("--num-envs", flags["num-envs"]);
  out = flags["out"];
  torch::set_num_threads(1);  // tiny networks: one thread is fastest, as in CleanRL's runs

  const std::int64_t batch = num_envs * opts.algorithm.rollout_steps;
  const std::int64_t iterations = total_env_steps / batch;
  opts.seed = seed;
  opts.total_steps = iterations;  // the linear schedule anneals to 0 over the whole run
  std::filesystem::create_directories(out);
  opts.metrics_path = out + "/metrics.jsonl";

  unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = num_envs, .seed = seed});
  torch::manual_seed(static_cast<std::uint64_t>(seed));
  trainer_t t{policy_t(4, 2), {}, opts};
  std::cout << t.describe();

  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t it = 0; it < iterations; ++it) {
    const auto s = t.step(venv);
    if ((it + 1) % 50 == 0 || it + 1 == iterations)
      std::cout << "iteration " << it + 1 << "/" << iterations << "  env_steps " << venv.env_steps()
                << "  mean_return(last 20) " << venv.mean_recent_return(20) << "  policy_loss " << s.policy_loss
                << "  value_loss " << s.value_loss << "  entropy " << s.entropy << "  lr " << s.learning_rate
                << std::endl;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  nlohmann::json summary{{"env", "CartPole-v1"},
                         {"algorithm", "ppo"},
                         {"seed", seed},
                         {"final_mean_return", venv.mean_recent_return(20)},
                         {"final_mean_length", venv.mean_recent_length(20)},
                         {"episodes", venv.episodes().size()},
                         {"env_steps", venv.env_steps()},
                         {"seconds", seconds},
                         {"steps_per_second", static_cast<double>(venv.env_steps()) / seconds}};
  std::ofstream(out + "/summary.json") << summary.dump(2) << "\n";
  std::cout << summary.dump(2) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
