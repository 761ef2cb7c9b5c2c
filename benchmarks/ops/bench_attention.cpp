// BM_attention_train<Exec>: forward + backward of ops::attention at (B, H, n = S, Dh);
// BM_attention_decode<Exec>: one decoding step (n = 1) over S cached keys, no gradient.
// exec::reference is LibTorch's batched matmuls + softmax; exec::cpu the fused loops. The
// crossover sets ops::fused_attention_max_work (per-head n * S * Dh), which exec::automatic uses.
#include <cmath>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <unirl/ops/attention.hpp>

namespace {
torch::Tensor causal_bias(std::int64_t n, std::int64_t S) {
  return torch::zeros({1, 1, n, S})
      .masked_fill(torch::ones({n, S}, torch::kBool).tril(S - n).logical_not().view({1, 1, n, S}),
                   -std::numeric_limits<float>::infinity());
}

template <class Exec>
void BM_attention_train(benchmark::State& state) {
  const auto B = state.range(0), H = state.range(1), n = state.range(2), D = state.range(3);
  torch::manual_seed(0);
  auto q = torch::randn({B, H, n, D}, torch::requires_grad()), k = torch::randn({B, H, n, D}, torch::requires_grad()),
       v = torch::randn({B, H, n, D}, torch::requires_grad());
  const auto bias = causal_bias(n, n);
  for (auto _ : state) {
    torch::Tensor y = unirl::ops::attention<Exec>(q, k, v, bias, 1.0 / std::sqrt(static_cast<double>(D)));
    y.sum().backward();
    benchmark::DoNotOptimize(q.grad().data_ptr<float>());
  }
  state.counters["work_per_head"] = static_cast<double>(n * n * D);
}

template <class Exec>
void BM_attention_decode(benchmark::State& state) {
  const auto B = state.range(0), H = state.range(1), S = state.range(2), D = state.range(3);
  torch::manual_seed(0);
  torch::NoGradGuard ng;
  const auto q = torch::randn({B, H, 1, D}), k = torch::randn({B, H, S, D}), v = torch::randn({B, H, S, D});
  const auto bias = torch::zeros({B, 1, 1, S});
  for (auto _ : state) {
    torch::Tensor y = unirl::ops::attention<Exec>(q, k, v, bias, 1.0 / std::sqrt(static_cast<double>(D)));
    benchmark::DoNotOptimize(y.data_ptr<float>());
  }
  state.counters["work_per_head"] = static_cast<double>(S * D);
}

// (B, H, n, Dh): the GRPO benchmark's shapes (128 x 4 heads of 16, 10 tokens), then longer and wider.
#define UNIRL_TRAIN_ARGS ->Args({128, 4, 10, 16})->Args({32, 4, 32, 16})->Args({8, 4, 64, 32})->Args({8, 4, 128, 32})->Args({4, 8, 256, 64})->Unit(benchmark::kMicrosecond)
BENCHMARK_TEMPLATE(BM_attention_train, unirl::exec::reference) UNIRL_TRAIN_ARGS;
BENCHMARK_TEMPLATE(BM_attention_train, unirl::exec::cpu) UNIRL_TRAIN_ARGS;
// (B, H, S, Dh)
#define UNIRL_DECODE_ARGS ->Args({128, 4, 16, 16})->Args({16, 8, 256, 64})->Args({8, 8, 2048, 64})->Unit(benchmark::kMicrosecond)
BENCHMARK_TEMPLATE(BM_attention_decode, unirl::exec::reference) UNIRL_DECODE_ARGS;
BENCHMARK_TEMPLATE(BM_attention_decode, unirl::exec::cpu) UNIRL_DECODE_ARGS;
}  // namespace
