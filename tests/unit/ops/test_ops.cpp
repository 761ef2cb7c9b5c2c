// Hot ops: every implementation against the LibTorch reference, gradients against finite differences.
#include <cmath>
#include <limits>
#include <string>

#include <catch2/catch.hpp>

#include <unirl/ops/attention.hpp>
#include <unirl/ops/gaussian.hpp>
#include <unirl/ops/logprob.hpp>
#include <unirl/ops/paged_attention.hpp>

#include "paged_fixture.hpp"

namespace {
double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }
}  // namespace

TEST_CASE("fused token log-prob and entropy equal the reference, values and gradients", "[cpu][ops]") {
  torch::manual_seed(0);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 2e-5;
    auto logits = (torch::randn({37, 53}, torch::dtype(dtype)) * 3).requires_grad_(true);
    auto targets = torch::randint(53, {37}, torch::kInt64);
    auto g1 = torch::randn({37}, torch::dtype(dtype)), g2 = torch::randn({37}, torch::dtype(dtype));

    auto fused = unirl::ops::token_logprob<unirl::exec::cpu>(logits, targets);
    auto [gf] = std::make_tuple(torch::autograd::grad({(fused.logp * g1).sum() + (fused.entropy * g2).sum()}, {logits})[0]);
    auto ref = unirl::ops::token_logprob<unirl::exec::reference>(logits, targets);
    auto gr = torch::autograd::grad({(ref.logp * g1).sum() + (ref.entropy * g2).sum()}, {logits})[0];
    CHECK(max_diff(fused.logp, ref.logp) < tol);
    CHECK(max_diff(fused.entropy, ref.entropy) < tol);
    CHECK(max_diff(gf, gr) < tol);
  }
}

TEST_CASE("fused token log-prob: hand-computed values and finite differences", "[cpu][ops]") {
  // Row (0, ln 3): p = (1/4, 3/4); log p(target=1) = ln(3/4); H = -(1/4 ln 1/4 + 3/4 ln 3/4).
  auto logits = torch::tensor({{0.0, std::log(3.0)}}, torch::kFloat64).requires_grad_(true);
  auto r = unirl::ops::token_logprob<unirl::exec::cpu>(logits, torch::tensor({1}, torch::kInt64));
  CHECK(r.logp.item<double>() == Approx(std::log(0.75)).epsilon(1e-12));
  CHECK(r.entropy.item<double>() == Approx(-(0.25 * std::log(0.25) + 0.75 * std::log(0.75))).epsilon(1e-12));

  torch::manual_seed(1);
  auto x = torch::randn({4, 6}, torch::kFloat64);
  auto t = torch::randint(6, {4}, torch::kInt64);
  auto f = [&](const torch::Tensor& in) {
    auto o = unirl::ops::token_logprob<unirl::exec::cpu>(in, t);
    return (o.logp * torch::arange(1, 5, torch::kFloat64)).sum() + (o.entropy * 0.5).sum();
  };
  auto xg = x.clone().requires_grad_(true);
  auto analytic = torch::autograd::grad({f(xg)}, {xg})[0];
  auto numeric = torch::zeros_like(x);
  const double h = 1e-6;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) {
      auto xp = x.clone(), xm = x.clone();
      xp[i][j] += h;
      xm[i][j] -= h;
      numeric[i][j] = (f(xp).item<double>() - f(xm).item<double>()) / (2 * h);
    }
  CHECK(max_diff(analytic, numeric) < 1e-7);
}

TEST_CASE("chunked linear log-prob equals the materialised computation", "[cpu][ops]") {
  torch::manual_seed(2);
  auto h = torch::randn({50, 16}, torch::kFloat64).requires_grad_(true);
  auto w = torch::randn({40, 16}, torch::kFloat64).requires_grad_(true);
  auto t = torch::randint(40, {50}, torch::kInt64);
  auto g1 = torch::randn({50}, torch::kFloat64), g2 = torch::randn({50}, torch::kFloat64);
  for (std::int64_t chunk : {1, 7, 50, 1000}) {
    auto c = unirl::ops::linear_logprob(h, w, t, chunk);
    auto gc = torch::autograd::grad({(c.logp * g1).sum() + (c.entropy * g2).sum()}, {h, w});
    auto r = unirl::ops::token_logprob<unirl::exec::reference>(torch::matmul(h, w.t()), t);
    auto gr = torch::autograd::grad({(r.logp * g1).sum() + (r.entropy * g2).sum()}, {h, w});
    INFO("chunk " << chunk);
    CHECK(max_diff(c.logp, r.logp) < 1e-12);
    CHECK(max_diff(c.entropy, r.entropy) < 1e-12);
    CHECK(max_diff(gc[0], gr[0]) < 1e-10);
    CHECK(max_diff(gc[1], gr[1]) < 1e-10);
  }
}

TEST_CASE("chunked linear log-prob with a frozen head: the hidden gradient alone, equal to the materialised one",
          "[cpu][ops]") {
  torch::manual_seed(3);
  auto h = torch::randn({30, 8}, torch::kFloat64).requires_grad_(true);
  const auto w = torch::randn({20, 8}, torch::kFloat64);  // frozen (a LoRA base's tied embedding)
  const auto t = torch::randint(20, {30}, torch::kInt64);
  const auto g = torch::randn({30}, torch::kFloat64);
  auto c = unirl::ops::linear_logprob(h, w, t, 7);
  (c.logp * g).sum().backward();
  const auto gc = h.grad().clone();
  h.mutable_grad().reset();
  auto r = unirl::ops::token_logprob<unirl::exec::reference>(torch::matmul(h, w.t()), t);
  (r.logp * g).sum().backward();
  CHECK(max_diff(gc, h.grad()) < 1e-10);
  CHECK_FALSE(w.grad().defined());
  // and a frozen input with a trained head: the head's gradient alone
  const auto hf = h.detach();
  auto wt = w.clone().requires_grad_(true);
  auto c2 = unirl::ops::linear_logprob(hf, wt, t, 7);
  const auto gw = torch::autograd::grad({(c2.logp * g).sum()}, {wt})[0];
  auto r2 = unirl::ops::token_logprob<unirl::exec::reference>(torch::matmul(hf, wt.t()), t);
  const auto gwr = torch::autograd::grad({(r2.logp * g).sum()}, {wt})[0];
  CHECK(max_diff(gw, gwr) < 1e-10);
}

TEST_CASE("log-prob ops name bad shapes and targets", "[cpu][ops]") {
  auto logits = torch::zeros({3, 5});
  CHECK_THROWS_WITH(unirl::ops::token_logprob(logits, torch::tensor({0, 5, 1}, torch::kInt64)),
                    "unirl: token_logprob: targets range over [0, 5], outside the vocabulary [0, 5)");
  CHECK_THROWS_WITH(unirl::ops::token_logprob(logits, torch::zeros({4}, torch::kInt64)),
                    "unirl: token_logprob: targets must be (3,), got shape [4]");
  CHECK_THROWS_WITH(unirl::ops::token_logprob(torch::zeros({3}), torch::zeros({3}, torch::kInt64)),
                    "unirl: token_logprob: logits must be (N, V), got shape [3]");
  CHECK_THROWS_WITH(unirl::ops::linear_logprob(torch::zeros({3, 4}), torch::zeros({5, 4}), torch::zeros({3}, torch::kInt64), 0),
                    "unirl: linear_logprob: chunk = 0: expected >= 1");
}

namespace {
// A causal mask with some keys dropped per batch row: (B, 1, n, S), 0 or -inf, every query keeps a key.
torch::Tensor attention_mask(std::int64_t B, std::int64_t n, std::int64_t S, torch::Dtype dtype) {
  const auto inf = std::numeric_limits<double>::infinity();
  auto allowed = torch::ones({B, 1, n, S}, torch::kBool).tril(S - n);
  allowed.select(0, 0).select(2, 0).fill_(false);  // batch row 0 never sees key 0 (padding)
  allowed.select(2, n - 1).fill_(true);             // the last query sees everything
  for (std::int64_t i = 0; i < n; ++i) allowed.select(2, i).select(2, S - n + i).fill_(true);  // itself
  return torch::zeros(allowed.sizes(), torch::dtype(dtype)).masked_fill(allowed.logical_not(), -inf);
}
}  // namespace

TEST_CASE("fused attention equals the reference, values and gradients, with masks and strided inputs",
          "[cpu][ops][attention]") {
  torch::manual_seed(3);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
    const std::int64_t B = 3, H = 2, n = 5, S = 7, D = 8;
    // q arrives as a permuted view (B, H, n, D) of (B, n, H, D), as in a transformer block
    auto q = torch::randn({B, n, H, D}, torch::dtype(dtype)).requires_grad_(true);
    auto k = torch::randn({B, H, S, D}, torch::dtype(dtype)).requires_grad_(true);
    auto v = torch::randn({B, H, S, D}, torch::dtype(dtype)).requires_grad_(true);
    const auto bias = attention_mask(B, n, S, dtype);
    const auto g = torch::randn({B, H, n, D}, torch::dtype(dtype));
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    for (const auto& b : {bias, torch::Tensor()}) {
      const auto fused = unirl::ops::attention<unirl::exec::cpu>(q.permute({0, 2, 1, 3}), k, v, b, scale);
      const auto ref = unirl::ops::attention<unirl::exec::reference>(q.permute({0, 2, 1, 3}), k, v, b, scale);
      CHECK(max_diff(fused, ref) < tol);
      const auto gf = torch::autograd::grad({(fused * g).sum()}, {q, k, v});
      const auto gr = torch::autograd::grad({(ref * g).sum()}, {q, k, v});
      for (int i = 0; i < 3; ++i) CHECK(max_diff(gf[static_cast<std::size_t>(i)], gr[static_cast<std::size_t>(i)]) < tol);
    }
    // masked keys get exactly no gradient through k and v (row 0's key 0 is seen by the last query only)
    const auto only_last = torch::zeros({B, H, n, D}, torch::dtype(dtype));
    only_last.slice(2, 0, n - 1).copy_(g.slice(2, 0, n - 1));
    const auto out = unirl::ops::attention<unirl::exec::cpu>(q.permute({0, 2, 1, 3}), k, v, bias, scale);
    const auto gk = torch::autograd::grad({(out * only_last).sum()}, {k})[0];
    CHECK(gk[0].select(1, 0).abs().max().item<double>() == 0.0);
  }
}

TEST_CASE("fused attention: hand-computed values, finite differences, a fully masked row, bad shapes",
          "[cpu][ops][attention]") {
  // one query q = 1, keys (1, 2), values (3, 5), scale 1: p = (1, e) / (1 + e), y = (3 + 5e) / (1 + e)
  const auto q = torch::ones({1, 1, 1, 1}, torch::kFloat64);
  const auto k = torch::tensor({1.0, 2.0}, torch::kFloat64).view({1, 1, 2, 1});
  const auto v = torch::tensor({3.0, 5.0}, torch::kFloat64).view({1, 1, 2, 1});
  const double e = std::exp(1.0);
  CHECK(unirl::ops::attention<unirl::exec::cpu>(q, k, v, {}, 1.0).item<double>() ==
        Approx((3 + 5 * e) / (1 + e)).epsilon(1e-12));
  // masking the second key leaves the first value
  const auto b = torch::tensor({0.0, -std::numeric_limits<double>::infinity()}, torch::kFloat64).view({1, 1, 1, 2});
  CHECK(unirl::ops::attention<unirl::exec::cpu>(q, k, v, b, 1.0).item<double>() == 3.0);
  // finite differences in q, k, v together
  torch::manual_seed(4);
  const auto x0 = torch::randn({2 * 2 * 3 * 4 + 2 * 2 * 5 * 4 * 2}, torch::kFloat64);
  const auto bias = attention_mask(2, 3, 5, torch::kFloat64);
  auto f = [&](const torch::Tensor& x) {
    const auto qq = x.slice(0, 0, 48).view({2, 2, 3, 4});
    const auto kk = x.slice(0, 48, 128).view({2, 2, 5, 4});
    const auto vv = x.slice(0, 128, 208).view({2, 2, 5, 4});
    const auto y = unirl::ops::attention<unirl::exec::cpu>(qq, kk, vv, bias, 0.5);
    return (y * torch::arange(48, torch::kFloat64).view({2, 2, 3, 4}).cos()).sum();
  };
  auto xg = x0.clone().requires_grad_(true);
  const auto analytic = torch::autograd::grad({f(xg)}, {xg})[0];
  auto numeric = torch::zeros_like(x0);
  const double h = 1e-6;
  for (std::int64_t i = 0; i < x0.numel(); ++i) {
    auto xp = x0.clone(), xm = x0.clone();
    xp[i] += h;
    xm[i] -= h;
    numeric[i] = (f(xp).item<double>() - f(xm).item<double>()) / (2 * h);
  }
  CHECK(max_diff(analytic, numeric) < 1e-7);
  // every key masked: NaN, as softmax over nothing in the reference
  const auto none = torch::full({1, 1, 1, 2}, -std::numeric_limits<double>::infinity(), torch::kFloat64);
  CHECK(std::isnan(unirl::ops::attention<unirl::exec::cpu>(q, k, v, none, 1.0).item<double>()));
  CHECK(std::isnan(unirl::ops::attention<unirl::exec::reference>(q, k, v, none, 1.0).item<double>()));
  CHECK_THROWS_WITH(unirl::ops::attention(q, k.view({1, 2, 1, 1}), v, {}, 1.0), Catch::Contains("must be (B, H, S, Dh)"));
  CHECK_THROWS_WITH(unirl::ops::attention(q.view({1, 1, 1}), k, v, {}, 1.0), Catch::Contains("q, k, v must be"));
}

TEST_CASE("linear log-prob: the reference materialises the logits, the chunked paths equal it", "[cpu][ops]") {
  torch::manual_seed(3);
  auto h = torch::randn({29, 12}, torch::kFloat64).requires_grad_(true);
  auto w = torch::randn({41, 12}, torch::kFloat64).requires_grad_(true);
  const auto t = torch::randint(41, {29}, torch::kInt64);
  const auto g1 = torch::randn({29}, torch::kFloat64), g2 = torch::randn({29}, torch::kFloat64);
  // The reference is token_logprob of the materialised logits, by construction.
  const auto m = unirl::ops::token_logprob<unirl::exec::reference>(torch::mm(h, w.t()), t);
  const auto gm = torch::autograd::grad({(m.logp * g1).sum() + (m.entropy * g2).sum()}, {h, w});
  for (auto* name : {"reference", "cpu"}) {
    const auto r = std::string(name) == "reference" ? unirl::ops::linear_logprob<unirl::exec::reference>(h, w, t, 5)
                                                    : unirl::ops::linear_logprob<unirl::exec::cpu>(h, w, t, 5);
    const auto g = torch::autograd::grad({(r.logp * g1).sum() + (r.entropy * g2).sum()}, {h, w});
    INFO(name);
    CHECK(max_diff(r.logp, m.logp) < 1e-12);
    CHECK(max_diff(r.entropy, m.entropy) < 1e-12);
    CHECK(max_diff(g[0], gm[0]) < 1e-12);
    CHECK(max_diff(g[1], gm[1]) < 1e-12);
  }
}

TEST_CASE("fused Gaussian log-prob equals the reference and the formula, values and mean gradients", "[cpu][ops]") {
  torch::manual_seed(4);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
    for (bool mean_reduction : {true, false}) {
      const auto x = torch::randn({6, 3, 5, 7}, torch::dtype(dtype));
      auto mean = (x + 0.3 * torch::randn({6, 3, 5, 7}, torch::dtype(dtype))).requires_grad_(true);
      const auto g = torch::randn({6}, torch::dtype(dtype));
      const double std = 0.37;
      const auto f = unirl::ops::gaussian_logprob<unirl::exec::cpu>(x, mean, std, mean_reduction);
      const auto gf = torch::autograd::grad({(f * g).sum()}, {mean})[0];
      const auto r = unirl::ops::gaussian_logprob<unirl::exec::reference>(x, mean, std, mean_reduction);
      const auto gr = torch::autograd::grad({(r * g).sum()}, {mean})[0];
      INFO("dtype " << dtype << " mean_reduction " << mean_reduction);
      CHECK(max_diff(f, r) / r.abs().max().item<double>() < tol);
      CHECK(max_diff(gf, gr) / gr.abs().max().item<double>() < tol);
      // The formula, written out for sample 0 in float64.
      const auto d = (x[0] - mean[0]).to(torch::kFloat64).detach().flatten();
      double s = 0;
      for (std::int64_t j = 0; j < d.size(0); ++j) {
        const double dj = d[j].item<double>();
        s += -dj * dj / (2 * std * std) - std::log(std) - 0.5 * std::log(2 * M_PI);
      }
      if (mean_reduction) s /= static_cast<double>(d.size(0));
      CHECK(std::abs(f[0].item<double>() - s) < tol * std::abs(s));
    }
  }
  CHECK_THROWS_WITH(unirl::ops::gaussian_logprob(torch::zeros({2, 3}), torch::zeros({2, 4}), 1.0, true),
                    Catch::Matchers::Contains("gaussian_logprob: x_next sizes [2, 3] differ from the mean's [2, 4]"));
  CHECK_THROWS_WITH(unirl::ops::gaussian_logprob(torch::zeros({2, 3}), torch::zeros({2, 3}), 0.0, true),
                    Catch::Matchers::Contains("gaussian_logprob: std = 0: expected a finite value > 0"));
}

TEST_CASE("paged decode: the fused CPU loop equals the gathered reference, grouped heads and padding", "[cpu][ops]") {
  torch::manual_seed(5);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
    auto c = unirl_test::make_paged_decode_case({1, 7, 20, 33, 3}, 4, 2, 16, 120, torch::dtype(dtype));
    const auto f = c.run<unirl::exec::cpu>();
    const auto r = c.run<unirl::exec::reference>();
    INFO("dtype " << dtype);
    CHECK(max_diff(f, r) / r.abs().max().item<double>() < tol);
    // Sequence 0 attends to its one key alone: its output is that key's value.
    const auto own = c.batch.write_slots[0].item<std::int64_t>();
    CHECK(max_diff(f[0].select(0, 0), c.v_pool[own].select(0, 0)) < tol);
  }
}
