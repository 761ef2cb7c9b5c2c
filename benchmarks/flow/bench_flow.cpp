// The flow track's costs on the digits-sized model of examples/20_digits_flow (class-conditional
// MLP velocity net on 1x8x8, hidden 256, depth 3), 16 conditions x group 8 = 128 samples,
// 10 sampler steps, one LibTorch thread:
// - BM_flow_sample<Sampler>: one batch of trajectories, ODE (no log-probs) vs the Flow-GRPO SDE
//   (means, stds and per-step log-probs recorded);
// - BM_flow_step<Algorithm>: one unirl::trainer step (sample, reward, group advantages, update,
//   AdamW) for Flow-GRPO, Flow-DPPO, RAM and DiffusionNFT; items_per_second is samples/s.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <unirl/algorithms/diffusion_nft.hpp>
#include <unirl/algorithms/flow_dppo.hpp>
#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/algorithms/ram.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/flow_nets.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/trainer.hpp>

namespace {
using model_t = unirl::models::flow_model<unirl::models::mlp_velocity_net>;

model_t digits_model() {
  torch::manual_seed(0);
  return {unirl::models::mlp_velocity_net(unirl::models::flow_net_options{
              .shape = {1, 8, 8}, .num_classes = 10, .hidden = 256, .depth = 3, .embed_dim = 64}),
          {1, 8, 8}};
}
const torch::Tensor& conditions() {
  static const torch::Tensor c = torch::arange(16, torch::kInt64) % 10;
  return c;
}
// Mean brightness of the upper half: a dense reward whose cost is negligible.
struct upper_brightness {
  torch::Tensor operator()(const unirl::flow_rollout& b) const {
    return b.samples().slice(2, 0, 4).flatten(1).mean(1);
  }
};

template <class Sampler>
void BM_flow_sample(benchmark::State& state) {
  torch::set_num_threads(1);
  auto m = digits_model();
  const auto cond = conditions().repeat_interleave(8);
  const Sampler sampler({.steps = 10});
  for (auto _ : state) benchmark::DoNotOptimize(unirl::sample_trajectory(sampler, m, cond).samples());
  state.SetItemsProcessed(state.iterations() * cond.size(0));
}
BENCHMARK_TEMPLATE(BM_flow_sample, unirl::ode::euler)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_flow_sample, unirl::sde::flow_grpo)->Unit(benchmark::kMillisecond);

template <class Algorithm>
void BM_flow_step(benchmark::State& state) {
  torch::set_num_threads(1);
  typename Algorithm::options o{};
  o.sampler.steps = 10;
  unirl::trainer<model_t, Algorithm, upper_brightness> t{
      digits_model(), upper_brightness{}, {.algorithm = o, .optim = {.lr = 1e-4}, .group_size = 8, .progress = false}};
  for (auto _ : state) benchmark::DoNotOptimize(t.step(conditions()).loss);
  state.SetItemsProcessed(state.iterations() * 128);
}
BENCHMARK_TEMPLATE(BM_flow_step, unirl::algo::flow_grpo<>)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_flow_step, unirl::algo::flow_dppo<>)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_flow_step, unirl::algo::ram<>)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_flow_step, unirl::algo::diffusion_nft<>)->Unit(benchmark::kMillisecond);
}  // namespace

BENCHMARK_MAIN();
