// CUDA kernels against the LibTorch reference (built with -DUNIRL_ENABLE_CUDA=ON; run on a GPU).
#include <catch2/catch.hpp>

#include <unirl/ops/logprob.hpp>

TEST_CASE("CUDA token log-prob and entropy equal the reference, values and gradients", "[cuda][ops]") {
  if (!torch::cuda::is_available()) SKIP("no CUDA device");
  torch::manual_seed(0);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    for (std::int64_t v : {7, 256, 32000}) {
      const double tol = dtype == torch::kFloat64 ? 1e-10 : 1e-4;
      auto logits = (torch::randn({33, v}, torch::dtype(dtype)) * 3).to(torch::kCUDA).requires_grad_(true);
      auto targets = torch::randint(v, {33}, torch::kInt64).to(torch::kCUDA);
      auto g1 = torch::randn({33}, logits.options()), g2 = torch::randn({33}, logits.options());
      auto k = unirl::ops::token_logprob<unirl::exec::cuda>(logits, targets);
      auto gk = torch::autograd::grad({(k.logp * g1).sum() + (k.entropy * g2).sum()}, {logits})[0];
      auto r = unirl::ops::token_logprob<unirl::exec::reference>(logits, targets);
      auto gr = torch::autograd::grad({(r.logp * g1).sum() + (r.entropy * g2).sum()}, {logits})[0];
      INFO("V = " << v << " dtype " << dtype);
      CHECK((k.logp - r.logp).abs().max().item<double>() < tol);
      CHECK((k.entropy - r.entropy).abs().max().item<double>() < tol);
      CHECK((gk - gr).abs().max().item<double>() < tol);
    }
  }
}
