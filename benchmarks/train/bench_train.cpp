// Benchmarks of unirl::train: the global gradient norm (one reduction and one host read versus
// one read per tensor), checkpoint write / read throughput, and an AdamW step over groups.
//
//   bench_train --benchmark_filter=grad_norm
#include <torch/torch.h>

#include <benchmark/benchmark.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <unirl/train/checkpoint.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/optimizer.hpp>

namespace {

// `n` parameters of 64 x 64 with gradients.
std::vector<torch::Tensor> params_with_grads(std::int64_t n) {
  torch::manual_seed(0);
  std::vector<torch::Tensor> ps;
  for (std::int64_t i = 0; i < n; ++i) {
    auto p = torch::randn({64, 64}, torch::requires_grad());
    p.mutable_grad() = torch::randn({64, 64});
    ps.push_back(p);
  }
  return ps;
}

void BM_grad_norm_unirl(benchmark::State& st) {
  const auto ps = params_with_grads(st.range(0));
  for (auto _ : st) benchmark::DoNotOptimize(unirl::train::grad_norm(ps));
  st.SetItemsProcessed(st.iterations() * st.range(0));
}
BENCHMARK(BM_grad_norm_unirl)->Arg(16)->Arg(256);

// The straightforward loop: one host read per tensor.
void BM_grad_norm_per_tensor_item(benchmark::State& st) {
  const auto ps = params_with_grads(st.range(0));
  for (auto _ : st) {
    double sq = 0;
    for (const auto& p : ps) {
      const double n = p.grad().norm().item<double>();
      sq += n * n;
    }
    benchmark::DoNotOptimize(std::sqrt(sq));
  }
  st.SetItemsProcessed(st.iterations() * st.range(0));
}
BENCHMARK(BM_grad_norm_per_tensor_item)->Arg(16)->Arg(256);

struct temp_file {
  std::string path;
  temp_file() {
    std::random_device rd;
    path = (std::filesystem::temp_directory_path() / ("unirl_bench_" + std::to_string(rd()) + ".ckpt")).string();
  }
  ~temp_file() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

// Checkpoint of `range(0)` MiB of float32 weights (fsync included).
void BM_checkpoint_write(benchmark::State& st) {
  const std::int64_t n = st.range(0) * (1 << 20) / 4;
  const unirl::named_tensors t{{"w", torch::randn({n})}};
  temp_file f;
  for (auto _ : st)
    unirl::train::write_checkpoint(f.path, [&](auto& a) { unirl::train::save_tensors(a, "", t); });
  st.SetBytesProcessed(st.iterations() * n * 4);
}
BENCHMARK(BM_checkpoint_write)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_checkpoint_read(benchmark::State& st) {
  const std::int64_t n = st.range(0) * (1 << 20) / 4;
  const unirl::named_tensors t{{"w", torch::randn({n})}};
  temp_file f;
  unirl::train::write_checkpoint(f.path, [&](auto& a) { unirl::train::save_tensors(a, "", t); });
  for (auto _ : st)
    unirl::train::read_checkpoint(f.path, [&](auto& a) { unirl::train::load_tensors(a, "", t); });
  st.SetBytesProcessed(st.iterations() * n * 4);
}
BENCHMARK(BM_checkpoint_read)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();

// One AdamW step over 64 parameters of 256 x 256 split into two groups.
void BM_optimizer_step_two_groups(benchmark::State& st) {
  torch::manual_seed(0);
  unirl::named_tensors named;
  for (int i = 0; i < 64; ++i) {
    auto p = torch::randn({256, 256}, torch::requires_grad());
    p.mutable_grad() = torch::randn({256, 256});
    named.emplace_back((i % 2 ? "head." : "body.") + std::to_string(i), p);
  }
  unirl::train::optimizer opt(named, {.lr = 1e-4, .weight_decay = 0.01,
                                      .groups = {{.prefix = "head.", .lr_scale = 2.0}}});
  for (auto _ : st) opt.step();
  st.SetItemsProcessed(st.iterations() * 64 * 256 * 256);
}
BENCHMARK(BM_optimizer_step_two_groups)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
