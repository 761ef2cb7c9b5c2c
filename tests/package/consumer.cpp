// A downstream project: it defines its own model (a linear actor-critic) and its own reward (the
// environment's reward with a penalty for drifting off centre), composes a trainer type with
// unirl's PPO, and trains a few iterations on unirl's CartPole.
#include <unirl/trainer.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/algorithms/ppo_env.hpp>
#include <unirl/envs/cartpole.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/parallel/data_parallel.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include <unistd.h>

struct linear_agentImpl : torch::nn::Cloneable<linear_agentImpl> {
  linear_agentImpl() { reset(); }
  void reset() override {
    actor = register_module("actor", torch::nn::Linear(4, 2));
    critic = register_module("critic", torch::nn::Linear(4, 1));
  }
  torch::nn::Linear actor{nullptr}, critic{nullptr};
};
TORCH_MODULE(linear_agent);

struct my_model : unirl::models::module_adapter<my_model, linear_agent> {
  using track = unirl::env_track;
  using module_adapter::module_adapter;
  // Module holders share their module: a copy of the holder calls the (non-const) forward.
  torch::Tensor logits(const torch::Tensor& obs) const { return linear_agent(net())->actor->forward(obs); }
  unirl::env_action act(const torch::Tensor& obs) const {
    auto logp = torch::log_softmax(logits(obs), -1);
    auto a = torch::multinomial(logp.exp(), 1).squeeze(1);
    return {a, logp.gather(1, a.unsqueeze(1)).squeeze(1), value(obs)};
  }
  unirl::env_evaluation evaluate(const torch::Tensor& obs, const torch::Tensor& actions) const {
    auto logp = torch::log_softmax(logits(obs), -1);
    return {logp.gather(1, actions.unsqueeze(1)).squeeze(1), -(logp.exp() * logp).sum(-1), value(obs)};
  }
  torch::Tensor value(const torch::Tensor& obs) const { return linear_agent(net())->critic->forward(obs).squeeze(1); }
};
static_assert(unirl::ModelAdapter<my_model>);

struct centred_reward {
  torch::Tensor operator()(const unirl::env_rollout& b) const {
    return b.rewards - 0.01f * b.obs.select(1, 0).abs();
  }
};
static_assert(unirl::RewardFor<centred_reward, unirl::env_rollout>);

using my_trainer = unirl::trainer<my_model, unirl::algo::ppo<>, centred_reward>;

// YAML recipes work exactly when the build machine had yaml-cpp (UNIRL_EXPECT_YAML, from CMake's
// own find_package(yaml-cpp) in the project that ran these tests): an installed unirl must
// carry that choice to its consumers, whatever yaml-cpp's version calls its target.
static bool yaml_as_expected() {
#if defined(UNIRL_EXPECT_YAML)
  constexpr bool expected = UNIRL_EXPECT_YAML;
#if defined(UNIRL_WITH_YAML)
  constexpr bool with_yaml = true;
#else
  constexpr bool with_yaml = false;
#endif
  if (with_yaml != expected) {
    std::cerr << "UNIRL_WITH_YAML is " << (with_yaml ? "defined" : "not defined") << "; expected "
              << (expected ? "defined: yaml-cpp is installed" : "not defined: yaml-cpp is not installed") << "\n";
    return false;
  }
  if constexpr (with_yaml) {
    const auto path =
        std::filesystem::temp_directory_path() / ("unirl_consumer_" + std::to_string(::getpid()) + ".yaml");
    std::ofstream(path) << "lr: 0.25\nweight_decay: 0.5\n";
    unirl::train::optimizer_options o;
    unirl::options::load_recipe(o, path.string());
    std::filesystem::remove(path);
    if (o.lr != 0.25 || o.weight_decay != 0.5) {
      std::cerr << "YAML recipe read lr = " << o.lr << ", weight_decay = " << o.weight_decay
                << "; expected 0.25, 0.5\n";
      return false;
    }
  }
#endif
  return true;
}

// unirl's data parallelism compiles and runs against this LibTorch: c10d's Gloo process group is
// declared only when LibTorch's USE_DISTRIBUTED and USE_C10D_GLOO reach the compiler (from
// LibTorch's CMake package, or from unirl's FindTorch.cmake in the find_package consumer).
static bool gloo_works() {
  const auto store =
      std::filesystem::temp_directory_path() / ("unirl_consumer_store_" + std::to_string(::getpid()));
  bool ok = false;
  {
    unirl::parallel::data_parallel<unirl::parallel::gloo> dp(
        0, 1, {.file_path = store.string(), .interface_host = "127.0.0.1", .timeout = std::chrono::seconds(60)});
    ok = dp.world_size() == 1 && dp.all_agree(true);
  }
  std::filesystem::remove(store);
  if (!ok) std::cerr << "a one-rank Gloo process group did not agree with itself\n";
  return ok;
}

int main() {
  if (!yaml_as_expected()) return 1;
  if (!gloo_works()) return 1;
  torch::manual_seed(0);
  unirl::envs::vector_env<unirl::envs::cartpole> env({}, {.num_envs = 2});
  my_trainer t(my_model{linear_agent()}, {},
               {.algorithm = {.track = {.rollout_steps = 32}}, .optim = {.lr = 1e-2}, .epochs = 2, .minibatches = 2,
                .progress = false});
  for (int i = 0; i < 3; ++i) {
    const auto s = t.step(env);
    std::cout << "step " << s.step << " reward " << s.reward_mean << " loss " << s.loss << "\n";
    if (!std::isfinite(s.loss) || s.samples != 64 || s.optimizer_steps != 4) return 1;
  }
  std::cout << "unirl " << unirl::version << ": consumer trained " << t.step_count() << " steps\n";
  return 0;
}
