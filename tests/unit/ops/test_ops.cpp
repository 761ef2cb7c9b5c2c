// Hot ops: every implementation against the LibTorch reference, gradients against finite differences.
#include <catch2/catch.hpp>

#include <unirl/ops/logprob.hpp>

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
