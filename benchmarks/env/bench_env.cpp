// Throughput of the env track's pieces: one CartPole step, one vectorised step of 4 copies
// (tensors, and plain buffers), one 128 x 4 rollout with the policy, one minibatch update
// (128 rows: loss, backward, clipping, Adam) and one whole CleanRL PPO iteration (rollout + GAE
// + 16 minibatch updates), each on LibTorch and on the small-network kernels (exec::small_net).
// items_per_second = environment steps per second (rows per second for the minibatch update).
// The Python side of the comparison is cleanrl_cartpole.py in this folder (docs/performance.md).
#include <cstdint>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <vector>

#include <unirl/agent.hpp>
#include <unirl/algorithms/ppo_env.hpp>
#include <unirl/envs/cartpole.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/ops/small_net.hpp>
#include <unirl/rollout/env.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/optimizer.hpp>
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

void BM_vector_env_step_cartpole4_plain(benchmark::State& state) {
  unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
  const std::int64_t actions[4] = {0, 1, 0, 1};
  float rewards[4], dones[4];
  for (auto _ : state) {
    venv.step(actions, rewards, dones);
    benchmark::DoNotOptimize(rewards);
  }
  state.SetItemsProcessed(state.iterations() * 4);
}
BENCHMARK(BM_vector_env_step_cartpole4_plain);

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

using agent_t = unirl::ppo_agent<unirl::models::categorical, unirl::envs::cartpole, unirl::exec::small_net>;

agent_t::options cleanrl_options() {
  agent_t::options o;
  o.algorithm.track.rollout_steps = 128;
  o.optim.lr = 2.5e-4;
  o.optim.eps = 1e-5;
  o.clip.max_grad_norm = 0.5;
  o.epochs = 4;
  o.minibatches = 4;
  o.progress = false;
  return o;
}

void BM_collect_cartpole_128x4_small_net(benchmark::State& state) {
  torch::manual_seed(0);
  unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
  agent_t agent(unirl::models::categorical_actor_critic(4, 2), cleanrl_options());
  for (auto _ : state) agent.collect(venv);
  state.SetItemsProcessed(state.iterations() * 512);
}
BENCHMARK(BM_collect_cartpole_128x4_small_net)->Unit(benchmark::kMillisecond);

void BM_ppo_iteration_cartpole_small_net(benchmark::State& state) {
  torch::manual_seed(0);
  unirl::envs::vector_env<unirl::envs::cartpole> venv({}, {.num_envs = 4, .seed = 1});
  agent_t agent(unirl::models::categorical_actor_critic(4, 2), cleanrl_options());
  for (auto _ : state) benchmark::DoNotOptimize(agent.step(venv));
  state.SetItemsProcessed(state.iterations() * 512);
}
BENCHMARK(BM_ppo_iteration_cartpole_small_net)->Unit(benchmark::kMillisecond);

// One minibatch update of 128 rows (CartPole's 64 x 64 actor-critic): LibTorch (evaluate, the
// PPO loss, backward, clipping, AdamW) and the kernels (loss_and_gradient, clipping, Adam).
struct minibatch_data {
  torch::Tensor obs = torch::randn({128, 4});
  torch::Tensor actions = torch::randint(0, 2, {128}, torch::kLong);
  torch::Tensor old_logp = torch::full({128}, -0.69f), old_values = torch::randn({128});
  torch::Tensor advantages = torch::randn({128}), returns = torch::randn({128});
  torch::Tensor index = torch::arange(128, torch::kLong);
};

void BM_minibatch_update_libtorch(benchmark::State& state) {
  torch::set_num_threads(1);
  torch::manual_seed(0);
  unirl::models::categorical_actor_critic pi(4, 2);
  unirl::train::optimizer opt(pi.named_parameters(), {.lr = 2.5e-4, .eps = 1e-5});
  const minibatch_data d;
  const unirl::algo::ppo_options o;
  const auto params = pi.parameters();
  for (auto _ : state) {
    opt.zero_grad();
    const auto e = pi.evaluate(d.obs, d.actions);
    unirl::algo::ppo_eval ev;
    ev.logp = e.logp;
    ev.entropy = e.entropy;
    ev.values = e.value;
    ev.old_logp = d.old_logp;
    ev.old_values = d.old_values;
    ev.returns = d.returns;
    ev.advantages = d.advantages;
    ev.mask = torch::ones_like(e.logp);
    unirl::algo::ppo_loss(o, ev).total.backward();
    unirl::train::clip_grads(params, unirl::train::grad_norm_tensor(params), 0.5);
    opt.step();
  }
  state.SetItemsProcessed(state.iterations() * 128);
}
BENCHMARK(BM_minibatch_update_libtorch)->Unit(benchmark::kMicrosecond);

void BM_minibatch_update_small_net(benchmark::State& state) {
  torch::manual_seed(0);
  unirl::models::categorical_actor_critic pi(4, 2);
  auto net = unirl::models::small_net_like<float>(pi);
  unirl::models::copy_parameters(pi, net);
  unirl::ops::small_adam<float> adam(net.parameter_count(), 0.9, 0.999, 1e-5);
  const minibatch_data d;
  const unirl::ops::small_ppo_batch<float> mb{.obs = d.obs.data_ptr<float>(),
                                              .actions = d.actions.data_ptr<std::int64_t>(),
                                              .old_logp = d.old_logp.data_ptr<float>(),
                                              .old_values = d.old_values.data_ptr<float>(),
                                              .advantages = d.advantages.data_ptr<float>(),
                                              .returns = d.returns.data_ptr<float>(),
                                              .index = d.index.data_ptr<std::int64_t>(),
                                              .size = 128};
  for (auto _ : state) {
    benchmark::DoNotOptimize(net.loss_and_gradient({}, mb));
    unirl::ops::clip_gradient_norm(net.gradients(), net.parameter_count(), 0.5);
    adam.step(net.parameters(), net.gradients(), 2.5e-4);
  }
  state.SetItemsProcessed(state.iterations() * 128);
}
BENCHMARK(BM_minibatch_update_small_net)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
