// Flow track: samplers with log-probabilities, the flow-track losses, RAM's analytic tilt,
// DiffusionNFT, the model adapters and nets, and the Fréchet distance.
#include <cmath>
#include <initializer_list>
#include <type_traits>
#include <numeric>
#include <random>
#include <vector>

#include <torch/torch.h>
// After LibTorch: glog's CHECK must not shadow Catch's.
#include <catch2/catch.hpp>

#include <unirl/algorithms/diffusion_nft.hpp>
#include <unirl/algorithms/flow_dppo.hpp>
#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/algorithms/ram.hpp>
#include <unirl/eval/frechet.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/flow_nets.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/trainer.hpp>

using namespace unirl;

namespace {

// ---- closed-form models -------------------------------------------------------------------

// Data N(mu, s^2) per element, x_t = (1-t) x0 + t eps: the exact velocity
// E[eps - x0 | x_t = x] = (t - (1-t) s^2) / var_t (x - (1-t) mu) - mu, var_t = (1-t)^2 s^2 + t^2.
// mu and log s are parameters, so the same net serves as a learnable Gaussian policy.
class gaussian_netImpl : public torch::nn::Cloneable<gaussian_netImpl> {
 public:
  gaussian_netImpl(std::int64_t dim, double mu, double s) : dim_(dim), mu0_(mu), s0_(s) { reset(); }
  void reset() override {
    mu = register_parameter("mu", torch::full({dim_}, mu0_));
    log_s = register_parameter("log_s", torch::full({dim_}, std::log(s0_)));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor&) {
    const auto tb = t.reshape({-1, 1}).to(x.scalar_type());
    const auto s2 = (2 * log_s).exp();
    const auto var = (1 - tb).pow(2) * s2 + tb.pow(2);
    return (tb - (1 - tb) * s2) / var * (x - (1 - tb) * mu) - mu;
  }
  torch::Tensor null_condition(const torch::Tensor& c) const { return c; }
  torch::Tensor mu, log_s;

 private:
  std::int64_t dim_;
  double mu0_, s0_;
};
TORCH_MODULE(gaussian_net);
using gaussian_model = models::flow_model<gaussian_net>;

// The DDPM counterpart: E[eps | x_t] = sqrt(1-ab) (x - sqrt(ab) mu) / (ab s^2 + 1 - ab), with t the
// timestep index handed to the net as t / T.
class gaussian_eps_netImpl : public torch::nn::Cloneable<gaussian_eps_netImpl> {
 public:
  gaussian_eps_netImpl(double mu, double s) : mu_(mu), s_(s) { reset(); }
  void reset() override {
    abar_ = models::ddpm_alphas_cumprod({}).to(torch::kFloat32);
    dummy = register_parameter("dummy", torch::zeros({1}));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor&) {
    const auto idx = (t * 1000.0).round().to(torch::kInt64);
    const auto ab = abar_.index_select(0, idx).reshape({-1, 1});
    return (1 - ab).sqrt() * (x - ab.sqrt() * mu_) / (ab * s_ * s_ + 1 - ab) + 0 * dummy;
  }
  torch::Tensor null_condition(const torch::Tensor& c) const { return c; }
  torch::Tensor dummy;

 private:
  double mu_, s_;
  torch::Tensor abar_;
};
TORCH_MODULE(gaussian_eps_net);

// v(x, t, c) = w x: a one-parameter policy whose step means are easy to work by hand.
class scale_netImpl : public torch::nn::Cloneable<scale_netImpl> {
 public:
  explicit scale_netImpl(double w) : w0_(w) { reset(); }
  void reset() override { w = register_parameter("w", torch::full({1}, w0_)); }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor&, const torch::Tensor&) { return w * x; }
  torch::Tensor null_condition(const torch::Tensor& c) const { return c; }
  torch::Tensor w;

 private:
  double w0_;
};
TORCH_MODULE(scale_net);
using scale_model = models::flow_model<scale_net>;

static_assert(ModelAdapter<gaussian_model> && models::VelocityModel<gaussian_model>);
static_assert(AlgorithmFor<algo::flow_grpo<>, gaussian_model>);
static_assert(AlgorithmFor<algo::flow_dppo<sde::cps>, gaussian_model>);
static_assert(AlgorithmFor<algo::ram<>, gaussian_model>);
static_assert(AlgorithmFor<algo::diffusion_nft<>, gaussian_model>);
static_assert(SamplesFrom<algo::flow_grpo<>, gaussian_model, torch::Tensor>);
static_assert(SamplerFor<sde::ddim, models::ddpm_model<gaussian_eps_net>>);
static_assert(!SamplerFor<sde::ddim, gaussian_model>);          // DDIM needs a noise model
static_assert(!SamplerFor<sde::flow_grpo, models::ddpm_model<gaussian_eps_net>>);

torch::Tensor labels(std::int64_t n) { return torch::arange(n, torch::kInt64) % 10; }

models::flow_model<models::mlp_velocity_net> small_mlp_model() {
  return {models::mlp_velocity_net(models::flow_net_options{.shape = {1, 4, 4}, .num_classes = 10, .hidden = 32,
                                                             .depth = 2, .embed_dim = 16}),
          {1, 4, 4}};
}

template <class S, class M>
void check_replay_exact(const S& sampler, M& model, const torch::Tensor& cond) {
  const auto b = sample_trajectory(sampler, model, cond);
  REQUIRE(b.steps() == sampler.opts.steps);
  torch::NoGradGuard ng;
  int stochastic = 0;
  for (std::int64_t k = 0; k < b.steps(); ++k) {
    const auto r = replay_step(sampler, model, b, k);
    CHECK(torch::equal(r.step.mean, b.means.select(1, k)));
    CHECK(torch::equal(r.log_prob, b.log_probs.select(1, k)));
    if (r.step.std > 0) ++stochastic;
  }
  CHECK(stochastic >= b.steps() - 1);
}

}  // namespace

// ---- samplers ---------------------------------------------------------------------------------

TEST_CASE("replaying a stored trajectory reproduces its log-probs exactly", "[flow][cpu]") {
  torch::manual_seed(1);
  auto model = small_mlp_model();
  const auto cond = labels(6);
  const flow_sampler_options o{.steps = 6};
  SECTION("Flow-GRPO SDE") { check_replay_exact(sde::flow_grpo(o), model, cond); }
  SECTION("CPS") { check_replay_exact(sde::cps(o), model, cond); }
  SECTION("DanceGRPO") { check_replay_exact(sde::dance(o), model, cond); }
  SECTION("sum reduction") {
    auto s = o;
    s.reduction = logprob_reduction::sum;
    check_replay_exact(sde::flow_grpo(s), model, cond);
  }
  SECTION("DDIM on a DDPM model") {
    models::ddpm_model<models::conv_velocity_net> ddpm(
        models::conv_velocity_net(models::flow_net_options{.channels = 1, .num_classes = 10, .hidden = 8, .depth = 1,
                                                           .embed_dim = 8}),
        {1, 4, 4});
    check_replay_exact(sde::ddim(o), ddpm, cond);
  }
  SECTION("a video model over (B, F, C, H, W)") {
    models::video_flow_model<models::temporal_velocity_net> video(
        models::temporal_velocity_net(models::flow_net_options{.channels = 1, .num_classes = 10, .hidden = 8,
                                                               .depth = 1, .embed_dim = 8}),
        {3, 1, 4, 4});
    check_replay_exact(sde::flow_grpo(o), video, cond);
    check_replay_exact(sde::dance(o), video, cond);
    models::video_flow_model<models::clip_unet_velocity_net> unet(
        models::clip_unet_velocity_net(models::flow_net_options{.shape = {3, 1, 4, 4}, .num_classes = 10, .hidden = 8,
                                                                .depth = 1, .embed_dim = 8}),
        {3, 1, 4, 4});
    check_replay_exact(sde::flow_grpo(o), unet, cond);
  }
  SECTION("a minibatch selected from the batch replays its own rows") {
    sde::flow_grpo s(o);
    const auto b = sample_trajectory(s, model, cond);
    const auto mb = b.select(torch::tensor({4, 1}, torch::kInt64));
    CHECK(torch::equal(mb.trajectory.select(0, 0), b.trajectory.select(0, 4)));
    CHECK(torch::equal(mb.log_probs.select(0, 1), b.log_probs.select(0, 1)));
    CHECK(mb.conditions[0].item<std::int64_t>() == 4);
  }
}

TEST_CASE("sampler coefficients follow the conventions of docs/flow.md", "[flow][cpu]") {
  // Flow-GRPO at t = 0.5 -> 0.25, a = 0.7: sigma = 0.7, k = sigma^2 / (2t) = 0.49, dt = -0.25.
  const auto f = flow_math::flow_grpo(0.5, 0.25, 0.7);
  CHECK(f.cx == Approx(1.0 - 0.49 * 0.25));
  CHECK(f.cm == Approx(-0.25 * (1.0 + 0.49 * 0.5)));
  CHECK(f.std == Approx(0.7 * 0.5));
  // At t = 1 the (1 - t) of sigma becomes 1 - t_next.
  const auto f1 = flow_math::flow_grpo(1.0, 0.75, 0.7);
  CHECK(f1.std == Approx(0.7 * std::sqrt(1.0 / 0.25) * 0.5));
  // CPS: std = t_next sin(a pi / 2); mean coefficients from x0_hat = x - t v, x1_hat = x + (1-t) v.
  const auto c = flow_math::cps(0.6, 0.4, 0.5);
  const double sd = 0.4 * std::sin(0.25 * M_PI), r = std::sqrt(0.16 - sd * sd);
  CHECK(c.std == Approx(sd));
  CHECK(c.cx == Approx(0.6 + r));
  CHECK(c.cm == Approx(-0.6 * 0.6 + r * 0.4));
  CHECK(flow_math::cps(0.2, 0.0, 0.7).std == 0.0);  // last CPS step: deterministic
  // DanceGRPO: std = eta sqrt(t - t_next).
  CHECK(flow_math::dance(0.5, 0.3, 0.3).std == Approx(0.3 * std::sqrt(0.2)));
  // DDIM: eta = 0 is deterministic; the last step (abar' = 1) returns x0_hat exactly.
  CHECK(flow_math::ddim(0.5, 0.7, 0.0).std == 0.0);
  const auto last = flow_math::ddim(0.9, 1.0, 1.0);
  CHECK(last.std == 0.0);
  CHECK(last.cx == Approx(1.0 / std::sqrt(0.9)));
  CHECK(last.cm == Approx(-std::sqrt(0.1) / std::sqrt(0.9)));
}

TEST_CASE("Gaussian KL formula equals a Monte Carlo estimate", "[flow][cpu]") {
  torch::manual_seed(2);
  const std::int64_t d = 8, n = 200000;
  const double s = 0.3;
  const auto mu_a = torch::randn({1, d}) * 0.2, mu_b = torch::randn({1, d}) * 0.2;
  const auto x = mu_a + s * torch::randn({n, d});
  const auto lpa = gaussian_log_prob(x, mu_a.expand({n, d}), s, logprob_reduction::sum);
  const auto lpb = gaussian_log_prob(x, mu_b.expand({n, d}), s, logprob_reduction::sum);
  const double mc = (lpa - lpb).to(torch::kFloat64).mean().item<double>();
  const double exact = gaussian_kl(mu_a, mu_b, s, logprob_reduction::sum).item<double>();
  const double se = (lpa - lpb).to(torch::kFloat64).std().item<double>() / std::sqrt(static_cast<double>(n));
  CHECK(std::abs(mc - exact) < 4 * se + 1e-4);
  CHECK(exact == Approx((mu_a - mu_b).pow(2).sum().item<double>() / (2 * s * s)).epsilon(1e-5));
  // The mean reduction is the sum over the d elements divided by d.
  CHECK(gaussian_kl(mu_a, mu_b, s).item<double>() == Approx(exact / d).epsilon(1e-5));
  // And the log-prob is the Gaussian density (element-wise check).
  const auto one = gaussian_log_prob(torch::tensor({{0.5f}}), torch::tensor({{0.1f}}), 0.2,
                                              logprob_reduction::sum);
  CHECK(one.item<double>() == Approx(-0.16 / 0.08 - std::log(0.2) - 0.5 * std::log(2 * M_PI)).epsilon(1e-5));
}

TEST_CASE("with Gaussian data the SDE samplers match the ODE's mean and variance", "[flow][cpu]") {
  torch::manual_seed(3);
  const double mu = 0.8, s = 0.5;
  const std::int64_t n = 20000;
  gaussian_model model(gaussian_net(1, mu, s), {1});
  const auto cond = torch::zeros({n}, torch::kInt64);
  auto moments = [&](const auto& sampler) {
    const torch::Tensor x = sample_trajectory(sampler, model, cond).samples().to(torch::kFloat64);
    return std::pair{x.mean().item<double>(), x.var().item<double>()};
  };
  const flow_sampler_options o{.steps = 40};
  const auto [m_ode, v_ode] = moments(ode::euler(o));
  // The ODE with the exact velocity transports N(0, 1) to N(mu, s^2) up to its step error.
  CHECK(m_ode == Approx(mu).margin(0.02));
  CHECK(v_ode == Approx(s * s).margin(0.02));
  // Monte Carlo tolerance on 20000 samples: se(mean) = s / sqrt(n) = 0.0035, se(var) ~ 0.0025.
  const double tol_m = 0.03, tol_v = 0.03;
  SECTION("Flow-GRPO SDE") {
    const auto [m, v] = moments(sde::flow_grpo(o));
    CHECK(m == Approx(m_ode).margin(tol_m));
    CHECK(v == Approx(v_ode).margin(tol_v));
  }
  SECTION("CPS") {
    // CPS keeps the coefficients of x0_hat and of the noise, not the marginal variance: with a
    // posterior-mean model each step renews a fixed share sin^2(a pi/2) of the noise from
    // x1_hat, whose variance is below 1, so at a = 0.7 the variance falls short of the ODE's
    // (0.17 vs 0.25 here, whatever the step count). Its mean matches, and so does its variance
    // at a low noise level.
    const auto [m, v] = moments(sde::cps(o));
    CHECK(m == Approx(m_ode).margin(tol_m));
    CHECK(v < v_ode - 0.03);
    auto low = o;
    low.noise_level = 0.1;
    const auto [m1, v1] = moments(sde::cps(low));
    CHECK(m1 == Approx(m_ode).margin(tol_m));
    CHECK(v1 == Approx(v_ode).margin(tol_v));
  }
  SECTION("DanceGRPO") {
    const auto [m, v] = moments(sde::dance(o));
    CHECK(m == Approx(m_ode).margin(tol_m));
    CHECK(v == Approx(v_ode).margin(tol_v));
  }
  SECTION("DDIM with eta = 1 and eta = 0 on the DDPM counterpart") {
    // 500 of the 1000 timesteps: with fewer, ancestral steps from the posterior mean lose variance.
    models::ddpm_model<gaussian_eps_net> ddpm(gaussian_eps_net(mu, s), {1});
    auto run = [&](double eta) {
      const auto x = sample_trajectory(sde::ddim({.steps = 500, .ddim_eta = eta}), ddpm, cond)
                         .samples()
                         .to(torch::kFloat64);
      return std::pair{x.mean().item<double>(), x.var().item<double>()};
    };
    const auto [m1, v1] = run(1.0);
    const auto [m0, v0] = run(0.0);
    CHECK(m1 == Approx(mu).margin(tol_m));
    CHECK(v1 == Approx(s * s).margin(tol_v));
    CHECK(m0 == Approx(m1).margin(tol_m));
    CHECK(v0 == Approx(v1).margin(tol_v));
  }
}

// ---- losses -----------------------------------------------------------------------------------

namespace {
// A hand-made rollout of two 1-element samples and 2 steps on the grid 1 -> 0.5 -> 0, drawn by
// the scale policy with w_old = 0.5 from x = 1: step 0 (t = 1 -> 0.5, a = 0.7) has
// sigma = 0.7 sqrt(1 / 0.5), k = sigma^2 / 2 = 0.49, mean = (1 - 0.245) x - 0.5 w x, std = 0.7.
constexpr double kx = 1.0, w_old = 0.5, step_std = 0.7;
double hand_mean(double w) { return 0.755 * kx - 0.5 * w * kx; }
double hand_logp(double x_next, double w) {
  const double d = x_next - hand_mean(w);
  return -d * d / (2 * step_std * step_std) - std::log(step_std) - 0.5 * std::log(2 * M_PI);
}

flow_rollout hand_rollout(const std::vector<double>& x_next, const std::vector<float>& adv) {
  const std::int64_t b = static_cast<std::int64_t>(x_next.size());
  flow_rollout r;
  r.conditions = torch::zeros({b}, torch::kInt64);
  r.trajectory = torch::zeros({b, 3, 1});
  r.means = torch::zeros({b, 2, 1});
  r.log_probs = torch::zeros({b, 2});
  for (std::int64_t i = 0; i < b; ++i) {
    const double xn = x_next[static_cast<std::size_t>(i)];
    r.trajectory[i][0][0] = kx;
    r.trajectory[i][1][0] = xn;
    r.trajectory[i][2][0] = 0.2;
    r.means[i][0][0] = hand_mean(w_old);
    r.log_probs[i][0] = hand_logp(xn, w_old);
    r.log_probs[i][1] = 0.0;
  }
  r.stds = torch::tensor({step_std, 0.3}, torch::kFloat64).expand({b, 2}).contiguous();
  r.timesteps = torch::tensor({1.0, 0.5, 0.0}, torch::kFloat64).expand({b, 3}).contiguous();
  r.advantages = torch::tensor(adv);
  return r;
}

model_set<scale_model> scale_models(double w_policy, double w_ref) {
  model_set<scale_model> ms{scale_model(scale_net(w_policy), {1})};
  ms.reference.emplace(scale_model(scale_net(w_ref), {1}));
  return ms;
}
}  // namespace

TEST_CASE("Flow-GRPO loss equals its formula on a hand-made rollout", "[flow][cpu]") {
  const std::vector<double> xn{0.6, 0.3};
  const auto batch = hand_rollout(xn, {1.0f, -1.0f});
  const double w_new = 0.6, eps = 0.01, beta = 0.5;
  auto ms = scale_models(w_new, w_old);
  algo::flow_grpo<> a({.clip_range = eps, .beta = beta, .timestep_fraction = 0.5});
  // The step's mean from the sampler matches the hand-worked one.
  const auto st = denoise_step(sde::flow_grpo{}, ms.policy, torch::full({1, 1}, kx), 1.0, 0.5,
                                        torch::zeros({1}, torch::kInt64));
  CHECK(st.mean.item<double>() == Approx(hand_mean(w_new)).epsilon(1e-6));
  CHECK(st.std == Approx(step_std));

  const auto terms = a.loss(ms, batch, {});
  double expected_policy = 0;
  const double advs[2] = {1.0, -1.0};
  for (int i = 0; i < 2; ++i) {
    const double rho = std::exp(hand_logp(xn[static_cast<std::size_t>(i)], w_new) -
                                hand_logp(xn[static_cast<std::size_t>(i)], w_old));
    const double clipped = std::min(std::max(rho, 1 - eps), 1 + eps);
    expected_policy += std::max(-advs[i] * rho, -advs[i] * clipped) / 2;
  }
  const double dm = hand_mean(w_new) - hand_mean(w_old);
  const double expected_kl = dm * dm / (2 * step_std * step_std);
  CHECK(terms.policy == Approx(expected_policy).epsilon(1e-5));
  CHECK(terms.kl == Approx(expected_kl).epsilon(1e-5));
  CHECK(terms.total.item<double>() == Approx(expected_policy + beta * expected_kl).epsilon(1e-5));
  // By hand: sample 0 has rho = 0.98783 (A = +1: -rho beats -0.99), sample 1 rho = 1.01854
  // (A = -1: rho beats the clipped 1.01); both lie outside 1 +- 0.01.
  CHECK(expected_policy == Approx((-0.9878298 + 1.0185371) / 2).epsilon(1e-6));
  CHECK(terms.clip_fraction == Approx(1.0));

  // The gradient with respect to w matches a central finite difference of the hand formula.
  auto hand_total = [&](double w) {
    double p = 0;
    for (int i = 0; i < 2; ++i) {
      const double rho = std::exp(hand_logp(xn[static_cast<std::size_t>(i)], w) -
                                  hand_logp(xn[static_cast<std::size_t>(i)], w_old));
      p += std::max(-advs[i] * rho, -advs[i] * std::min(std::max(rho, 1 - eps), 1 + eps)) / 2;
    }
    const double d = hand_mean(w) - hand_mean(w_old);
    return p + beta * d * d / (2 * step_std * step_std);
  };
  terms.total.backward();
  const double h = 1e-5, fd = (hand_total(w_new + h) - hand_total(w_new - h)) / (2 * h);
  CHECK(ms.policy.net()->w.grad().item<double>() == Approx(fd).epsilon(1e-3));
}

TEST_CASE("Flow-DPPO loss and trust-region mask equal their formulas", "[flow][cpu]") {
  // Sample 0: A > 0 and rho > 1 with KL above delta -> masked; sample 1: A < 0, rho > 1 -> kept.
  const std::vector<double> xn{0.1, 0.05};
  const auto batch = hand_rollout(xn, {1.0f, -2.0f});
  const double w_new = 0.7;
  auto ms = scale_models(w_new, w_old);
  const double dm = hand_mean(w_new) - hand_mean(w_old);
  const double kl = dm * dm / (2 * step_std * step_std);
  algo::flow_dppo<> a({.delta = kl / 2, .timestep_fraction = 0.5});
  const auto terms = a.loss(ms, batch, {});
  const double rho0 = std::exp(hand_logp(xn[0], w_new) - hand_logp(xn[0], w_old));
  const double rho1 = std::exp(hand_logp(xn[1], w_new) - hand_logp(xn[1], w_old));
  REQUIRE(rho0 > 1.0);
  REQUIRE(rho1 > 1.0);
  CHECK(terms.policy == Approx((0.0 + 2.0 * rho1) / 2).epsilon(1e-5));
  CHECK(terms.clip_fraction == Approx(0.5));
  CHECK(terms.extra.at("flow/kl_to_old") == Approx(kl).epsilon(1e-4));
  // With a trust region wider than the step's KL nothing is masked: -A rho averaged.
  algo::flow_dppo<> wide({.delta = kl * 2, .timestep_fraction = 0.5});
  const auto t2 = wide.loss(ms, batch, {});
  CHECK(t2.policy == Approx((-1.0 * rho0 + 2.0 * rho1) / 2).epsilon(1e-5));
  CHECK(t2.clip_fraction == 0.0);
}

TEST_CASE("on-policy first step: ratio exactly 1 and KL exactly 0", "[flow][cpu]") {
  torch::manual_seed(4);
  model_set<models::flow_model<models::mlp_velocity_net>> ms{small_mlp_model()};
  ms.reference.emplace(ms.policy.clone());
  const step_info info{0, 4};
  const auto rewards = torch::randn({8});
  SECTION("Flow-GRPO") {
    algo::flow_grpo<> a({.beta = 0.04, .sampler = {.steps = 5}});
    auto b = a.sample(ms, labels(2), info);
    a.advantage(ms, b, rewards, info);
    const auto t = a.loss(ms, b, info);
    CHECK(t.ratio_mean == 1.0);
    CHECK(t.kl == 0.0);
    CHECK(t.clip_fraction == 0.0);
  }
  SECTION("Flow-DPPO (CPS sampler)") {
    algo::flow_dppo<sde::cps> a({.beta = 0.1, .sampler = {.steps = 5}});
    auto b = a.sample(ms, labels(2), info);
    a.advantage(ms, b, rewards, info);
    const auto t = a.loss(ms, b, info);
    CHECK(t.ratio_mean == 1.0);
    CHECK(t.kl == 0.0);
    CHECK(t.extra.at("flow/kl_to_old") == 0.0);
    CHECK(t.clip_fraction == 0.0);
  }
}

TEST_CASE("group advantages are per condition", "[flow][cpu]") {
  model_set<gaussian_model> ms{gaussian_model(gaussian_net(1, 0.0, 1.0), {1})};
  algo::flow_grpo<> a({.beta = 0.0, .sampler = {.steps = 2}});
  const step_info info{0, 2};
  auto b = a.sample(ms, torch::tensor({3, 7}, torch::kInt64), info);
  REQUIRE(b.size() == 4);
  CHECK(torch::equal(b.conditions, torch::tensor({3, 3, 7, 7}, torch::kInt64)));
  const auto adv = a.advantage(ms, b, torch::tensor({1.0f, 0.0f, 5.0f, 5.0f}), info);
  CHECK(adv[0].item<double>() == Approx(0.5 / (std::sqrt(0.5) + 1e-6)));
  CHECK(adv[1].item<double>() == Approx(-0.5 / (std::sqrt(0.5) + 1e-6)));
  CHECK(adv[2].item<double>() == 0.0);  // a group with equal rewards gets exactly 0
  CHECK(torch::equal(b.advantages, adv));
}

TEST_CASE("DiffusionNFT loss equals its formula", "[flow][cpu]") {
  // Two samples of two elements, beta = 0.5.
  const auto v = torch::tensor({{1.0f, 2.0f}, {0.0f, -1.0f}});
  const auto v_old = torch::tensor({{0.0f, 1.0f}, {0.5f, 0.5f}});
  const auto target = torch::tensor({{1.0f, 1.0f}, {0.0f, 0.0f}});
  const auto r = torch::tensor({0.75f, 0.25f});
  const double b = 0.5;
  double expected = 0;
  const float vv[2][2] = {{1, 2}, {0, -1}}, vo[2][2] = {{0, 1}, {0.5f, 0.5f}}, tg[2][2] = {{1, 1}, {0, 0}};
  const double rr[2] = {0.75, 0.25};
  for (int i = 0; i < 2; ++i) {
    double lp = 0, ln = 0;
    for (int j = 0; j < 2; ++j) {
      const double vp = (1 - b) * vo[i][j] + b * vv[i][j], vn = (1 + b) * vo[i][j] - b * vv[i][j];
      lp += (vp - tg[i][j]) * (vp - tg[i][j]) / 2;
      ln += (vn - tg[i][j]) * (vn - tg[i][j]) / 2;
    }
    expected += (rr[i] * lp + (1 - rr[i]) * ln) / 2;
  }
  CHECK(algo::nft_loss(v, v_old, target, r, b).item<double>() == Approx(expected).epsilon(1e-6));
  // By hand: sample 0: v+ = (0.5, 1.5), v- = (-0.5, 0.5): lp = 0.25, ln = (2.25 + 0.25)/2 = 1.25;
  // sample 1: v+ = (0.25, -0.25), v- = (0.75, 1.25): lp = 0.0625, ln = (0.5625 + 1.5625)/2 = 1.0625.
  CHECK(expected == Approx((0.75 * 0.25 + 0.25 * 1.25 + 0.25 * 0.0625 + 0.75 * 1.0625) / 2));
}

TEST_CASE("RAM on a Gaussian base with a linear reward moves the mean to the analytic tilt", "[flow][cpu][slow]") {
  // Base N(0, 1) in 2 dimensions, reward r = c (x_1 + x_2), advantages r - mean_g, multiplier m:
  // the fixed point is N(m c s^2, s^2) = N(0.5, 1) in each dimension (lambda = 1/m).
  struct linear_reward {
    double c;
    torch::Tensor operator()(const flow_rollout& b) { return c * b.samples().sum(1); }
  };
  const double c = 0.5, m = 1.0;
  trainer<gaussian_model, algo::ram<>, linear_reward> t(
      gaussian_model(gaussian_net(2, 0.0, 1.0), {2}), linear_reward{c},
      {.algorithm = {.multiplier = m,
                     .draws = 8,
                     .ema_decay = 0.5,
                     .advantage = {.scale_by_std = false},
                     .sampler = {.steps = 200}},
       .optim = {.lr = 0.02},
       .group_size = 128,
       .seed = 5,
       .progress = false});
  const auto cond = torch::zeros({2}, torch::kInt64);
  for (int i = 0; i < 300; ++i) t.step(cond);
  auto& net = t.models().policy.net();
  const auto mu = net->mu.detach();
  const auto s = net->log_s.detach().exp();
  INFO("mu = " << mu << " s = " << s);
  // Tolerance: 0.05 on a shift of 0.5 (Monte Carlo noise of 256 endpoints a step, the Adam jitter,
  // and the Euler sampler's step error in the endpoints' variance, which scales the tilt).
  CHECK(mu[0].item<double>() == Approx(m * c).margin(0.05));
  CHECK(mu[1].item<double>() == Approx(m * c).margin(0.05));
  CHECK(s[0].item<double>() == Approx(1.0).margin(0.05));
  CHECK(s[1].item<double>() == Approx(1.0).margin(0.05));
  // The reference is untouched.
  CHECK(t.models().reference->net()->mu.abs().max().item<double>() == 0.0);
}

TEST_CASE("flow-track algorithms raise a reward through the trainer", "[flow][cpu][slow]") {
  // A small untrained class-conditional MLP; reward = mean brightness of the 4x4 sample.
  struct brightness {
    torch::Tensor operator()(const flow_rollout& b) { return b.samples().flatten(1).mean(1); }
  };
  const auto cond = labels(4);
  auto evaluate = [&](auto& model) {
    torch::NoGradGuard ng;
    torch::manual_seed(99);
    const torch::Tensor x = sample_trajectory(ode::euler({.steps = 10}), model, labels(64)).samples();
    return x.mean().item<double>();
  };
  auto run = [&](auto algo_tag, auto algo_options, double lr) {
    using A = typename decltype(algo_tag)::type;
    torch::manual_seed(6);
    trainer<models::flow_model<models::mlp_velocity_net>, A, brightness> t(
        small_mlp_model(), brightness{},
        {.algorithm = algo_options, .optim = {.lr = lr}, .group_size = 8, .seed = 6, .progress = false});
    const double before = evaluate(t.models().policy);
    for (int i = 0; i < 25; ++i) t.step(cond);
    const double after = evaluate(t.models().policy);
    INFO("before " << before << " after " << after);
    CHECK(after > before + 0.1);
  };
  SECTION("Flow-GRPO") {
    run(std::type_identity<algo::flow_grpo<>>{}, algo::flow_grpo_options{.beta = 0.0, .sampler = {.steps = 6}}, 3e-3);
  }
  SECTION("Flow-DPPO") {
    run(std::type_identity<algo::flow_dppo<>>{}, algo::flow_dppo_options{.sampler = {.steps = 6}}, 3e-3);
  }
  SECTION("RAM") {
    run(std::type_identity<algo::ram<>>{}, algo::ram_options{.multiplier = 1.0, .sampler = {.steps = 6}}, 1e-2);
  }
  SECTION("DiffusionNFT") {
    run(std::type_identity<algo::diffusion_nft<>>{}, algo::diffusion_nft_options{.adv_clip_max = 1.0, .sampler = {.steps = 6}}, 1e-2);
  }
}

// ---- free functions on given tensors, float64 at 1e-12 ------------------------------------------
// Every expected number below is worked out by hand from the formulas of docs/flow.md (decimal
// expansions of exp / sqrt / log written out), never produced by the library.

namespace {
constexpr double tight = 1e-12;
torch::Tensor f64(std::initializer_list<double> v) { return torch::tensor(std::vector<double>(v), torch::kFloat64); }
torch::Tensor f64(std::initializer_list<std::initializer_list<double>> rows) {
  std::vector<torch::Tensor> r;
  for (const auto& row : rows) r.push_back(f64(row));
  return torch::stack(r);
}
void check_values(const torch::Tensor& got, const std::vector<double>& want, double tol = tight) {
  REQUIRE(got.scalar_type() == torch::kFloat64);
  const auto g = got.detach().contiguous().reshape({-1});
  REQUIRE(g.numel() == static_cast<std::int64_t>(want.size()));
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("element " << i);
    CHECK(g[static_cast<std::int64_t>(i)].item<double>() == Approx(want[i]).margin(tol));
  }
}
std::vector<bool> as_bools(const torch::Tensor& t) {
  const auto c = t.to(torch::kBool).contiguous();
  std::vector<bool> out;
  for (std::int64_t i = 0; i < c.numel(); ++i) out.push_back(c[i].item<bool>());
  return out;
}
}  // namespace

TEST_CASE("flow advantages, the advantage clip and the interpolation on hand values (float64)", "[flow][cpu]") {
  // One group of three rewards {1, 2, 6}: mean 3, deviations {-2, -1, 3}; unbiased variance
  // 14 / 2 = 7 (std sqrt 7 = 2.6457513110645906), biased 14 / 3 (std 2.1602468994692869).
  const auto r = f64({1.0, 2.0, 6.0, 4.0, 4.0, 4.0});  // the second group is constant: A = 0
  SECTION("scaled by the unbiased std, eps = 0") {
    check_values(algo::flow_advantage(r, 3, {.eps = 0.0}),
                 {-0.7559289460184544, -0.3779644730092272, 1.1338934190276817, 0, 0, 0});
  }
  SECTION("scaled by the biased std") {
    check_values(algo::flow_advantage(r, 3, {.unbiased_std = false, .eps = 0.0}),
                 {-0.9258200997725514, -0.4629100498862757, 1.3887301496588271, 0, 0, 0});
  }
  SECTION("eps is added to the std") {
    // -2 / (2.6457513110645906 + 0.5) = -0.6357552184456...
    check_values(algo::flow_advantage(r, 3, {.eps = 0.5}).slice(0, 0, 1), {-2.0 / 3.1457513110645906});
  }
  SECTION("r - mean_g without the std") {
    check_values(algo::flow_advantage(r, 3, {.scale_by_std = false}), {-2, -1, 3, 0, 0, 0});
  }
  SECTION("the same under exec::reference") {
    check_values(algo::flow_advantage<exec::reference>(r, 3, {.eps = 0.0}),
                 {-0.7559289460184544, -0.3779644730092272, 1.1338934190276817, 0, 0, 0});
  }
  // Advantage clip to +-5; 0 turns it off.
  check_values(algo::clip_advantage(f64({-7.0, 2.0, 6.0}), 5.0), {-5, 2, 5});
  check_values(algo::clip_advantage(f64({-7.0, 2.0, 6.0}), 0.0), {-7, 2, 6});
  // x_t = (1 - t) x0 + t eps: t = 0.25 -> (0.75 + 0.75, 1.5 - 0.25); t = 1 -> eps.
  check_values(algo::flow_interpolate(f64({{1.0, 2.0}, {4.0, 5.0}}), f64({{3.0, -1.0}, {-2.0, 0.5}}), f64({0.25, 1.0})),
               {1.5, 1.25, -2.0, 0.5});
  const auto one = torch::ones({1, 1}, torch::kFloat64);
  CHECK_THROWS_WITH(algo::flow_interpolate(one, one, f64({0.5, 0.5})), Catch::Contains("t has sizes"));
}

TEST_CASE("Gaussian log-prob and KL of a step on hand values (float64)", "[flow][cpu]") {
  // x' = (0.5, 0), mean (0.1, 0.2), std 0.2: per element -(d^2) / 0.08 - log 0.2 - log(2 pi) / 2,
  // with -log 0.2 - log(2 pi)/2 = 1.6094379124341003 - 0.9189385332046727 = 0.6904993792294276:
  // (-2 + 0.6904993792294276, -0.5 + 0.6904993792294276).
  const auto x = f64({{0.5, 0.0}}), mu = f64({{0.1, 0.2}});
  check_values(gaussian_log_prob(x, mu, 0.2, logprob_reduction::sum), {-1.1190012415411448});
  check_values(gaussian_log_prob(x, mu, 0.2), {-0.5595006207705724});
  // KL = (0.16 + 0.04) / 0.08 = 2.5 summed, 1.25 as the mean.
  check_values(gaussian_kl(mu, x, 0.2, logprob_reduction::sum), {2.5});
  check_values(gaussian_kl<exec::reference>(mu, x, 0.2), {1.25});
  check_values(gaussian_log_prob(x, mu, 0.0), {0.0});  // deterministic step
}

TEST_CASE("Flow-GRPO's clipped surrogate on hand values (float64)", "[flow][cpu]") {
  // rho = exp(logp - old): exp(0.01) = 1.010050167084168, exp(-0.1) = 0.9048374180359595,
  // exp(0) = 1, exp(0.2) = 1.2214027581601699; eps = 0.05.
  const auto logp = f64({-1.0, -2.0, -0.5, 0.0}).requires_grad_(true);
  const auto old = f64({-1.01, -1.9, -0.5, -0.2});
  const auto adv = f64({1.0, -2.0, 0.5, -1.0});
  const auto r = algo::flow_grpo_loss(logp, old, adv, 0.05);
  // 0: A = 1, rho inside 1 +- eps: -rho. 1: A = -2, rho = 0.905 below 0.95: max(1.8097, 2 * 0.95) = 1.9
  // (clipped). 2: -0.5. 3: A = -1, rho = 1.2214 above 1.05: max(1.2214, 1.05) = 1.2214 (unclipped
  // wins, but |rho - 1| > eps counts as clipped).
  check_values(r.loss, {-1.010050167084168, 1.9, -0.5, 1.2214027581601699});
  check_values(r.ratio, {1.010050167084168, 0.9048374180359595, 1.0, 1.2214027581601699});
  CHECK(as_bools(r.clipped) == std::vector<bool>{false, true, false, true});
  // d loss / d logp = -A rho where the unclipped term wins, 0 where the clipped one does.
  r.loss.sum().backward();
  check_values(logp.grad(), {-1.010050167084168, 0.0, -0.5, 1.2214027581601699});
  CHECK_THROWS_WITH(algo::flow_grpo_loss(logp, old, adv, 0.0), Catch::Contains("clip_range = 0"));
  CHECK_THROWS_WITH(algo::flow_grpo_loss(logp, old.slice(0, 0, 2), adv, 0.1), Catch::Contains("old_logp sizes"));
}

TEST_CASE("Flow-DPPO's keep mask and loss on hand values (float64)", "[flow][cpu]") {
  // rho = exp(+-0.1) = 1.1051709180756477 / 0.9048374180359595, or exactly 1; delta = 0.1.
  const auto logp = f64({0.1, 0.1, -0.1, -0.1, 0.1, 0.0, 0.1}).requires_grad_(true);
  const auto old = torch::zeros({7}, torch::kFloat64);
  const auto adv = f64({1.0, -1.0, -2.0, 2.0, 0.5, 3.0, 1.0});
  const auto kl = f64({0.2, 0.2, 0.5, 0.5, 0.05, 1.0, 0.1});
  // 0: rho > 1, A > 0, KL >= delta: dropped. 1: rho > 1 but A < 0: kept. 2: rho < 1, A < 0, KL
  // >= delta: dropped. 3: rho < 1, A > 0: kept. 4: inside the trust region: kept. 5: rho = 1:
  // kept. 6: KL = delta exactly: dropped (>=).
  const std::vector<bool> keep{false, true, false, true, true, true, false};
  const auto ratio = torch::exp(logp.detach());
  CHECK(as_bools(algo::flow_dppo_keep(ratio, adv, kl, 0.1)) == keep);
  const auto r = algo::flow_dppo_loss(logp, old, adv, kl, 0.1);
  // -A rho keep.
  check_values(r.loss, {0.0, 1.1051709180756477, 0.0, -1.809674836071919, -0.5525854590378239, -3.0, 0.0});
  std::vector<bool> dropped;
  for (bool k : keep) dropped.push_back(!k);
  CHECK(as_bools(r.clipped) == dropped);
  r.loss.sum().backward();
  check_values(logp.grad(), {0.0, 1.1051709180756477, 0.0, -1.809674836071919, -0.5525854590378239, -3.0, 0.0});
}

TEST_CASE("RAM's target and losses and DiffusionNFT's weight and loss on hand values (float64)", "[flow][cpu]") {
  SECTION("RAM") {
    // target = ref + m A (fm - old), m = 0.5:
    // sample 0, A = 2: (1, 2) + 1 * ((1, 0) - (0.5, 1)) = (1.5, 1);
    // sample 1, A = -0.5: (0, -1) - 0.25 * ((2, 3) - (1, 1)) = (-0.25, -1.5).
    const auto ref = f64({{1.0, 2.0}, {0.0, -1.0}}).requires_grad_(true);
    const auto old = f64({{0.5, 1.0}, {1.0, 1.0}}), fm = f64({{1.0, 0.0}, {2.0, 3.0}});
    const auto target = algo::ram_target(ref, old, fm, f64({2.0, -0.5}), 0.5);
    check_values(target, {1.5, 1.0, -0.25, -1.5});
    // L = mean (pred - sg(target))^2 with pred (1, 1), (0, -1): (0.25 + 0 + 0.0625 + 0.25) / 4.
    const auto pred = f64({{1.0, 1.0}, {0.0, -1.0}}).requires_grad_(true);
    const auto loss = algo::ram_loss(pred, target);
    check_values(loss, {0.140625});
    loss.backward();
    check_values(pred.grad(), {-0.25, 0.0, 0.125, 0.25});  // 2 (pred - target) / 4
    CHECK(!ref.grad().defined());                          // the target is a constant
    // The reward-weighted baseline: per-sample mse (0 + 1) / 2 = 0.5 and (4 + 16) / 2 = 10,
    // weights 1 + 2 r = 3 and 0: (1.5 + 0) / 2.
    check_values(algo::reward_weighted_loss(pred, fm, f64({1.0, -0.5}), 2.0), {0.75});
  }
  SECTION("DiffusionNFT") {
    // r = 0.5 + 0.5 clip(A / 5, -1, 1).
    check_values(algo::nft_weight(f64({-10.0, -2.5, 0.0, 1.0, 7.0}), 5.0), {0.0, 0.25, 0.5, 0.6, 1.0});
    // beta = 0.5. Sample 0: v+ = (0.5, 1.5), v- = (-0.5, 0.5) against (1, 1): lp = 0.25, ln = 1.25;
    // sample 1: v+ = (0.25, -0.25), v- = (0.75, 1.25) against 0: lp = 0.0625, ln = 1.0625;
    // L = (0.75 * 0.25 + 0.25 * 1.25 + 0.25 * 0.0625 + 0.75 * 1.0625) / 2 = 1.3125 / 2.
    const auto v = f64({{1.0, 2.0}, {0.0, -1.0}});
    check_values(algo::nft_loss(v, f64({{0.0, 1.0}, {0.5, 0.5}}), f64({{1.0, 1.0}, {0.0, 0.0}}), f64({0.75, 0.25}), 0.5),
                 {0.65625});
    CHECK_THROWS_WITH(algo::nft_loss(v, v, v, f64({0.5}), 0.5), Catch::Contains("one per sample"));
  }
}

TEST_CASE("a float64 sampler and Flow-GRPO step stay float64 and match the hand formulas", "[flow][cpu]") {
  // v = w x in float64, the Flow-GRPO SDE on the grid 1 -> 0.5 -> 0 with a = 0.7:
  // step 0: sigma = 0.7 sqrt(1 / 0.5), k = sigma^2 / 2 = 0.49, mean = (1 - 0.245) x - 0.5 v, std 0.7;
  // step 1: sigma = 0.7, k = 0.49, mean = (1 - 0.245) x - 0.5 (1 + 0.245) v, std 0.7 sqrt 0.5.
  const double cx[2] = {0.755, 0.755}, cm[2] = {-0.5, -0.6225}, sd[2] = {0.7, 0.7 * std::sqrt(0.5)};
  const double w_old = 0.5, w_new = 0.6, w_ref = 0.45, eps = 0.05, beta = 0.5;
  auto as_f64 = [](double w) {
    scale_model m(scale_net(w), {1});
    m.net()->to(torch::kFloat64);
    return m;
  };
  model_set<scale_model> ms{as_f64(w_old)};
  ms.reference.emplace(as_f64(w_ref));
  algo::flow_grpo<> a({.clip_range = eps, .beta = beta, .sampler = {.steps = 2}});
  const step_info info{0, 4};
  torch::manual_seed(11);
  auto b = a.sample(ms, torch::zeros({1}, torch::kInt64), info);
  REQUIRE(b.size() == 4);
  CHECK(b.trajectory.scalar_type() == torch::kFloat64);
  CHECK(b.means.scalar_type() == torch::kFloat64);
  CHECK(b.log_probs.scalar_type() == torch::kFloat64);
  // The stored means and log-probs are the hand formulas on the stored states, to 1e-12
  // (float32 anywhere on the way would miss by ~1e-7).
  auto x = [&](std::int64_t i, std::int64_t k) { return b.trajectory[i][k][0].item<double>(); };
  auto mean = [&](std::int64_t i, std::int64_t k, double w) { return cx[k] * x(i, k) + cm[k] * w * x(i, k); };
  auto logp = [&](std::int64_t i, std::int64_t k, double w) {
    const double d = x(i, k + 1) - mean(i, k, w);
    return -d * d / (2 * sd[k] * sd[k]) - std::log(sd[k]) - 0.5 * std::log(2 * M_PI);
  };
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t k = 0; k < 2; ++k) {
      CHECK(b.means[i][k][0].item<double>() == Approx(mean(i, k, w_old)).margin(tight));
      CHECK(b.log_probs[i][k].item<double>() == Approx(logp(i, k, w_old)).margin(tight));
    }
  // Rewards: the final sample itself, float64 kept through the advantage stage; one group of 4:
  // A = (r - mean) / (unbiased std + 1e-6).
  const auto rewards = b.samples().reshape({-1});
  const auto adv = a.advantage(ms, b, rewards, info);
  CHECK(b.rewards.scalar_type() == torch::kFloat64);
  CHECK(adv.scalar_type() == torch::kFloat64);
  double r[4], m = 0, v = 0;
  for (int i = 0; i < 4; ++i) m += (r[i] = x(i, 2)) / 4;
  for (int i = 0; i < 4; ++i) v += (r[i] - m) * (r[i] - m) / 3;
  double A[4];
  for (int i = 0; i < 4; ++i) {
    A[i] = (r[i] - m) / (std::sqrt(v) + 1e-6);
    CHECK(adv[i].item<double>() == Approx(A[i]).margin(tight));
  }
  // One loss with the policy moved to w_new: per step the surrogate averaged over samples, plus
  // beta * mean_i (mean_new - mean_ref)^2 / (2 sd^2); averaged over the two steps.
  {
    torch::NoGradGuard ng;
    ms.policy.net()->w.fill_(w_new);
  }
  const auto terms = a.loss(ms, b, info);
  REQUIRE(terms.total.scalar_type() == torch::kFloat64);
  double total = 0;
  for (std::int64_t k = 0; k < 2; ++k) {
    double pol = 0, kl = 0;
    for (std::int64_t i = 0; i < 4; ++i) {
      const double rho = std::exp(logp(i, k, w_new) - logp(i, k, w_old));
      pol += std::max(-A[i] * rho, -A[i] * std::min(std::max(rho, 1 - eps), 1 + eps)) / 4;
      const double dm = mean(i, k, w_new) - mean(i, k, w_ref);
      kl += dm * dm / (2 * sd[k] * sd[k]) / 4;
    }
    total += (pol + beta * kl) / 2;
  }
  CHECK(terms.total.item<double>() == Approx(total).margin(tight));
  terms.total.backward();
  CHECK(ms.policy.net()->w.grad().scalar_type() == torch::kFloat64);
}

namespace {
template <class E>
concept names_flow_grpo = requires { typename algo::flow_grpo<sde::flow_grpo, E>; };
template <class E>
concept names_ram = requires { typename algo::ram<ode::euler, E>; };
}  // namespace
// Every flow algorithm takes an ExecutionPolicy, and only that.
static_assert(names_flow_grpo<exec::reference> && names_flow_grpo<exec::cpu> && !names_flow_grpo<int>);
static_assert(names_ram<exec::automatic> && !names_ram<double>);
static_assert(std::is_same_v<algo::flow_grpo<sde::flow_grpo, exec::reference>::exec_policy, exec::reference>);
static_assert(std::is_same_v<algo::flow_dppo<>::exec_policy, exec::automatic>);
static_assert(AlgorithmFor<algo::flow_dppo<sde::cps, exec::reference>, gaussian_model> &&
              AlgorithmFor<algo::ram<ode::euler, exec::reference>, gaussian_model> &&
              AlgorithmFor<algo::diffusion_nft<ode::euler, exec::reference>, gaussian_model>);

TEST_CASE("a Flow-GRPO step under exec::reference gives the default policy's losses", "[flow][cpu]") {
  struct brightness {
    torch::Tensor operator()(const flow_rollout& b) { return b.samples().flatten(1).mean(1); }
  };
  auto run = [](auto tag) {
    using A = typename decltype(tag)::type;
    torch::manual_seed(21);
    trainer<models::flow_model<models::mlp_velocity_net>, A, brightness> t(
        small_mlp_model(), brightness{},
        {.algorithm = {.clip_range = 1e-3, .beta = 0.04, .sampler = {.steps = 4}},
         .optim = {.lr = 1e-3},
         .group_size = 4,
         .minibatches = 2,
         .seed = 21,
         .progress = false});
    return t.step(labels(2));
  };
  {
    // The fused CPU step (exec::cpu, and automatic on CPU tensors) against the reference oracle.
    torch::manual_seed(20);
    auto model = small_mlp_model();
    const auto x = torch::randn({6, 1, 4, 4});
    torch::NoGradGuard ng;
    const auto r = denoise_step<exec::reference>(sde::flow_grpo{}, model, x, 0.8, 0.6, labels(6));
    const auto c = denoise_step<exec::cpu>(sde::flow_grpo{}, model, x, 0.8, 0.6, labels(6));
    CHECK(torch::allclose(r.mean, c.mean, 1e-6, 1e-6));
    CHECK(r.std == c.std);
  }
  const auto ref = run(std::type_identity<algo::flow_grpo<sde::flow_grpo, exec::reference>>{});
  const auto def = run(std::type_identity<algo::flow_grpo<>>{});
  CHECK(ref.loss == Approx(def.loss).margin(1e-6));
  CHECK(ref.policy_loss == Approx(def.policy_loss).margin(1e-6));
  CHECK(ref.kl == Approx(def.kl).margin(1e-6));
  CHECK(ref.reward_mean == Approx(def.reward_mean).margin(1e-6));
  CHECK(ref.optimizer_steps == 2);
  // A second minibatch trains off-policy: the losses are not trivially those of the first update.
  CHECK(ref.clip_fraction == Approx(def.clip_fraction).margin(1e-6));
}

// ---- adapters and nets ------------------------------------------------------------------------

TEST_CASE("flow adapters: guidance, q_sample, shapes and errors", "[flow][cpu]") {
  torch::manual_seed(7);
  auto model = small_mlp_model();
  const auto x = torch::randn({3, 1, 4, 4});
  const auto t = torch::rand({3});
  const auto c = torch::tensor({1, 2, 3}, torch::kInt64);
  torch::NoGradGuard ng;
  const auto vc = model.velocity(x, t, c);
  const auto vu = model.net()->forward(x, t, model.net()->null_condition(c));
  model.set_guidance(3.0);
  CHECK(torch::allclose(model.velocity(x, t, c), vu + 3.0 * (vc - vu), 1e-5, 1e-5));
  CHECK_THROWS_WITH(model.velocity(torch::randn({3, 1, 8, 8}), t, c), Catch::Contains("expected (B, [1, 4, 4])"));
  CHECK_THROWS_AS(model.set_guidance(-1.0), unirl::error);
  CHECK_THROWS_AS(sde::flow_grpo({.noise_level = 2.0}), unirl::config_error);
  CHECK_THROWS_WITH(algo::flow_grpo<>({.clip_range = 0.0}), Catch::Contains("clip_range"));

  // DDPM: abar in float64, q_sample's formula, the last-step DDIM deterministic.
  const auto abar = models::ddpm_alphas_cumprod({});
  CHECK(abar.scalar_type() == torch::kFloat64);
  CHECK(abar[0].item<double>() == Approx(1 - 1e-4));
  CHECK(abar[999].item<double>() == Approx(std::exp(torch::log(1 - torch::linspace(1e-4, 0.02, 1000, torch::kFloat64))
                                                        .sum()
                                                        .item<double>())));
  models::ddpm_model<models::conv_velocity_net> ddpm(
      models::conv_velocity_net(models::flow_net_options{.channels = 1, .num_classes = 10, .hidden = 8, .depth = 1,
                                                         .embed_dim = 8}),
      {1, 4, 4});
  const auto e = torch::randn_like(x);
  const auto xt = ddpm.q_sample(x, torch::tensor({0, 500, 999}, torch::kInt64), e);
  const double a500 = abar[500].item<double>();
  CHECK(torch::allclose(xt[1], std::sqrt(a500) * x[1] + std::sqrt(1 - a500) * e[1], 1e-5, 1e-5));
  CHECK_THROWS_WITH(ddpm.q_sample(x, torch::tensor({0, 1, 1000}, torch::kInt64), e), Catch::Contains("out of [0, 1000)"));

  // Nets: shapes and independent clones.
  models::video_flow_model<models::temporal_velocity_net> video(
      models::temporal_velocity_net(models::flow_net_options{.channels = 1, .num_classes = 4, .hidden = 8, .depth = 1,
                                                             .embed_dim = 8}),
      {5, 1, 8, 8});
  const auto clip = torch::randn({2, 5, 1, 8, 8});
  CHECK(video.velocity(clip, torch::rand({2}), torch::tensor({0, 3}, torch::kInt64)).sizes() == clip.sizes());
  CHECK_THROWS_AS(models::video_flow_model<models::temporal_velocity_net>(
                      models::temporal_velocity_net(models::flow_net_options{.channels = 1}), {1, 8, 8}),
                  unirl::error);
  // The clip U-Net stacks frames as channels: changing the first frame changes the last frame's output.
  models::video_flow_model<models::clip_unet_velocity_net> unet(
      models::clip_unet_velocity_net(models::flow_net_options{.shape = {4, 1, 8, 8}, .num_classes = 4, .hidden = 8,
                                                              .depth = 1, .embed_dim = 8}),
      {4, 1, 8, 8});
  const auto clip4 = torch::randn({2, 4, 1, 8, 8});
  const auto tt = torch::rand({2});
  const auto labels = torch::tensor({0, 3}, torch::kInt64);
  const auto v4 = unet.velocity(clip4, tt, labels);
  CHECK(v4.sizes() == clip4.sizes());
  auto clip4b = clip4.clone();
  clip4b.select(1, 0).add_(1.0);
  CHECK((unet.velocity(clip4b, tt, labels) - v4).select(1, 3).abs().max().item<double>() > 1e-6);
  auto unet_copy = unet.clone();
  unet_copy.parameters().back().add_(1.0);
  CHECK(!torch::equal(unet_copy.parameters().back(), unet.parameters().back()));
  CHECK_THROWS_AS(models::clip_unet_velocity_net(models::flow_net_options{.shape = {4, 1, 6, 6}}), unirl::error);
  CHECK_THROWS_WITH(unet.velocity(torch::randn({2, 3, 1, 8, 8}), tt, labels), Catch::Contains("input has sizes"));
  auto copy = model.clone();
  copy.parameters()[0].add_(1.0);
  CHECK(!torch::equal(copy.parameters()[0], model.parameters()[0]));
  // Embedding-conditioned nets use zeros as the null condition.
  models::mlp_velocity_net emb(models::flow_net_options{.shape = {4}, .num_classes = 0, .cond_dim = 3, .hidden = 8,
                                                        .depth = 1, .embed_dim = 8});
  CHECK((emb->forward(torch::randn({2, 4}), torch::rand({2}), torch::randn({2, 3})).sizes() ==
         std::vector<std::int64_t>{2, 4}));
  CHECK(torch::equal(emb->null_condition(torch::ones({2, 3})), torch::zeros({2, 3})));
}

TEST_CASE("an ODE rollout cannot train a policy-gradient loss", "[flow][cpu]") {
  model_set<gaussian_model> ms{gaussian_model(gaussian_net(1, 0.0, 1.0), {1})};
  auto b = sample_trajectory(ode::euler({.steps = 3}), ms.policy, torch::zeros({4}, torch::kInt64));
  b.advantages = torch::zeros({4});
  algo::flow_grpo<> a({.beta = 0.0});
  CHECK_THROWS_WITH(a.loss(ms, b, {}), Catch::Contains("no stochastic step"));
}

// ---- Fréchet distance -------------------------------------------------------------------------

TEST_CASE("Fréchet distance matches closed forms", "[flow][cpu]") {
  using eval::gaussian_statistics;
  SECTION("commuting (diagonal) covariances: |dmu|^2 + sum (sqrt a - sqrt b)^2") {
    gaussian_statistics a{Eigen::Vector3d(0, 1, 2), Eigen::Vector3d(1, 4, 9).asDiagonal()};
    gaussian_statistics b{Eigen::Vector3d(1, 1, 0), Eigen::Vector3d(4, 1, 9).asDiagonal()};
    CHECK(eval::frechet_distance(a, b) == Approx(1 + 4 + (1 - 2) * (1 - 2) + (2 - 1) * (2 - 1) + 0));
  }
  SECTION("non-commuting 2x2: tr sqrt(M) = sqrt(tr M + 2 sqrt(det M))") {
    Eigen::Matrix2d s1, s2;
    s1 << 2, 0.5, 0.5, 1;
    s2 << 1, -0.3, -0.3, 3;
    gaussian_statistics a{Eigen::Vector2d(0, 0), s1}, b{Eigen::Vector2d(0.5, -1), s2};
    const Eigen::Matrix2d prod = s1 * s2;  // same trace and determinant as sqrt(S1) S2 sqrt(S1)
    const double tr_sqrt = std::sqrt(prod.trace() + 2 * std::sqrt(prod.determinant()));
    CHECK(eval::frechet_distance(a, b) == Approx(1.25 + s1.trace() + s2.trace() - 2 * tr_sqrt).epsilon(1e-10));
    CHECK(eval::frechet_distance(a, a) == Approx(0.0).margin(1e-12));
  }
  SECTION("statistics of samples") {
    torch::manual_seed(8);
    const auto fa = torch::randn({50000, 2}, torch::kFloat64);
    const auto fb = torch::randn({50000, 2}, torch::kFloat64) * 2 + 1;
    // N(0, I) vs N(1, 4 I): 2 + 2 (1 - 2)^2 = 4.
    CHECK(eval::frechet_distance(fa, fb) == Approx(4.0).margin(0.1));
    const auto st = eval::feature_statistics(fb);
    CHECK(st.mean(0) == Approx(1.0).margin(0.03));
    CHECK(st.cov(1, 1) == Approx(4.0).margin(0.1));
    CHECK_THROWS_WITH(eval::feature_statistics(torch::randn({1, 2})), Catch::Contains("N = 1"));
  }
}

// ---- gradient accumulation and mixed precision on the flow track (issue 12) -------------------

TEST_CASE("gradient accumulation: Flow-GRPO micro-batches give the whole minibatch's loss, gradients and update",
          "[flow][cpu][accumulation]") {
  struct brightness {
    torch::Tensor operator()(const flow_rollout& b) { return b.samples().flatten(1).mean(1); }
  };
  using model_t = models::flow_model<models::mlp_velocity_net>;
  using T = trainer<model_t, algo::flow_grpo<>, brightness>;
  torch::manual_seed(30);
  const auto init = small_mlp_model();
  auto weights = [](const model_t& m) {
    std::vector<torch::Tensor> w;
    for (const auto& p : m.parameters()) w.push_back(p.detach().clone());
    return w;
  };
  auto diff = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    double d = 0;
    for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
    return d;
  };
  // lr / eps = 1 with eps >> |g|: the first AdamW step moves each weight by ~ -g.
  auto run = [&](std::int64_t micro) {
    T t(init.clone(), brightness{},
        {.algorithm = {.beta = 0.04, .sampler = {.steps = 6}}, .optim = {.lr = 1e6, .eps = 1e6}, .group_size = 4,
         .micro_batch_size = micro, .seed = 3, .progress = false});
    const auto s = t.step(labels(3));  // 12 samples
    return std::pair{s, weights(t.models().policy)};
  };
  const auto [full, w_full] = run(0);
  const double moved = diff(w_full, weights(init));
  REQUIRE(moved > 1e-4);
  for (const std::int64_t micro : {1, 5}) {  // 12 = 5 + 5 + 2: unequal micro-batches
    const auto [acc, w_acc] = run(micro);
    // On-policy the surrogate and the KL are ~0 (ratio 1, group-centred advantages): rounding-level values.
    CHECK(acc.loss == Approx(full.loss).epsilon(1e-5).margin(1e-6));
    CHECK(acc.kl == Approx(full.kl).epsilon(1e-5).margin(1e-7));
    CHECK(acc.grad_norm == Approx(full.grad_norm).epsilon(1e-5));
    CHECK(diff(w_acc, w_full) <= 1e-4 * moved);
  }
}

TEST_CASE("mixed precision: a bf16 Flow-GRPO step keeps float32 weights and a loss close to float32's",
          "[flow][cpu][precision]") {
  struct brightness {
    torch::Tensor operator()(const flow_rollout& b) { return b.samples().flatten(1).mean(1); }
  };
  torch::manual_seed(31);
  model_set<models::flow_model<models::mlp_velocity_net>> ms{small_mlp_model()};
  ms.reference.emplace(ms.policy.clone());
  algo::flow_grpo<> alg({.beta = 0.04, .sampler = {.steps = 6}});
  const step_info info{0, 4, torch::kCPU, nullptr, 2, nullptr};
  flow_rollout b = alg.sample(ms, labels(3), info);
  alg.advantage(ms, b, brightness{}(b), info);
  auto loss = [&](precision p) {
    for (auto& q : ms.policy.parameters()) q.mutable_grad() = torch::Tensor();
    loss_terms t;
    {
      autocast_scope amp(torch::kCPU, p);
      t = alg.loss(ms, b, info);
    }
    t.total.backward();
    std::vector<torch::Tensor> g;
    for (auto& q : ms.policy.parameters()) {
      CHECK(q.grad().scalar_type() == torch::kFloat);
      g.push_back(q.grad().reshape({-1}).clone());
    }
    CHECK(t.total.scalar_type() == torch::kFloat);
    return std::pair{t.total.item<double>(), torch::cat(g)};
  };
  const auto [l32, g32] = loss(precision::fp32);
  const auto [l16, g16] = loss(precision::bf16);
  CHECK(l16 == Approx(l32).epsilon(5e-2).margin(1e-3));
  CHECK(torch::isfinite(g16).all().item<bool>());
  CHECK((g16 - g32).norm().item<double>() > 0.0);  // the bf16 path really ran in bfloat16
}

// ---- flow-matching pretraining (train/flow_matching.hpp) --------------------------------------
#include <unirl/train/flow_matching.hpp>

namespace {
// v = a x + b t + c cond: a velocity whose loss can be written down by hand.
class affine_velocity_netImpl : public torch::nn::Cloneable<affine_velocity_netImpl> {
 public:
  affine_velocity_netImpl() { reset(); }
  void reset() override {
    a = register_parameter("a", torch::full({}, 0.5));
    b = register_parameter("b", torch::full({}, -1.5));
    c = register_parameter("c", torch::full({}, 0.25));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond) {
    return a * x + b * t.reshape({-1, 1}) + c * cond.to(x.scalar_type()).reshape({-1, 1});
  }
  torch::Tensor null_condition(const torch::Tensor& c) const { return torch::zeros_like(c); }
  torch::Tensor a, b, c;
};
TORCH_MODULE(affine_velocity_net);
using affine_model = models::flow_model<affine_velocity_net>;
}  // namespace

TEST_CASE("flow_matching_loss equals mean((v(x_t, t, c) - (eps - x0))^2) on known inputs", "[cpu][flow]") {
  affine_velocity_net net;
  const std::vector<std::vector<double>> x0{{1.0, -2.0, 0.5}, {0.0, 3.0, -1.0}}, eps{{0.3, 0.1, -0.7}, {1.2, -0.4, 0.9}};
  const std::vector<double> t{0.25, 0.8}, cond{2.0, 5.0};
  double sum = 0;
  for (std::size_t i = 0; i < 2; ++i)
    for (std::size_t j = 0; j < 3; ++j) {
      const double xt = (1 - t[i]) * x0[i][j] + t[i] * eps[i][j];
      const double v = 0.5 * xt - 1.5 * t[i] + 0.25 * cond[i];
      sum += std::pow(v - (eps[i][j] - x0[i][j]), 2);
    }
  auto tens = [](const std::vector<std::vector<double>>& v) {
    return torch::tensor({v[0][0], v[0][1], v[0][2], v[1][0], v[1][1], v[1][2]}, torch::kFloat64).view({2, 3});
  };
  net->to(torch::kFloat64);
  const auto loss = train::flow_matching_loss(net, tens(x0), torch::tensor(cond, torch::kFloat64),
                                              torch::tensor(t, torch::kFloat64), tens(eps));
  CHECK(loss.item<double>() == Approx(sum / 6.0).epsilon(1e-12));
  CHECK_THROWS_WITH(train::flow_matching_loss(net, tens(x0), torch::tensor(cond, torch::kFloat64),
                                              torch::tensor({0.5}, torch::kFloat64), tens(eps)),
                    Catch::Contains("t has sizes"));

  // The objective's draws (t ~ U(0,1), eps, the condition dropout) are the adapter's
  // flow_matching_loss's, in the same order: equal losses from equal generator states.
  affine_model m(affine_velocity_net(), {3});
  const train::flow_matching_objective<affine_model> obj({.p_uncond = 0.5});
  const auto x = torch::randn({64, 3}), c = torch::randint(0, 4, {64}, torch::kInt64);
  torch::manual_seed(11);
  const auto mine = obj.loss(m, {x, c});
  torch::manual_seed(11);
  const auto theirs = m.flow_matching_loss(x, c, 0.5);
  CHECK(mine.total.item<double>() == theirs.item<double>());
  CHECK(mine.examples == 64);
  CHECK_THROWS_WITH(obj.loss(m, {torch::zeros({4, 2}), torch::zeros({4})}), Catch::Contains("expected (B, 3)"));
}

TEST_CASE("flow_matching_trainer recovers Gaussian data and resumes bit for bit", "[cpu][flow]") {
  // Data N(2, 0.5^2): the flow-matching optimum of gaussian_net is mu = 2, s = 0.5.
  auto next = [](std::int64_t n) {
    return train::flow_matching_batch{2.0 + 0.5 * torch::randn({n, 1}), torch::zeros({n}, torch::kInt64)};
  };
  using fm_t = train::flow_matching_trainer<gaussian_model>;
  const fm_t::options o{.optim = {.lr = 0.05},
                        .schedule = {.kind = train::schedule_kind::cosine, .min_lr_ratio = 0.1},
                        .batch_size = 256,
                        .steps = 300,
                        .seed = 3,
                        .progress = false};
  fm_t t(gaussian_model(gaussian_net(1, 0.0, 1.0), {1}), o);
  const auto r = t.run(next);
  CHECK(r.steps == 300);
  CHECK(r.loss_last < r.loss_first);
  const auto& net = t.model().net();
  CHECK(net->mu.item<double>() == Approx(2.0).margin(0.1));
  CHECK(std::exp(net->log_s.item<double>()) == Approx(0.5).margin(0.1));

  // Resume: 4 steps straight, or 2, a checkpoint, a fresh trainer (other weights) and 2 more.
  const auto path = (std::filesystem::temp_directory_path() /
                     ("unirl_fm_" + std::to_string(std::random_device{}()) + ".pt")).string();
  auto short_run = o;
  short_run.steps = 4;
  fm_t straight(gaussian_model(gaussian_net(1, 0.0, 1.0), {1}), short_run);
  for (int i = 0; i < 4; ++i) straight.step(next(64));
  fm_t a(gaussian_model(gaussian_net(1, 0.0, 1.0), {1}), short_run);
  a.step(next(64));
  a.step(next(64));
  a.save(path);
  fm_t b(gaussian_model(gaussian_net(1, 1.0, 3.0), {1}), short_run);
  b.load(path);
  CHECK(b.step_count() == 2);
  b.step(next(64));
  const auto last = b.step(next(64));
  CHECK(last.step == 3);
  CHECK(torch::equal(b.model().net()->mu, straight.model().net()->mu));
  CHECK(torch::equal(b.model().net()->log_s, straight.model().net()->log_s));
  std::filesystem::remove(path);
}

TEST_CASE("lora on a flow net: zero-initialised adapters keep the velocity; RAM (EMA and reference) and Flow-GRPO "
          "train only the adapters against the base as reference",
          "[flow][cpu][lora]") {
  struct brightness {
    torch::Tensor operator()(const flow_rollout& b) { return b.samples().flatten(1).mean(1); }
  };
  torch::manual_seed(30);
  auto base = small_mlp_model();
  const auto x = torch::randn({5, 1, 4, 4}), t = torch::rand({5}), c = labels(5);
  torch::Tensor v0;
  {
    torch::NoGradGuard ng;
    v0 = base.velocity(x, t, c);
  }
  auto adapted = base.clone();
  const lora::options lo{.rank = 2, .alpha = 4};
  const auto names = lora::apply(adapted, lo);
  // every linear layer of the net (the condition embedding's too), none of the norms
  CHECK(names == std::vector<std::string>{"blocks.1", "blocks.2", "blocks.3", "blocks.5", "blocks.6", "blocks.7",
                                          "embed.time1", "embed.time2", "input", "output"});
  {
    torch::NoGradGuard ng;
    CHECK(torch::equal(adapted.velocity(x, t, c), v0));
  }
  auto run = [&](auto tag, auto algo_options) {
    using A = typename decltype(tag)::type;
    torch::manual_seed(31);
    auto m = base.clone();
    lora::apply(m, lo);
    trainer<models::flow_model<models::mlp_velocity_net>, A, brightness> tr(
        m, brightness{}, {.algorithm = algo_options, .optim = {.lr = 1e-2}, .group_size = 4, .seed = 31,
                          .progress = false});
    REQUIRE(tr.models().reference.has_value());
    auto& policy = tr.models().policy;
    CHECK(tr.models().reference->named_parameters().front().second.data_ptr() ==
          policy.named_parameters().front().second.data_ptr());  // the same weights, not a copy
    for (int i = 0; i < 3; ++i) CHECK(std::isfinite(tr.step(labels(2)).loss));
    const auto b = base.named_parameters();
    std::size_t k = 0;
    double moved = 0;
    for (const auto& [n, p] : policy.named_parameters()) {
      if (n.find(".lora_") != std::string::npos) {
        const torch::Tensor w = p;  // (a non-dependent type inside this generic lambda)
        if (n.ends_with("lora_B.weight")) moved = std::max(moved, w.abs().max().item<double>());
        continue;
      }
      INFO(n);
      REQUIRE(b[k].first == n);
      CHECK(torch::equal(b[k++].second, p));  // the base is untouched
    }
    CHECK(moved > 0.0);
    torch::NoGradGuard ng;
    const torch::Tensor dv = policy.velocity(x, t, c) - v0;
    CHECK(dv.abs().max().item<double>() > 0.0);
    {  // the reference's velocity (adapters off) is the base's, bit for bit
      lora::disabled_guard off;
      CHECK(torch::equal(tr.models().reference->velocity(x, t, c), v0));
    }
    if (tr.models().ema) CHECK(lora::has_adapters(tr.models().ema->named_parameters()));  // EMA copies the adapters
  };
  SECTION("RAM") { run(std::type_identity<algo::ram<>>{}, algo::ram_options{.multiplier = 1.0, .sampler = {.steps = 4}}); }
  SECTION("Flow-GRPO") {
    run(std::type_identity<algo::flow_grpo<>>{}, algo::flow_grpo_options{.beta = 0.04, .sampler = {.steps = 4}});
  }
}

TEST_CASE("Flow-DPPO's clamped-KL trust region (seed 000) on hand values (float64)", "[flow][cpu]") {
  // Seed 000: eps = clamp(KL, 0.01, 0.2), loss = -min(rho A, clip(rho, 1 - eps, 1 + eps) A).
  // rho = exp(logp): exp(0.05) = 1.0512710963760241, exp(0.005) = 1.005012520859401,
  // exp(0.1) = 1.1051709180756477, exp(-0.3) = 0.7408182206817179, exp(-0.1) = 0.9048374180359595.
  const auto logp = f64({0.05, 0.005, 0.1, -0.3, 0.1, -0.1, 0.1}).requires_grad_(true);
  const auto old = torch::zeros({7}, torch::kFloat64);
  const auto adv = f64({1.0, 2.0, 1.0, -1.0, -1.0, 0.5, 3.0});
  const auto kl = f64({0.001, 0.001, 0.5, 0.5, 0.05, 0.05, 0.05}).requires_grad_(true);
  const auto r = algo::flow_dppo_clamped_loss(logp, old, adv, kl, 0.01, 0.2);
  // 0: KL 0.001 below the minimum -> eps = 0.01; A > 0 and rho = 1.0513 > 1.01: clipped, -1.01.
  // 1: eps = 0.01, rho = 1.0050 inside: -2 rho. 2: KL 0.5 above the maximum -> eps = 0.2; rho =
  // 1.1052 inside 1 +- 0.2: -rho (the 1e-5 KL mask would drop this term). 3: eps = 0.2, A < 0 and
  // rho = 0.7408 < 0.8: max(0.7408, 0.8) = 0.8, clipped. 4: eps = KL = 0.05, A < 0 and rho = 1.1052
  // > 1.05: max(1.1052, 1.05) = 1.1052, the unclipped term (rho moved against A's push). 5: eps =
  // 0.05, A = 0.5, rho = 0.9048 < 0.95: max(-0.4524, -0.475) = -0.4524, unclipped. 6: eps = 0.05,
  // A = 3, rho = 1.1052 > 1.05: max(-3.3155, -3.15) = -3.15, clipped.
  check_values(r.loss, {-1.01, -2.010025041718802, -1.1051709180756477, 0.8, 1.1051709180756477,
                        -0.45241870901797976, -3.15});
  check_values(r.ratio, {1.0512710963760241, 1.005012520859401, 1.1051709180756477, 0.7408182206817179,
                         1.1051709180756477, 0.9048374180359595, 1.1051709180756477});
  CHECK(as_bools(r.clipped) == std::vector<bool>{true, false, false, true, false, false, true});
  // d loss / d logp = -A rho on the unclipped branch, 0 on the clipped one; no gradient reaches
  // the KL (it sets the clip range, a constant).
  r.loss.sum().backward();
  check_values(logp.grad(), {0.0, -2.010025041718802, -1.1051709180756477, 0.0, 1.1051709180756477,
                             -0.45241870901797976, 0.0});
  CHECK_FALSE(kl.grad().defined());
  // The bounds are options: a range fixed at 0.1 (min = max) clips sample 1 no more (|rho - 1| =
  // 0.005 < 0.1) and sample 0 no more either (0.0513 < 0.1): -A rho for both.
  const auto fixed = algo::flow_dppo_clamped_loss(logp.detach(), old, adv, kl.detach(), 0.1, 0.1);
  check_values(fixed.loss.slice(0, 0, 2), {-1.0512710963760241, -2.010025041718802});
  // Shapes and bounds are checked, naming the value.
  CHECK_THROWS_WITH(algo::flow_dppo_clamped_loss(logp, old, adv, kl.slice(0, 0, 3), 0.01, 0.2),
                    Catch::Contains("kl sizes"));
  CHECK_THROWS_WITH(algo::flow_dppo_clamped_loss(logp, old, adv, kl, -0.5, 0.2), Catch::Contains("region_min = -0.5"));
  CHECK_THROWS_WITH(algo::flow_dppo_clamped_loss(logp, old, adv, kl, 0.3, 0.2), Catch::Contains("region_max = 0.2"));
}

TEST_CASE("Flow-DPPO with trust_region = clamped_kl equals seed 000's formula on a hand-made rollout", "[flow][cpu]") {
  // Two samples, w_old = 0.5 -> w_new = 0.7: the step mean moves by dm = -0.1, so every sample's
  // KL to the sampling step is dm^2 / (2 * 0.49) = 0.0102 (just above the 0.01 minimum).
  const std::vector<double> xn{0.1, 0.6};
  const double advs[2] = {1.0, -1.0};
  const auto batch = hand_rollout(xn, {1.0f, -1.0f});
  const double w_new = 0.7;
  const double dm = hand_mean(w_new) - hand_mean(w_old);
  const double kl = dm * dm / (2 * step_std * step_std);
  auto hand_policy = [&](double w, double eps) {
    double p = 0;
    for (std::size_t i = 0; i < 2; ++i) {
      const double rho = std::exp(hand_logp(xn[i], w) - hand_logp(xn[i], w_old));
      p += std::max(-advs[i] * rho, -advs[i] * std::min(std::max(rho, 1 - eps), 1 + eps)) / 2;
    }
    return p;
  };
  const double rho0 = std::exp(hand_logp(xn[0], w_new) - hand_logp(xn[0], w_old));  // 1.0751
  const double rho1 = std::exp(hand_logp(xn[1], w_new) - hand_logp(xn[1], w_old));  // 0.9708
  REQUIRE(rho0 > 1.05);
  REQUIRE((rho1 > 0.95 && rho1 < 1 - kl));
  SECTION("default bounds: eps = KL = 0.0102, both samples clipped") {
    auto ms = scale_models(w_new, w_old);
    algo::flow_dppo<> a({.trust_region = algo::dppo_trust_region::clamped_kl, .timestep_fraction = 0.5});
    const auto terms = a.loss(ms, batch, {});
    // By hand: -(1 + kl) for sample 0 (A = 1), (1 - kl) for sample 1 (A = -1).
    CHECK(terms.policy == Approx((-(1 + kl) + (1 - kl)) / 2).epsilon(1e-5));
    CHECK(terms.policy == Approx(hand_policy(w_new, kl)).epsilon(1e-5));
    CHECK(terms.clip_fraction == Approx(1.0));
    CHECK(terms.extra.at("flow/kl_to_old") == Approx(kl).epsilon(1e-4));
    CHECK(terms.extra.at("flow/clip_range") == Approx(kl).epsilon(1e-4));
    // The default mask (delta = 1e-5) drops both: each ratio moved the way its advantage pushes.
    algo::flow_dppo<> mask({.timestep_fraction = 0.5});
    const auto m = mask.loss(ms, batch, {});
    CHECK(m.policy == 0.0);
    CHECK(m.clip_fraction == Approx(1.0));
    CHECK(m.extra.count("flow/clip_range") == 0);
  }
  SECTION("region_min = 0.05: sample 1 inside, its gradient matches a finite difference") {
    auto ms = scale_models(w_new, w_old);
    algo::flow_dppo<> a({.trust_region = algo::dppo_trust_region::clamped_kl, .region_min = 0.05,
                         .timestep_fraction = 0.5});
    const auto terms = a.loss(ms, batch, {});
    CHECK(terms.policy == Approx((-1.05 + rho1) / 2).epsilon(1e-5));
    CHECK(terms.clip_fraction == Approx(0.5));
    CHECK(terms.extra.at("flow/clip_range") == Approx(0.05).epsilon(1e-6));
    terms.total.backward();
    const double h = 1e-5, fd = (hand_policy(w_new + h, 0.05) - hand_policy(w_new - h, 0.05)) / (2 * h);
    REQUIRE(std::abs(fd) > 1e-3);
    CHECK(ms.policy.net()->w.grad().item<double>() == Approx(fd).epsilon(1e-3));
  }
}

TEST_CASE("Flow-DPPO's trust-region options: names, defaults and validation", "[flow][cpu]") {
  algo::flow_dppo_options o;
  CHECK(o.trust_region == algo::dppo_trust_region::kl_mask);  // the UniRL mask stays the default
  CHECK(o.region_min == 0.01);
  CHECK(o.region_max == 0.2);
  options::apply_overrides(o, {"trust_region=clamped_kl", "region_min=0.02", "region_max=0.1"});
  CHECK(o.trust_region == algo::dppo_trust_region::clamped_kl);
  CHECK(o.region_min == 0.02);
  CHECK(o.region_max == 0.1);
  CHECK_THROWS_WITH(options::apply_overrides(o, {"trust_region=clamp"}),
                    Catch::Contains("trust_region") && Catch::Contains("kl_mask, clamped_kl"));
  // As the algorithm's options in a trainer recipe: algorithm.trust_region=clamped_kl.
  trainer_options<algo::flow_dppo<>> to;
  options::apply_overrides(to, {"algorithm.trust_region=clamped_kl", "algorithm.region_max=0.5"});
  CHECK(to.algorithm.trust_region == algo::dppo_trust_region::clamped_kl);
  CHECK(to.algorithm.region_max == 0.5);
  // Bad bounds: 0 <= region_min <= region_max, the bad value named.
  CHECK_THROWS_WITH(algo::flow_dppo<>({.region_min = -0.01}),
                    Catch::Contains("region_min") && Catch::Contains("-0.01") && Catch::Contains(">= 0"));
  CHECK_THROWS_WITH(algo::flow_dppo<>({.region_min = 0.3, .region_max = 0.2}),
                    Catch::Contains("region_max") && Catch::Contains("0.2") && Catch::Contains("region_min (0.3)"));
  CHECK_THROWS_AS(algo::flow_dppo<>({.region_min = 0.3, .region_max = 0.2}), unirl::config_error);
  CHECK_NOTHROW(algo::flow_dppo<>({.trust_region = algo::dppo_trust_region::clamped_kl, .region_min = 0.1,
                                   .region_max = 0.1}));
}
