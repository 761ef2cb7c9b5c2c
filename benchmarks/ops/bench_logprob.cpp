// Token log-prob + entropy, forward and backward: fused CPU loops vs LibTorch reference ops,
// and the chunked LM-head path that never materialises the (N, V) logits.
#include <benchmark/benchmark.h>

#include <unirl/ops/logprob.hpp>

template <class Exec>
static void BM_token_logprob(benchmark::State& state) {
  torch::manual_seed(0);
  const auto n = state.range(0), v = state.range(1);
  auto logits = torch::randn({n, v}).requires_grad_(true);
  auto targets = torch::randint(v, {n}, torch::kInt64);
  for (auto _ : state) {
    auto r = unirl::ops::token_logprob<Exec>(logits, targets);
    (r.logp.sum() + 0.01 * r.entropy.sum()).backward();
    benchmark::DoNotOptimize(logits.grad().data_ptr());
    logits.mutable_grad().reset();
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK_TEMPLATE(BM_token_logprob, unirl::exec::reference)->Args({1024, 256})->Args({1024, 8192})->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_token_logprob, unirl::exec::cpu)->Args({1024, 256})->Args({1024, 8192})->Unit(benchmark::kMillisecond);

static void BM_linear_logprob_materialised(benchmark::State& state) {
  torch::manual_seed(0);
  const auto n = state.range(0), v = state.range(1), d = std::int64_t{256};
  auto h = torch::randn({n, d}).requires_grad_(true);
  auto w = torch::randn({v, d}).requires_grad_(true);
  auto t = torch::randint(v, {n}, torch::kInt64);
  for (auto _ : state) {
    auto r = unirl::ops::token_logprob<unirl::exec::reference>(torch::matmul(h, w.t()), t);
    r.logp.sum().backward();
    h.mutable_grad().reset();
    w.mutable_grad().reset();
  }
  state.counters["logits_MiB"] = static_cast<double>(n * v * 4) / (1 << 20);
}
static void BM_linear_logprob_chunked(benchmark::State& state) {
  torch::manual_seed(0);
  const auto n = state.range(0), v = state.range(1), d = std::int64_t{256}, chunk = std::int64_t{256};
  auto h = torch::randn({n, d}).requires_grad_(true);
  auto w = torch::randn({v, d}).requires_grad_(true);
  auto t = torch::randint(v, {n}, torch::kInt64);
  for (auto _ : state) {
    auto r = unirl::ops::linear_logprob(h, w, t, chunk);
    r.logp.sum().backward();
    h.mutable_grad().reset();
    w.mutable_grad().reset();
  }
  state.counters["logits_MiB"] = static_cast<double>(chunk * v * 4) / (1 << 20);
}
BENCHMARK(BM_linear_logprob_materialised)->Args({2048, 8192})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_linear_logprob_chunked)->Args({2048, 8192})->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
