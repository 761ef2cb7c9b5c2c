// Throughput of the env track's pieces: one CartPole step, one vectorised step of 4 copies,
// one 128 x 4 rollout with the policy, and one whole CleanRL PPO iteration (rollout + GAE +
// 16 minibatch updates). items_per_second = environment steps per second.
// The Python side of the comparison is cleanrl_cartpole.py in this folder (docs/performance.md).
#include <cstdint>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <unirl/algorithms/ppo_env.hpp>
#include <unirl/envs/cartpole.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/rollout/env.hpp>
#include <unirl/trainer.hpp>

namespace {

void BM_cartpole_step_scalar(benchmark::State& state) {
  unirl::envs::cartpole env;
  env.reset(1);
  std::int64_t a = 0;
  for (auto _ : state) {
    auto r = env.step(a);
    a ^= 1;
    if (r.terminated || r.truncated) env.reset(2);
    benchmark::DoNotOptimize(r);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_cartpole_step_scalar);

void BM_vector_env_step_cartpole4(benchmark::State& state) {
  unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
  const auto actions = torch::tensor({0, 1, 0, 1}, torch::kLong);
  for (auto _ : state) benchmark::DoNotOptimize(venv.step(actions));
  state.SetItemsProcessed(state.iterations() * 4);
}
BENCHMARK(BM_vector_env_step_cartpole4);

void BM_collect_cartpole_128x4(benchmark::State& state) {
  torch::set_num_threads(1);
  torch::manual_seed(0);
  unirl::models::categorical_actor_critic pi(4, 2);
  unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
  for (auto _ : state) benchmark::DoNotOptimize(unirl::collect(pi, venv, 128));
  state.SetItemsProcessed(state.iterations() * 512);
}
BENCHMARK(BM_collect_cartpole_128x4)->Unit(benchmark::kMillisecond);

void BM_ppo_iteration_cartpole(benchmark::State& state) {
  using policy_t = unirl::models::categorical_actor_critic;
  using trainer_t = unirl::trainer<policy_t, unirl::algo::ppo<>, unirl::rewards::environment_reward>;
  torch::set_num_threads(1);
  unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
  trainer_t t{policy_t(4, 2),
              {},
              {.algorithm = {.track = {.rollout_steps = 128}},
               .optim = {.lr = 2.5e-4, .eps = 1e-5},
               .clip = {.max_grad_norm = 0.5},
               .epochs = 4,
               .minibatches = 4,
               .progress = false}};
  for (auto _ : state) benchmark::DoNotOptimize(t.step(venv));
  state.SetItemsProcessed(state.iterations() * 512);
}
BENCHMARK(BM_ppo_iteration_cartpole)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
