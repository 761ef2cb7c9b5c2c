// The shared loss maths (docs/algorithms/ppo.md, docs/algorithms/grpo.md): every value below is worked by hand from the
// formulas; gradients are checked against central finite differences in double precision.
#include <cmath>
#include <functional>
#include <vector>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/algorithms/grpo.hpp>
#include <unirl/algorithms/kl.hpp>
#include <unirl/algorithms/loss_agg.hpp>
#include <unirl/algorithms/policy_loss.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/algorithms/token_common.hpp>

using namespace unirl::algo;

namespace {
torch::Tensor f(std::vector<float> v) { return torch::tensor(v, torch::kFloat); }
torch::Tensor d(std::vector<double> v) { return torch::tensor(v, torch::kDouble); }
bool close(const torch::Tensor& a, const torch::Tensor& b, double tol = 1e-5) {
  return a.sizes() == b.sizes() && (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() <= tol;
}
// Max |autograd - central difference| of sum(fn(x)) with respect to x (double).
double fd_error(const std::function<torch::Tensor(const torch::Tensor&)>& fn, torch::Tensor x, double h = 1e-6) {
  x = x.clone().set_requires_grad(true);
  fn(x).sum().backward();
  const auto g = x.grad().clone();
  double worst = 0;
  torch::NoGradGuard ng;
  for (int64_t i = 0; i < x.numel(); ++i) {
    auto xp = x.detach().clone(), xm = x.detach().clone();
    xp.view(-1)[i] += h;
    xm.view(-1)[i] -= h;
    const double num = (fn(xp).sum().item<double>() - fn(xm).sum().item<double>()) / (2 * h);
    worst = std::max(worst, std::abs(num - g.view(-1)[i].item<double>()));
  }
  return worst;
}
}  // namespace

TEST_CASE("group_advantage: GRPO, biased std and Dr.GRPO by hand", "[cpu][token][advantage]") {
  const auto r = f({1, 0, 0, 1});
  // mean 0.5, unbiased std sqrt(0.5): 0.5 / (0.70710678 + 1e-6) = 0.70710578
  CHECK(close(group_advantage(r, 2), f({0.70710578f, -0.70710578f, -0.70710578f, 0.70710578f})));
  // population std 0.5: 0.5 / (0.5 + 1e-6)
  CHECK(close(group_advantage(r, 2, {.unbiased_std = false}), f({0.999998f, -0.999998f, -0.999998f, 0.999998f})));
  CHECK(close(group_advantage(r, 2, {.scale_by_std = false}), f({0.5f, -0.5f, -0.5f, 0.5f})));
  CHECK(close(group_advantage(f({3, 1, 2, 10, 10, 10}), 3, {.scale_by_std = false}), f({1, -1, 0, 0, 0, 0})));
}

TEST_CASE("group_advantage: a group of one or of equal rewards gives exactly 0, never NaN", "[cpu][token][advantage]") {
  const auto seven = torch::full({7}, 0.7f);
  const auto a = group_advantage(seven, 7);
  CHECK(torch::equal(a, torch::zeros({7})));
  CHECK(torch::equal(group_advantage(f({0.3f, 5.f, -1.f}), 1), torch::zeros({3})));
  CHECK(torch::equal(rloo_advantage(seven, 7), torch::zeros({7})));
  CHECK(torch::equal(rloo_advantage(f({1.f, 2.f}), 1), torch::zeros({2})));
  CHECK_FALSE(torch::isnan(group_advantage(f({0, 0, 1, 1}), 2)).any().item<bool>());
  CHECK_THROWS_WITH(group_advantage(f({1, 2, 3}), 2), Catch::Contains("group_size = 2"));
  CHECK_THROWS_WITH(group_advantage(torch::zeros({2, 2}), 2), Catch::Contains("1-D"));
}

TEST_CASE("rloo_advantage equals r_i minus the mean of the others", "[cpu][token][advantage]") {
  // {1,2,3}: 1 - 2.5 = -1.5, 2 - 2 = 0, 3 - 1.5 = 1.5
  CHECK(close(rloo_advantage(f({1, 2, 3, 0, 4, 2}), 3), f({-1.5f, 0.f, 1.5f, -3.f, 3.f, 0.f})));
}

TEST_CASE("gae: hand-worked CleanRL recursion with dones", "[cpu][token][advantage]") {
  const auto r = d({1, 1}).view({2, 1}), v = d({0.5, 0.5}).view({2, 1});
  // delta_1 = 1 + .9 * .5 - .5 = .95; A_0 = .95 + .9 * .8 * .95 = 1.634
  auto g = gae(r, v, torch::zeros({2, 1}, torch::kDouble), d({0.5}), d({0}), 0.9, 0.8);
  CHECK(close(g.advantages, d({1.634, 0.95}).view({2, 1}), 1e-12));
  CHECK(close(g.returns, d({2.134, 1.45}).view({2, 1}), 1e-12));
  // obs 1 starts a new episode: step 0 does not bootstrap; next_done cuts the last step.
  g = gae(r, v, d({0, 1}).view({2, 1}), d({0.5}), d({1}), 0.9, 0.8);
  CHECK(close(g.advantages, d({0.5, 0.5}).view({2, 1}), 1e-12));
}

TEST_CASE("gae: fused CPU pass equals the textbook loop on random data", "[cpu][token][advantage]") {
  torch::manual_seed(3);
  const int64_t T = 17, N = 5;
  const auto r = torch::randn({T, N}), v = torch::randn({T, N});
  const auto dn = (torch::rand({T, N}) < 0.2).to(torch::kFloat);
  const auto nv = torch::randn({N}), nd = (torch::rand({N}) < 0.5).to(torch::kFloat);
  const auto g = gae(r, v, dn, nv, nd, 0.99, 0.95);
  auto expect = torch::zeros({T, N}, torch::kDouble);
  for (int64_t n = 0; n < N; ++n) {
    double last = 0;
    for (int64_t t = T - 1; t >= 0; --t) {
      const double nonterm = 1.0 - (t == T - 1 ? nd[n].item<double>() : dn[t + 1][n].item<double>());
      const double nextv = t == T - 1 ? nv[n].item<double>() : v[t + 1][n].item<double>();
      last = r[t][n].item<double>() + 0.99 * nextv * nonterm - v[t][n].item<double>() + 0.99 * 0.95 * nonterm * last;
      expect[t][n] = last;
    }
  }
  CHECK(close(g.advantages, expect, 1e-5));
  CHECK(close(g.returns, expect + v.to(torch::kDouble), 1e-5));
  CHECK_THROWS_WITH(gae(r, v, dn, nv, nd, 1.5, 0.95), Catch::Contains("gamma = 1.5"));
}

TEST_CASE("normalize and masked_normalize whiten with the unbiased std", "[cpu][token][advantage]") {
  CHECK(close(normalize(f({1, 2, 3})), f({-1, 0, 1}), 1e-6));
  CHECK(close(masked_normalize(f({1, 100, 2, 3}), f({1, 0, 1, 1})), f({-1, 0, 0, 1}), 1e-6));
  CHECK(torch::equal(normalize(f({4})), f({0})));
}

TEST_CASE("ppo_clip_loss by hand: clip, clip-higher, dual clip", "[cpu][token][policy_loss]") {
  const auto lp = torch::log(f({1.5f, 1.5f, 0.5f, 0.5f, 5.f}));
  const auto old = torch::zeros({5});
  const auto adv = f({1, -1, 1, -1, -1});
  auto r = ppo_clip_loss(lp, old, adv, 0.2, 0.2);
  // max(-1.5, -1.2); max(1.5, 1.2); max(-0.5, -0.8); max(0.5, 0.8); max(5, 1.2)
  CHECK(close(r.loss, f({-1.2f, 1.5f, -0.5f, 0.8f, 5.f})));
  CHECK(torch::equal(r.clipped, torch::tensor({true, false, false, true, false})));
  CHECK(close(r.ratio, f({1.5f, 1.5f, 0.5f, 0.5f, 5.f})));
  r = ppo_clip_loss(lp, old, adv, 0.2, 0.28);
  CHECK(r.loss[0].item<float>() == Approx(-1.28f));
  r = ppo_clip_loss(lp, old, adv, 0.2, 0.2, 3.0);  // A < 0 capped at -A c = 3
  CHECK(close(r.loss, f({-1.2f, 1.5f, -0.5f, 0.8f, 3.f})));
  CHECK(r.clipped[4].item<bool>());
  CHECK_THROWS_WITH(ppo_clip_loss(lp, old, adv, 0.2, 0.2, 0.5), Catch::Contains("dual_clip = 0.5"));
  CHECK_THROWS_WITH(ppo_clip_loss(lp, old, adv.slice(0, 0, 3), 0.2, 0.2), Catch::Contains("differ"));
}

TEST_CASE("ppo_clip_loss: on-policy ratio is exactly 1, gradient matches finite differences", "[cpu][token][policy_loss]") {
  torch::manual_seed(0);
  const auto old = torch::randn({4, 6}, torch::kDouble);
  const auto adv = torch::randn({4, 6}, torch::kDouble);
  const auto r = ppo_clip_loss(old.clone(), old, adv, 0.2, 0.28);
  CHECK(torch::equal(r.ratio, torch::ones_like(old)));
  CHECK_FALSE(r.clipped.any().item<bool>());
  // -d/dlogp (A rho) = -A at rho = 1
  auto lp = old.clone().set_requires_grad(true);
  ppo_clip_loss(lp, old, adv, 0.2, 0.28).loss.sum().backward();
  CHECK(close(lp.grad(), -adv, 1e-12));
  const auto x = old + 0.3 * torch::randn({4, 6}, torch::kDouble);
  CHECK(fd_error([&](const torch::Tensor& l) { return ppo_clip_loss(l, old, adv, 0.2, 0.28, 3.0).loss; }, x) < 1e-6);
}

TEST_CASE("dppo_mask_loss by hand", "[cpu][token][policy_loss]") {
  const auto old = torch::log(f({0.5f, 0.5f, 0.5f}));
  const auto lp = torch::log(f({0.8f, 0.8f, 0.6f}));
  const auto adv = f({1, -1, 1});
  const auto r = dppo_mask_loss(lp, old, adv, 0.15);
  // 1: A(rho-1) = .6 > 0 and |.8-.5| > .15: dropped. 2: A(rho-1) < 0: kept, -A rho = 1.6. 3: |dp| = .1: kept, -1.2
  CHECK(close(r.loss, f({0.f, 1.6f, -1.2f})));
  CHECK(torch::equal(r.clipped, torch::tensor({true, false, false})));
  const auto od = old.to(torch::kDouble), ad = adv.to(torch::kDouble);
  CHECK(fd_error([&](const torch::Tensor& l) { return dppo_mask_loss(l, od, ad, 0.15).loss; }, lp.to(torch::kDouble)) < 1e-6);
}

TEST_CASE("value_loss by hand, clipped and unclipped", "[cpu][token][policy_loss]") {
  // (2,1,0): max(4, 2.25) -> 2; (1.4,1,1.5): max(.01, .09) -> .045; (0,1,1): max(1, .25) -> .5
  const auto v = f({2.f, 1.4f, 0.f}), vo = f({1.f, 1.f, 1.f}), R = f({0.f, 1.5f, 1.f});
  CHECK(close(value_loss(v, vo, R, 0.2), f({2.f, 0.045f, 0.5f})));
  CHECK(close(value_loss(v, vo, R, 0.0), f({2.f, 0.005f, 0.5f})));
  const auto vd = v.to(torch::kDouble) + 0.013, vod = vo.to(torch::kDouble), Rd = R.to(torch::kDouble);
  CHECK(fd_error([&](const torch::Tensor& x) { return value_loss(x, vod, Rd, 0.2); }, vd) < 1e-6);
}

TEST_CASE("kl_penalty k1/k2/k3 by hand, k3 clamped like verl", "[cpu][token][kl]") {
  const auto lp = f({0.5f, 30.f, -30.f}), ref = torch::zeros({3});
  CHECK(close(kl_penalty(lp, ref, kl_estimator::k1), f({0.5f, 30.f, -30.f})));
  CHECK(close(kl_penalty(lp, ref, kl_estimator::k2), f({0.125f, 450.f, 450.f})));
  // exp(-.5) - 1 + .5 = 0.10653066; l = 30 -> clamp 20 -> 19.000000002 -> clamp 10; l = -30 -> exp(20) - 21 -> 10
  CHECK(close(kl_penalty(lp, ref, kl_estimator::k3), f({0.10653066f, 10.f, 10.f})));
  CHECK(torch::equal(kl_penalty(ref, ref, kl_estimator::k3), torch::zeros({3})));
  torch::manual_seed(1);
  const auto a = torch::randn({8}, torch::kDouble), b = torch::randn({8}, torch::kDouble);
  for (auto e : {kl_estimator::k1, kl_estimator::k2, kl_estimator::k3})
    CHECK(fd_error([&](const torch::Tensor& x) { return kl_penalty(x, b, e); }, a) < 1e-6);
}

TEST_CASE("aggregate: the three loss_agg modes by hand", "[cpu][token][loss_agg]") {
  const auto x = f({1, 2, 3, 4, 5, 6}).view({2, 3});
  const auto m = f({1, 1, 0, 1, 0, 0}).view({2, 3});
  CHECK(aggregate(x, m, loss_agg::token_mean, 0).item<float>() == Approx(7.0 / 3.0));
  CHECK(aggregate(x, m, loss_agg::seq_mean_token_mean, 0).item<float>() == Approx(2.75));
  CHECK(aggregate(x, m, loss_agg::seq_mean_token_sum_norm, 4).item<float>() == Approx(0.875));
  // a fully masked sequence counts as one sequence contributing 0; NaN in a masked slot stays out
  const auto y = f({1, 2, NAN, 4}).view({2, 2});
  const auto my = f({1, 1, 0, 0}).view({2, 2});
  CHECK(aggregate(y, my, loss_agg::seq_mean_token_mean, 0).item<float>() == Approx(0.75));
  CHECK(aggregate(y, my, loss_agg::token_mean, 0).item<float>() == Approx(1.5));
  CHECK_THROWS_WITH(aggregate(x, m, loss_agg::seq_mean_token_sum_norm, 0), Catch::Contains("max_len"));
}

TEST_CASE("ppo_loss combines the shared terms by hand", "[cpu][token][ppo]") {
  ppo_eval ev;
  ev.logp = torch::log(f({1.5f, 0.5f})).view({1, 2}).requires_grad_(true);
  ev.old_logp = torch::zeros({1, 2});
  ev.advantages = f({1, -1}).view({1, 2});
  ev.mask = torch::ones({1, 2});
  ev.values = f({2.f, 0.f}).view({1, 2});
  ev.old_values = f({1.f, 1.f}).view({1, 2});
  ev.returns = f({0.f, 1.f}).view({1, 2});
  ev.entropy = f({1.f, 3.f}).view({1, 2});
  ev.ref_logp = torch::zeros({1, 2});
  ppo_options o{.vf_coef = 0.5, .ent_coef = 0.1, .kl_coef = 0.2, .kl = kl_estimator::k1, .kl_in_reward = false,
                .norm_adv = false};
  const auto t = ppo_loss(o, ev);
  // policy: mean(-1.2, 0.8) = -0.2; value: mean(2, 0.5) = 1.25; entropy 2; k1 kl: mean(log 1.5, log .5)
  const double kl = (std::log(1.5) + std::log(0.5)) / 2;
  CHECK(t.policy == Approx(-0.2));
  CHECK(t.value == Approx(1.25));
  CHECK(t.entropy == Approx(2.0));
  CHECK(t.kl == Approx(kl));
  CHECK(t.total.item<double>() == Approx(-0.2 + 0.5 * 1.25 - 0.1 * 2.0 + 0.2 * kl));
  CHECK(t.clip_fraction == Approx(1.0));  // both terms sit on the clipped branch
  CHECK(t.ratio_mean == Approx(1.0));
  o.kl_in_reward = true;  // the KL then lives in the reward: measured, not added
  CHECK(ppo_loss(o, ev).total.item<double>() == Approx(-0.2 + 0.5 * 1.25 - 0.1 * 2.0));
}

TEST_CASE("overlong_penalty is DAPO's soft penalty", "[cpu][token][grpo]") {
  const auto L = torch::tensor({6, 8, 10, 11}, torch::kInt64);
  CHECK(close(overlong_penalty(L, 10, 4), f({0.f, -0.5f, -1.f, -1.f})));
}

TEST_CASE("grpo and ppo options validate and parse by name", "[cpu][token][options]") {
  grpo_options o;
  unirl::options::apply_overrides(o, {"advantage=rloo", "agg=token_mean", "clip_high=0.28", "sampling.top_k=5"});
  CHECK(o.advantage == advantage_kind::rloo);
  CHECK(o.agg == loss_agg::token_mean);
  CHECK(o.sampling.top_k == 5);
  CHECK_THROWS_AS(unirl::options::apply_overrides(o, {"clip_low=1.5"}), unirl::config_error);
  CHECK_THROWS_WITH(unirl::options::apply_overrides(o, {"kl=k4"}), Catch::Contains("k3"));
  ppo_options p;
  CHECK_THROWS_WITH(unirl::options::apply_overrides(p, {"gamma=2"}), Catch::Contains("gamma"));
  CHECK_THROWS_WITH(grpo<>(grpo_options{.dual_clip = 0.5}), Catch::Contains("dual_clip"));
}

// ---- Every free function in float64 against hand values at 1e-12 (issue 15): the result keeps
// the input's floating type, and the numbers are worked from the formulas of docs/algorithms.
namespace {
bool is_f64(const torch::Tensor& t) { return t.defined() && t.scalar_type() == torch::kDouble; }
bool exact(const torch::Tensor& a, const torch::Tensor& b) { return is_f64(a) && close(a, b, 1e-12); }
}  // namespace

TEST_CASE("float64: GRPO, Dr.GRPO and RLOO advantages by hand", "[cpu][token][advantage][f64]") {
  const auto r = d({0, 2, 4, 5, 5, 5});  // two groups of 3; the second all equal -> exactly 0
  // mean 2, deviations -2, 0, 2; unbiased std sqrt(8/2) = 2: 2 / (2 + 1e-6) = 0.99999950000025
  const double a = 2.0 / 2.000001;
  CHECK(exact(group_advantage(r, 3), d({-a, 0, a, 0, 0, 0})));
  CHECK(exact(estimate<unirl::exec::reference>(group_normalized{}, r, 3), d({-a, 0, a, 0, 0, 0})));
  // population std sqrt(8/3) = 1.632993161855452: 2 / (1.632993161855452 + 1e-6) = 1.224744121392048
  CHECK(exact(group_advantage(r, 3, {.unbiased_std = false}), d({-1.224744121392048, 0, 1.224744121392048, 0, 0, 0})));
  // Dr.GRPO: r - mean_g = -2, 0, 2
  CHECK(exact(group_advantage(r, 3, {.scale_by_std = false}), d({-2, 0, 2, 0, 0, 0})));
  CHECK(exact(estimate<unirl::exec::automatic>(dr_grpo{}, r, 3), d({-2, 0, 2, 0, 0, 0})));
  // RLOO: r_i - mean of the others: 0 - 3 = -3, 2 - 2 = 0, 4 - 1 = 3
  CHECK(exact(rloo_advantage(r, 3), d({-3, 0, 3, 0, 0, 0})));
  CHECK(exact(estimate<unirl::exec::reference>(rloo{}, r, 3), d({-3, 0, 3, 0, 0, 0})));
}

TEST_CASE("float64: token rewards, discounted returns and REINFORCE++ by hand", "[cpu][token][advantage][f64]") {
  const auto mask = d({1, 1, 1, 1, 1, 0}).view({2, 3});
  const auto outcome = d({1, -1});
  const auto old = d({0.1, -0.2, 0.3, 0.5, 0.0, 9.0}).view({2, 3}), ref = torch::zeros({2, 3}, torch::kDouble);
  // r_t = -0.5 (old - ref)_t m_t, outcome on the last valid token (row 0: t = 2, row 1: t = 1):
  // row 0: -0.05, 0.1, -0.15 + 1 = 0.85; row 1: -0.25, 0 - 1 = -1, masked 0
  const auto tok = token_level_rewards(outcome, mask, old - ref, 0.5);
  CHECK(exact(tok, d({-0.05, 0.1, 0.85, -0.25, -1, 0}).view({2, 3})));
  CHECK(exact(token_level_rewards(outcome, mask), d({0, 0, 1, 0, -1, 0}).view({2, 3})));
  // G_t = r_t + 0.9 m_t G_{t+1}: row 0: G2 = 0.85, G1 = 0.1 + 0.9 * 0.85 = 0.865, G0 = -0.05 + 0.9 * 0.865 = 0.7285;
  // row 1: G2 = 0, G1 = -1, G0 = -0.25 + 0.9 * -1 = -1.15
  CHECK(exact(discounted_returns(tok, mask, 0.9), d({0.7285, 0.865, 0.85, -1.15, -1, 0}).view({2, 3})));
  // Whitened over the 5 valid returns: mean 0.2935 / 5 = 0.0587, unbiased var 4.3067088 / 4 = 1.0766772,
  // std 1.037630570097084; (G - 0.0587) / (std + 1e-8)
  const auto expect = d({0.6455091174523126, 0.7770588256222748, 0.7626028137354658, -1.1648654378390717,
                         -1.0203053189709814, 0})
                          .view({2, 3});
  CHECK(exact(reinforce_pp_advantage(outcome, mask, old, ref, 0.5, 0.9), expect));
  CHECK(exact(reinforce_pp_advantage<unirl::exec::reference>(outcome, mask, old, ref, 0.5, 0.9), expect));
  CHECK_THROWS_WITH(token_level_rewards(d({1}), mask), Catch::Contains("1 outcome rewards for 2 completions"));
}

TEST_CASE("float64: GAE along each completion (token track) by hand", "[cpu][token][advantage][f64]") {
  const auto mask = d({1, 1, 0, 1, 1, 1}).view({2, 3});
  const auto rew = d({0, 1, 0, 0, 0, 2}).view({2, 3});
  const auto val = d({0.5, 0.25, 7, 1, 1, 1}).view({2, 3});
  const auto g = token_gae(rew, val, mask, 0.9, 0.8);
  // row 0 (ends at t = 1): A1 = 1 - 0.25 = 0.75 (t = 2 starts a new episode: no bootstrap);
  //   A0 = (0 + 0.9 * 0.25 - 0.5) + 0.9 * 0.8 * 0.75 = -0.275 + 0.54 = 0.265; masked slot 0
  // row 1: A2 = 2 - 1 = 1 (nothing after T); A1 = (0.9 - 1) + 0.72 * 1 = 0.62; A0 = -0.1 + 0.72 * 0.62 = 0.3464
  CHECK(exact(g.advantages, d({0.265, 0.75, 0, 0.3464, 0.62, 1}).view({2, 3})));
  CHECK(exact(g.returns, d({0.765, 1.0, 0, 1.3464, 1.62, 2}).view({2, 3})));  // A + V on valid tokens
}

TEST_CASE("float64: GAE over (T, N), whitening and the DAPO masks by hand", "[cpu][token][advantage][f64]") {
  // gae (CleanRL): delta_1 = 1 + 0.9 * 0.5 - 0.5 = 0.95, A_0 = (1 + 0.45 - 0.5) + 0.72 * 0.95 = 1.634
  const auto g = gae(d({1, 1}).view({2, 1}), d({0.5, 0.5}).view({2, 1}), torch::zeros({2, 1}, torch::kDouble),
                     d({0.5}), d({0}), 0.9, 0.8);
  CHECK(exact(g.advantages, d({1.634, 0.95}).view({2, 1})));
  CHECK(exact(gae<unirl::exec::reference>(d({1, 1}).view({2, 1}), d({0.5, 0.5}).view({2, 1}),
                                          torch::zeros({2, 1}, torch::kDouble), d({0.5}), d({0}), 0.9, 0.8)
                  .advantages,
              d({1.634, 0.95}).view({2, 1})));
  // {1, 2, 4}: mean 7/3, unbiased std sqrt(7/3) = 1.5275252316519468; (x - 7/3) / (std + 1e-8)
  CHECK(exact(normalize(d({1, 2, 4})), d({-0.8728715552296838, -0.2182178888074210, 1.0910894440371048})));
  CHECK(exact(masked_normalize(d({1, 100, 2, 4}), d({1, 0, 1, 1})),
              d({-0.8728715552296838, 0, -0.2182178888074210, 1.0910894440371048})));
  CHECK(exact(masked_mean(d({1, 100, 2, 4}), d({1, 0, 1, 1})), d({7.0 / 3.0}).squeeze()));
  // Dynamic sampling keeps groups whose rewards differ; 1e-12 apart is a difference in float64
  // (in float32 both would round to 0.7f).
  CHECK(torch::equal(informative_groups(d({1, 1, 1, 0, 1, 0, 0.7, 0.7 + 1e-12, 0.7}), 3),
                     torch::tensor({false, true, true})));
  CHECK(torch::equal(informative_groups(torch::tensor({3, 3, 1, 2}, torch::kInt64), 2), torch::tensor({false, true})));
  // Overlong penalty, L_max 10, L_c 3: 0 up to 7, (7 - L) / 3 to 10, -1 beyond
  const auto L = torch::tensor({6, 7, 8, 9, 10, 11}, torch::kInt64);
  CHECK(exact(overlong_penalty(L, 10, 3, torch::kDouble), d({0, 0, -1.0 / 3.0, -2.0 / 3.0, -1, -1})));
}

TEST_CASE("float64: clip (clip-higher, dual clip), DPPO mask, value loss, KL and aggregation by hand",
          "[cpu][token][policy_loss][f64]") {
  const auto lp = torch::log(d({1.5, 1.5, 0.5, 0.5, 5.0})), old = torch::zeros({5}, torch::kDouble);
  const auto adv = d({1, -1, 1, -1, -1});
  // clip-higher [0.8, 1.28]: max(-1.5, -1.28), max(1.5, 1.28), max(-0.5, -0.8), max(0.5, 0.8), max(5, 1.28)
  auto r = ppo_clip_loss(lp, old, adv, 0.2, 0.28);
  CHECK(exact(r.loss, d({-1.28, 1.5, -0.5, 0.8, 5.0})));
  CHECK(exact(r.ratio, d({1.5, 1.5, 0.5, 0.5, 5.0})));
  r = ppo_clip_loss(lp, old, adv, 0.2, 0.28, 3.0);  // dual clip: A < 0 capped at -A c = 3
  CHECK(exact(r.loss, d({-1.28, 1.5, -0.5, 0.8, 3.0})));
  // DPPO: (.5 -> .8, A 1): A(rho-1) > 0 and |dp| = .3 > .15: dropped; A -1: kept, -A rho = 1.6; (.5 -> .6): |dp| = .1 kept
  const auto m = dppo_mask_loss(torch::log(d({0.8, 0.8, 0.6})), torch::log(d({0.5, 0.5, 0.5})), d({1, -1, 1}), 0.15);
  CHECK(exact(m.loss, d({0, 1.6, -1.2})));
  // value: 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-0.2) - R)^2): (2, 1, 0): max(4, 1.44) / 2 = 2;
  // (1.4, 1, 1.5): max(0.01, 0.09) / 2 = 0.045; (0, 1, 1): max(1, 0.04) / 2 = 0.5
  const auto v = d({2, 1.4, 0}), vo = d({1, 1, 1}), R = d({0, 1.5, 1});
  CHECK(exact(value_loss(v, vo, R, 0.2), d({2, 0.045, 0.5})));
  CHECK(exact(value_loss(v, vo, R, 0.0), d({2, 0.005, 0.5})));
  // KL with l = {0.5, -0.25, 30}: k1 = l; k2 = l^2 / 2; k3 = e^-l - 1 + l: e^-.5 - .5 = 0.10653065971263342,
  // e^.25 - 1.25 = 0.034025416687741394; l = 30 -> clamp 20 -> 19.000000002 -> clamp 10
  const auto l = d({0.5, -0.25, 30}), z = torch::zeros({3}, torch::kDouble);
  CHECK(exact(kl_penalty(l, z, kl_estimator::k1), d({0.5, -0.25, 30})));
  CHECK(exact(kl_penalty(l, z, kl_estimator::k2), d({0.125, 0.03125, 450})));
  CHECK(exact(kl_penalty(l, z, kl_estimator::k3), d({0.10653065971263342, 0.034025416687741394, 10})));
  // aggregation of {{1, 2, 3}, {4, 5, 6}} under {{1, 1, 0}, {1, 0, 0}}: token_mean 7 / 3;
  // seq_mean_token_mean (1.5 + 4) / 2 = 2.75; seq_mean_token_sum_norm (3 / 4 + 4 / 4) / 2 = 0.875
  const auto x = d({1, 2, 3, 4, 5, 6}).view({2, 3}), mk = d({1, 1, 0, 1, 0, 0}).view({2, 3});
  CHECK(exact(aggregate(x, mk, loss_agg::token_mean, 0), d({7.0 / 3.0}).squeeze()));
  CHECK(exact(aggregate(x, mk, loss_agg::seq_mean_token_mean, 0), d({2.75}).squeeze()));
  CHECK(exact(aggregate(x, mk, loss_agg::seq_mean_token_sum_norm, 4), d({0.875}).squeeze()));
}

TEST_CASE("float64: grpo_loss on given tensors by hand", "[cpu][token][grpo][f64]") {
  grpo_eval ev;
  ev.logp = torch::log(d({1.5, 0.5, 1.1, 2.0})).view({2, 2}).requires_grad_(true);  // rho = these (old = 0)
  ev.old_logp = torch::zeros({2, 2}, torch::kDouble);
  ev.ref_logp = torch::zeros({2, 2}, torch::kDouble);
  ev.advantages = d({1, -1, 0.5, 0.5}).view({2, 2});
  ev.entropy = d({1, 3, 2, 100}).view({2, 2});
  ev.mask = d({1, 1, 1, 0}).view({2, 2});
  const grpo_options o{.clip_high = 0.28, .kl_coef = 0.1, .ent_coef = 0.01};  // k3, seq_mean_token_mean
  const auto t = grpo_loss(o, ev);
  // per token: max(-1.5, -1.28) = -1.28; max(0.5, 0.8) = 0.8; max(-0.55, -0.55) = -0.55 (1.1 inside the clip)
  // seq_mean_token_mean: ((-1.28 + 0.8) / 2 + -0.55) / 2 = -0.395
  // k3 = 1/rho - 1 + ln rho: 0.07213177477483101, 0.3068528194400547, 0.0044010888952339955
  //   -> ((0.07213177477483101 + 0.3068528194400547) / 2 + 0.0044010888952339955) / 2 = 0.09694669300133843
  // entropy ((1 + 3) / 2 + 2) / 2 = 2; total = -0.395 + 0.1 * 0.09694669300133843 - 0.01 * 2
  REQUIRE(is_f64(t.total));
  CHECK(t.total.item<double>() == Approx(-0.4053053306998662).margin(1e-12));
  CHECK(t.policy == Approx(-0.395).margin(1e-12));
  CHECK(t.kl == Approx(0.09694669300133843).margin(1e-12));
  CHECK(t.entropy == Approx(2.0).margin(1e-12));
  CHECK(t.clip_fraction == Approx(2.0 / 3.0).margin(1e-12));  // the first two tokens are on the clipped branch
  CHECK(t.ratio_mean == Approx(3.1 / 3.0).margin(1e-12));
  // REINFORCE++: the KL is in the reward, measured here but not added
  const auto rpp = grpo_loss(grpo_options{.clip_high = 0.28, .kl_coef = 0.1, .advantage = advantage_kind::reinforce_pp,
                                          .ent_coef = 0.01},
                             ev);
  CHECK(rpp.total.item<double>() == Approx(-0.395 - 0.01 * 2).margin(1e-12));
  // gradient of the policy term: the clipped tokens get none; the unclipped one d/dlogp (-A rho) = -A rho
  // = -0.55, over its sequence's 1 valid token and the 2 sequences: -0.275
  const grpo_options plain{.clip_high = 0.28};
  grpo_loss(plain, ev).total.backward();
  CHECK(exact(ev.logp.grad(), d({0, 0, -0.275, 0}).view({2, 2})));
}

TEST_CASE("float64: ppo_loss combines the shared terms by hand", "[cpu][token][ppo][f64]") {
  ppo_eval ev;
  ev.logp = torch::log(d({1.5, 0.5})).view({1, 2}).requires_grad_(true);
  ev.old_logp = torch::zeros({1, 2}, torch::kDouble);
  ev.advantages = d({1, -1}).view({1, 2});
  ev.mask = torch::ones({1, 2}, torch::kDouble);
  ev.values = d({2, 0}).view({1, 2});
  ev.old_values = d({1, 1}).view({1, 2});
  ev.returns = d({0, 1}).view({1, 2});
  ev.entropy = d({1, 3}).view({1, 2});
  ev.ref_logp = torch::zeros({1, 2}, torch::kDouble);
  const ppo_options o{.vf_coef = 0.5, .ent_coef = 0.1, .kl_coef = 0.2, .kl = kl_estimator::k1,
                      .kl_in_reward = false, .norm_adv = false};
  const auto t = ppo_loss(o, ev);
  // policy mean(-1.2, 0.8) = -0.2; value mean(2, 0.5) = 1.25; entropy 2; k1 mean(ln 1.5, ln 0.5) = -0.143841036225890
  REQUIRE(is_f64(t.total));
  const double kl = -0.14384103622589045;  // (0.4054651081081644 - 0.6931471805599453) / 2
  CHECK(t.total.item<double>() == Approx(-0.2 + 0.5 * 1.25 - 0.1 * 2.0 + 0.2 * kl).margin(1e-12));
  CHECK(t.kl == Approx(kl).margin(1e-12));
  CHECK(t.value == Approx(1.25).margin(1e-12));
}
