// CUDA kernels against the LibTorch reference on the same device (built with
// -DUNIRL_ENABLE_CUDA=ON; run on a GPU by scripts/gpu-check.sh). Float32 to 1e-5 relative to the
// largest magnitude of the reference's result, float64 to 1e-10; without a CUDA device every test
// skips, saying so (CTest entry ops.cuda_kernels).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <unirl/ops/gaussian.hpp>
#include <unirl/ops/logprob.hpp>
#include <unirl/ops/paged_attention.hpp>

#include "paged_fixture.hpp"

namespace {
#define UNIRL_REQUIRE_CUDA_DEVICE()                                                                       \
  if (!torch::cuda::is_available())                                                                       \
  SKIP(                                                                                                   \
      "no CUDA device visible to LibTorch: the [cuda] kernel tests need a GPU (run scripts/gpu-check.sh " \
      "on one)")

double tolerance(torch::ScalarType t) { return t == torch::kFloat64 ? 1e-10 : 1e-5; }
// max |a - b| relative to max |b|.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-300);
}
}  // namespace

TEST_CASE("CUDA token log-prob and entropy equal the reference, values and gradients", "[cuda][ops]") {
  UNIRL_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(0);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    for (std::int64_t v : {7, 256, 32000}) {
      const double tol = tolerance(dtype);
      auto logits = (torch::randn({33, v}, torch::dtype(dtype)) * 3).to(torch::kCUDA).requires_grad_(true);
      auto targets = torch::randint(v, {33}, torch::kInt64).to(torch::kCUDA);
      auto g1 = torch::randn({33}, logits.options()), g2 = torch::randn({33}, logits.options());
      auto k = unirl::ops::token_logprob<unirl::exec::cuda>(logits, targets);
      auto gk = torch::autograd::grad({(k.logp * g1).sum() + (k.entropy * g2).sum()}, {logits})[0];
      auto r = unirl::ops::token_logprob<unirl::exec::reference>(logits, targets);
      auto gr = torch::autograd::grad({(r.logp * g1).sum() + (r.entropy * g2).sum()}, {logits})[0];
      INFO("V = " << v << " dtype " << dtype);
      CHECK(rel_diff(k.logp, r.logp) < tol);
      CHECK(rel_diff(k.entropy, r.entropy) < tol);
      CHECK(rel_diff(gk, gr) < tol);
    }
  }
}

TEST_CASE("CUDA chunked linear log-prob equals the materialised reference, forward and backward", "[cuda][ops]") {
  UNIRL_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(1);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const auto o = torch::dtype(dtype).device(torch::kCUDA);
    auto h = torch::randn({300, 64}, o).requires_grad_(true);
    auto w = (torch::randn({5000, 64}, o) * 0.2).requires_grad_(true);
    const auto t = torch::randint(5000, {300}, torch::dtype(torch::kInt64).device(torch::kCUDA));
    const auto g1 = torch::randn({300}, o), g2 = torch::randn({300}, o);
    const auto k = unirl::ops::linear_logprob<unirl::exec::cuda>(h, w, t, 128);
    const auto gk = torch::autograd::grad({(k.logp * g1).sum() + (k.entropy * g2).sum()}, {h, w});
    const auto r = unirl::ops::linear_logprob<unirl::exec::reference>(h, w, t);
    const auto gr = torch::autograd::grad({(r.logp * g1).sum() + (r.entropy * g2).sum()}, {h, w});
    INFO("dtype " << dtype);
    CHECK(rel_diff(k.logp, r.logp) < tolerance(dtype));
    CHECK(rel_diff(k.entropy, r.entropy) < tolerance(dtype));
    CHECK(rel_diff(gk[0], gr[0]) < tolerance(dtype));
    CHECK(rel_diff(gk[1], gr[1]) < tolerance(dtype));
  }
}

TEST_CASE("CUDA Gaussian log-prob equals the reference, values and mean gradients", "[cuda][ops]") {
  UNIRL_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(2);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    for (bool mean_reduction : {true, false}) {
      const auto o = torch::dtype(dtype).device(torch::kCUDA);
      const auto x = torch::randn({8, 4, 32, 32}, o);
      auto mean = (x + 0.3 * torch::randn({8, 4, 32, 32}, o)).requires_grad_(true);
      const auto g = torch::randn({8}, o);
      const auto k = unirl::ops::gaussian_logprob<unirl::exec::cuda>(x, mean, 0.41, mean_reduction);
      const auto gk = torch::autograd::grad({(k * g).sum()}, {mean})[0];
      const auto r = unirl::ops::gaussian_logprob<unirl::exec::reference>(x, mean, 0.41, mean_reduction);
      const auto gr = torch::autograd::grad({(r * g).sum()}, {mean})[0];
      INFO("dtype " << dtype << " mean_reduction " << mean_reduction);
      CHECK(rel_diff(k, r) < tolerance(dtype));
      CHECK(rel_diff(gk, gr) < tolerance(dtype));
    }
  }
}

TEST_CASE("CUDA paged decode equals the gathered reference over the pool, grouped heads and padding", "[cuda][ops]") {
  UNIRL_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(3);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    // Contexts from 1 to past one block of threads (256), 8 query heads on 2 KV heads.
    auto c = unirl_test::make_paged_decode_case({1, 5, 64, 300, 129, 2}, 8, 2, 64, 1200,
                                                torch::dtype(dtype).device(torch::kCUDA));
    const auto k = c.run<unirl::exec::cuda>();
    const auto r = c.run<unirl::exec::reference>();
    INFO("dtype " << dtype);
    CHECK(rel_diff(k, r) < tolerance(dtype));
  }
}

namespace {
// Seconds per call of f, averaged over `iterations` after a warm-up, the device synchronised.
template <class F>
double seconds_per_call(F&& f, int iterations) {
  f();
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) f();
  torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iterations;
}
void report(const std::string& name, double seconds, double bytes, double flops, double hbm, double bf16) {
  std::cout << "unirl-bench " << name << " time_us " << seconds * 1e6;
  if (bytes > 0) std::cout << " GB/s " << bytes / seconds / 1e9 << " of_hbm " << bytes / seconds / hbm;
  if (flops > 0) std::cout << " TFLOP/s " << flops / seconds / 1e12 << " of_bf16_mm " << flops / seconds / bf16;
  std::cout << "\n";
}
}  // namespace

// Run by hand or by scripts/gpu-check.sh (hidden: [.]): each op's time and the share it reaches
// of the device's copy bandwidth and bf16 matrix rate, both measured here in the same run. Bytes
// are the least each op must move (its inputs read once, its outputs written once).
TEST_CASE("CUDA op benchmarks against the measured HBM bandwidth and bf16 matmul rate", "[.][cuda-bench]") {
  UNIRL_REQUIRE_CUDA_DEVICE();
  torch::NoGradGuard ng;
  const auto f32 = torch::dtype(torch::kFloat32).device(torch::kCUDA);
  const auto i64 = torch::dtype(torch::kInt64).device(torch::kCUDA);
  // The roofline: a 1 GiB device copy (read + write) and an 8192^3 bf16 matrix product.
  const auto src = torch::empty({std::int64_t{1} << 28}, f32), dst = torch::empty_like(src);
  const double copy_bytes = 2.0 * static_cast<double>(src.numel()) * 4;
  const double hbm = copy_bytes / seconds_per_call([&] { dst.copy_(src); }, 20);
  const auto a = torch::randn({8192, 8192}, f32).to(torch::kBFloat16),
             b = torch::randn({8192, 8192}, f32).to(torch::kBFloat16);
  const double mm_flops = 2.0 * 8192.0 * 8192.0 * 8192.0;
  const double bf16 = mm_flops / seconds_per_call([&] { (void)torch::mm(a, b); }, 20);
  std::cout << "unirl-bench roofline hbm_GB/s " << hbm / 1e9 << " bf16_mm_TFLOP/s " << bf16 / 1e12 << "\n";

  {  // token log-prob, N = 4096 rows of V = 32000
    const std::int64_t n = 4096, v = 32000;
    const auto logits = torch::randn({n, v}, f32);
    const auto t = torch::randint(v, {n}, i64);
    const double bytes = static_cast<double>(n * v) * 4;
    for (auto* which : {"cuda", "reference"}) {
      auto run = [&] {
        return std::string(which) == "cuda" ? unirl::ops::token_logprob<unirl::exec::cuda>(logits, t)
                                            : unirl::ops::token_logprob<unirl::exec::reference>(logits, t);
      };
      report(std::string("token_logprob_forward_4096x32000_") + which, seconds_per_call(run, 20), bytes, 0, hbm, bf16);
    }
    torch::AutoGradMode grad(true);
    const auto x = logits.clone().requires_grad_(true);
    for (auto* which : {"cuda", "reference"}) {
      auto run = [&] {
        const auto r = std::string(which) == "cuda" ? unirl::ops::token_logprob<unirl::exec::cuda>(x, t)
                                                    : unirl::ops::token_logprob<unirl::exec::reference>(x, t);
        (void)torch::autograd::grad({r.logp.sum() + r.entropy.sum()}, {x});
      };
      // forward reads the logits; backward reads them and writes their gradient
      report(std::string("token_logprob_forward_backward_4096x32000_") + which, seconds_per_call(run, 10), 3 * bytes, 0,
             hbm, bf16);
    }
  }
  {  // chunked LM head, N = 4096, D = 1024, V = 32000, float32: forward + backward = 8 N D V flops
    torch::AutoGradMode grad(true);
    const std::int64_t n = 4096, d = 1024, v = 32000;
    const auto h = torch::randn({n, d}, f32).requires_grad_(true);
    const auto w = (torch::randn({v, d}, f32) * 0.03).requires_grad_(true);
    const auto t = torch::randint(v, {n}, i64);
    for (auto* which : {"cuda", "reference"}) {
      auto run = [&] {
        const auto r = std::string(which) == "cuda" ? unirl::ops::linear_logprob<unirl::exec::cuda>(h, w, t, 1024)
                                                    : unirl::ops::linear_logprob<unirl::exec::reference>(h, w, t);
        (void)torch::autograd::grad({r.logp.sum() + r.entropy.sum()}, {h, w});
      };
      report(std::string("linear_logprob_forward_backward_4096x1024x32000_f32_") + which, seconds_per_call(run, 5), 0,
             8.0 * static_cast<double>(n * d) * static_cast<double>(v), hbm, bf16);
    }
  }
  {  // Gaussian log-prob of 64 latents of 16 x 64 x 64
    const auto x = torch::randn({64, 16, 64, 64}, f32), m = torch::randn({64, 16, 64, 64}, f32);
    const double bytes = 2.0 * static_cast<double>(x.numel()) * 4;
    report("gaussian_logprob_64x65536_cuda",
           seconds_per_call([&] { (void)unirl::ops::gaussian_logprob<unirl::exec::cuda>(x, m, 0.3, true); }, 50), bytes,
           0, hbm, bf16);
    report("gaussian_logprob_64x65536_reference",
           seconds_per_call([&] { (void)unirl::ops::gaussian_logprob<unirl::exec::reference>(x, m, 0.3, true); }, 50),
           bytes, 0, hbm, bf16);
  }
  {  // paged decode: 64 sequences of 2048 slots, 32 query heads on 8 KV heads of 128
    const std::int64_t S = 64, C = 2048, H = 32, Hkv = 8, D = 128;
    auto c = unirl_test::make_paged_decode_case(std::vector<std::int64_t>(S, C), H, Hkv, D, S * C + 1, f32);
    const double bytes = 2.0 * static_cast<double>(S * C * Hkv * D) * 4;  // each sequence's keys and values once
    for (auto* which : {"cuda", "reference"}) {
      auto run = [&] {
        return std::string(which) == "cuda" ? c.run<unirl::exec::cuda>() : c.run<unirl::exec::reference>();
      };
      report(std::string("paged_decode_64x2048_h32_kv8_d128_") + which, seconds_per_call(run, 20), bytes, 0, hbm, bf16);
    }
  }
}
