#pragma once
/// \file flow_samplers.hpp
/// Samplers (policies) of the flow track, each with per-step Gaussian log-probabilities
/// (docs/flow.md). Every step of every sampler is affine in the state and the model output:
/// `mean = cx * x + cm * model(x, t, cond)`, `x' = mean + std * xi`, so a sampler is its scalar
/// `coefficients(t, t_next)` (plain `UNIRL_HOST_DEVICE` maths shared with any kernel) plus what
/// the model predicts (velocity or noise) and its time grid.
///
/// | sampler            | model     | std of a step                    |
/// |--------------------|-----------|----------------------------------|
/// | `ode::euler`       | velocity  | 0 (deterministic)                |
/// | `sde::flow_grpo`   | velocity  | `a sqrt(t/(1-t)) sqrt(|dt|)`     |
/// | `sde::cps`         | velocity  | `t_next sin(a pi/2)`             |
/// | `sde::dance`       | velocity  | `eta sqrt(|dt|)`                 |
/// | `sde::ddim`        | noise     | `eta sqrt((1-ab')/(1-ab)) sqrt(1-ab/ab')` |
///
/// Every tensor keeps the floating type of the states: a float64 model (or float64 `noise`) gives
/// a float64 trajectory, means and log-probs. Each function takes the execution policy first
/// (`exec::automatic` by default; the flow algorithms pass theirs): `denoise_step` has a fused CPU
/// implementation (`cx x + cm out` as one multiply-add kernel, `exec::cpu` / `automatic` on CPU
/// tensors; it may differ from the reference in the last bit), the other flow ops the reference
/// only. Sampling and replay run the same implementation, so a replay stays bit-exact.
///
/// ```cpp
/// unirl::sde::flow_grpo sampler({.steps = 10, .noise_level = 0.7});
/// auto batch = unirl::sample_trajectory(sampler, model, labels);   // (B, 11, C, H, W)
/// auto step = unirl::denoise_step(sampler, model, batch.trajectory.select(1, 3), t, t_next, labels);
/// auto logp = unirl::gaussian_log_prob(batch.trajectory.select(1, 4), step.mean, step.std);
/// auto same = unirl::sample_trajectory<unirl::exec::reference>(sampler, model, labels);
/// ```
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/execution.hpp>
#include <unirl/concepts/flow.hpp>
#include <unirl/concepts/flow_sampler.hpp>
#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/ops/gaussian.hpp>
#include <unirl/rollout/flow.hpp>

// logprob_reduction, step_coefficients and SamplerFor: concepts/flow_sampler.hpp.

template <>
inline constexpr std::array unirl::enum_names<unirl::logprob_reduction>{std::string_view{"mean"},
                                                                                std::string_view{"sum"}};

namespace unirl {

/// Options of the built-in flow-track samplers (each one's `options`); each reads the fields it
/// documents. A sampler of one's own carries its own `options` type, which the flow algorithms'
/// `sampler` option then holds (`typename Sampler::options`).
struct flow_sampler_options {
  std::int64_t steps = 10;       // denoising steps K
  double noise_level = 0.7;      // a: Flow-GRPO sigma_t = a sqrt(t/(1-t)); CPS std = t_next sin(a pi/2)
  double dance_eta = 0.3;        // DanceGRPO eta
  double ddim_eta = 1.0;         // DDIM eta (0 = deterministic DDIM)
  double shift = 1.0;            // flow time shift t' = s t / (1 + (s-1) t) (SD3); 1 = uniform grid
  logprob_reduction reduction = logprob_reduction::mean;

  void validate(const std::string& p) const {
    options::require(steps >= 1, p + "steps", steps, ">= 1");
    options::require(noise_level >= 0.0 && noise_level <= 1.0, p + "noise_level", noise_level, "in [0, 1]");
    options::require(dance_eta >= 0.0, p + "dance_eta", dance_eta, ">= 0");
    options::require(ddim_eta >= 0.0 && ddim_eta <= 1.0, p + "ddim_eta", ddim_eta, "in [0, 1]");
    options::require(shift > 0.0, p + "shift", shift, "> 0");
  }
};

}  // namespace unirl

BOOST_HANA_ADAPT_STRUCT(unirl::flow_sampler_options, steps, noise_level, dance_eta, ddim_eta, shift,
                        reduction);

namespace unirl {

/// One evaluated step: the Gaussian's mean (B, S...) and its standard deviation.
struct gaussian_step {
  torch::Tensor mean;
  double std = 0.0;
};

/// Scalar maths of the samplers, shared by the tensor code here and any kernel.
namespace flow_math {
inline constexpr double pi = 3.14159265358979323846;

/// Flow-GRPO SDE (arXiv 2505.05470): `sigma_t = a sqrt(t/(1-t))` (1 - t_next at t = 1),
/// `mean = x + [v + sigma^2/(2t) (x + (1-t) v)] dt`, std `sigma sqrt(-dt)`.
UNIRL_HOST_DEVICE inline step_coefficients flow_grpo(double t, double t_next, double a) {
  const double dt = t_next - t;
  const double denom = t >= 1.0 ? 1.0 - t_next : 1.0 - t;
  const double sigma = a * std::sqrt(t / denom);
  const double k = sigma * sigma / (2.0 * t);
  return {1.0 + k * dt, dt * (1.0 + k * (1.0 - t)), sigma * std::sqrt(-dt)};
}

/// DanceGRPO: `mean = x + dt [v + eta^2/2 (x - (1-t) x0_hat)/t^2]` with `x0_hat = x - t v`,
/// std `eta sqrt(t - t_next)`.
UNIRL_HOST_DEVICE inline step_coefficients dance(double t, double t_next, double eta) {
  const double dt = t_next - t;
  const double k = eta * eta / (2.0 * t);  // (x - (1-t)(x - t v)) / t^2 = (x + (1-t) v) / t
  return {1.0 + k * dt, dt * (1.0 + k * (1.0 - t)), eta * std::sqrt(-dt)};
}

/// CPS (arXiv 2509.05952): `std = t_next sin(a pi/2)`,
/// `mean = (1-t_next) x0_hat + sqrt(t_next^2 - std^2) x1_hat`, `x0_hat = x - t v`, `x1_hat = x + (1-t) v`.
UNIRL_HOST_DEVICE inline step_coefficients cps(double t, double t_next, double a) {
  const double sd = t_next * std::sin(a * pi / 2.0);
  const double c = std::sqrt(std::fmax(t_next * t_next - sd * sd, 0.0));
  return {(1.0 - t_next) + c, -(1.0 - t_next) * t + c * (1.0 - t), sd};
}

/// Deterministic Euler step of the probability-flow ODE: `x' = x + v dt`.
UNIRL_HOST_DEVICE inline step_coefficients euler(double t, double t_next) { return {1.0, t_next - t, 0.0}; }

/// DDIM with eta (DDPO `ddim_with_logprob.py`), in terms of the predicted noise, from
/// `abar = abar_t` to `abar_next = abar_t'` (1 past the last step).
UNIRL_HOST_DEVICE inline step_coefficients ddim(double abar, double abar_next, double eta) {
  const double var = (1.0 - abar_next) / (1.0 - abar) * (1.0 - abar / abar_next);
  const double sigma = eta * std::sqrt(std::fmax(var, 0.0));
  const double dir = std::sqrt(std::fmax(1.0 - abar_next - sigma * sigma, 0.0));
  return {std::sqrt(abar_next / abar), dir - std::sqrt(abar_next) * std::sqrt(1.0 - abar) / std::sqrt(abar), sigma};
}

/// Per-element Gaussian log-density of a deviation `d = x' - mean` with standard deviation `s`.
UNIRL_HOST_DEVICE inline double gaussian_log_density(double d, double s) {
  return -d * d / (2.0 * s * s) - std::log(s) - 0.5 * std::log(2.0 * pi);
}

/// Shifted flow time (SD3): `s t / (1 + (s - 1) t)`.
UNIRL_HOST_DEVICE inline double shift_time(double t, double s) { return s * t / (1.0 + (s - 1.0) * t); }
}  // namespace flow_math

namespace detail {
inline torch::Tensor reduce_elements(const torch::Tensor& x, logprob_reduction r) {
  const auto flat = x.flatten(1);
  return r == logprob_reduction::mean ? flat.mean(1) : flat.sum(1);
}

inline std::vector<double> flow_grid(std::int64_t steps, double shift) {
  std::vector<double> ts(static_cast<std::size_t>(steps) + 1);
  for (std::int64_t k = 0; k <= steps; ++k)
    ts[static_cast<std::size_t>(k)] =
        flow_math::shift_time(1.0 - static_cast<double>(k) / static_cast<double>(steps), shift);
  ts.back() = 0.0;
  return ts;
}

// Common part of the velocity samplers.
struct velocity_sampler_base {
  using options = flow_sampler_options;  // what the algorithms' `sampler` option holds for it
  flow_sampler_options opts;
  explicit velocity_sampler_base(const flow_sampler_options& o) : opts(o) { unirl::options::validate(opts); }

  template <models::VelocityModel M>
  torch::Tensor predict(M& m, const torch::Tensor& x, double t, const torch::Tensor& cond) const {
    return m.velocity(x, torch::full({x.size(0)}, t, x.options()), cond);
  }
  template <class M>
  std::vector<double> timesteps(M&) const { return flow_grid(opts.steps, opts.shift); }
  logprob_reduction reduction() const { return opts.reduction; }
};
}  // namespace detail

/// Deterministic samplers.
namespace ode {
/// Euler integration of the probability-flow ODE (no log-probs): evaluation, RAM / NFT rollouts.
struct euler : detail::velocity_sampler_base {
  explicit euler(const flow_sampler_options& o = {}) : velocity_sampler_base(o) {}
  template <class M>
  step_coefficients coefficients(M&, double t, double t_next) const { return flow_math::euler(t, t_next); }
};
}  // namespace ode

/// Stochastic samplers with Gaussian log-probabilities.
namespace sde {
/// The Flow-GRPO SDE (`noise_level` = a).
struct flow_grpo : detail::velocity_sampler_base {
  explicit flow_grpo(const flow_sampler_options& o = {}) : velocity_sampler_base(o) {}
  template <class M>
  step_coefficients coefficients(M&, double t, double t_next) const {
    return flow_math::flow_grpo(t, t_next, opts.noise_level);
  }
};

/// Coefficients-preserving sampling (`noise_level` = a); its last step (t_next = 0) is deterministic.
/// It preserves the coefficients of x0_hat and of the noise, not the marginal variance: with a
/// posterior-mean model each step renews a fixed share sin^2(a pi/2) of the noise from x1_hat,
/// whose variance is below 1, so spread-out data come out narrower than the ODE's at large a.
struct cps : detail::velocity_sampler_base {
  explicit cps(const flow_sampler_options& o = {}) : velocity_sampler_base(o) {}
  template <class M>
  step_coefficients coefficients(M&, double t, double t_next) const { return flow_math::cps(t, t_next, opts.noise_level); }
};

/// DanceGRPO's SDE (`dance_eta` = eta).
struct dance : detail::velocity_sampler_base {
  explicit dance(const flow_sampler_options& o = {}) : velocity_sampler_base(o) {}
  template <class M>
  step_coefficients coefficients(M&, double t, double t_next) const { return flow_math::dance(t, t_next, opts.dance_eta); }
};

/// DDIM with eta for noise-prediction (DDPM) models. Timesteps are indices
/// `(K-1-k) T/K`, k = 0..K-1, then `-T/K` (abar = 1: the last step is deterministic).
struct ddim {
  using options = flow_sampler_options;  // what the algorithms' `sampler` option holds for it
  flow_sampler_options opts;
  explicit ddim(const flow_sampler_options& o = {}) : opts(o) { unirl::options::validate(opts); }

  template <models::NoiseModel M>
  torch::Tensor predict(M& m, const torch::Tensor& x, double t, const torch::Tensor& cond) const {
    return m.epsilon(x, torch::full({x.size(0)}, t, x.options()), cond);
  }
  template <models::NoiseModel M>
  std::vector<double> timesteps(M& m) const {
    const auto T = m.alphas_cumprod().size(0);
    UNIRL_CHECK(opts.steps <= T, "ddim: steps = ", opts.steps, ": expected <= the ", T, " training timesteps");
    const auto ratio = T / opts.steps;
    std::vector<double> ts;
    for (std::int64_t k = 0; k < opts.steps; ++k) ts.push_back(static_cast<double>((opts.steps - 1 - k) * ratio));
    ts.push_back(-static_cast<double>(ratio));
    return ts;
  }
  template <models::NoiseModel M>
  step_coefficients coefficients(M& m, double t, double t_next) const {
    const auto abar = m.alphas_cumprod();
    const double a = abar[static_cast<std::int64_t>(t)].template item<double>();
    const double an = t_next < 0 ? 1.0 : abar[static_cast<std::int64_t>(t_next)].template item<double>();
    return flow_math::ddim(a, an, opts.ddim_eta);
  }
  logprob_reduction reduction() const { return opts.reduction; }
};
}  // namespace sde

/// Per-sample Gaussian log-prob (B,) of `x_next` under N(mean, std^2), reduced over elements:
/// `reduce_el [-(x' - mean)^2 / (2 std^2) - log std - log(2 pi) / 2]`, in the mean's dtype; zeros
/// for a deterministic step (std = 0). `x_next` is a constant (the stored state). The op with its
/// three implementations (reference, fused CPU, CUDA kernel) is `ops::gaussian_logprob`.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor gaussian_log_prob(const torch::Tensor& x_next, const torch::Tensor& mean, double std,
                                logprob_reduction r = logprob_reduction::mean) {
  UNIRL_CHECK(x_next.defined() && mean.defined() && x_next.sizes() == mean.sizes(), "gaussian_log_prob: x_next sizes ",
              x_next.defined() ? x_next.sizes() : c10::IntArrayRef{}, " differ from the mean's ",
              mean.defined() ? mean.sizes() : c10::IntArrayRef{});
  UNIRL_CHECK(mean.dim() >= 1 && mean.is_floating_point(), "gaussian_log_prob: the mean must be a floating (B, S...) "
              "tensor, got ", mean.sizes(), " ", mean.dtype());
  if (!(std > 0.0)) return torch::zeros({mean.size(0)}, mean.options());
  return ops::gaussian_logprob<Exec>(x_next, mean, std, r == logprob_reduction::mean);
}

/// Closed-form KL (B,) between N(mean_a, std^2) and N(mean_b, std^2): `(mean_a - mean_b)^2 / (2 std^2)`,
/// reduced over elements like the log-prob, in mean_a's dtype; zeros for a deterministic step.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor gaussian_kl(const torch::Tensor& mean_a, const torch::Tensor& mean_b, double std,
                          logprob_reduction r = logprob_reduction::mean) {
  UNIRL_CHECK(mean_a.defined() && mean_b.defined() && mean_a.sizes() == mean_b.sizes(), "gaussian_kl: mean sizes ",
              mean_a.defined() ? mean_a.sizes() : c10::IntArrayRef{}, " and ",
              mean_b.defined() ? mean_b.sizes() : c10::IntArrayRef{}, " differ");
  UNIRL_CHECK(mean_a.dim() >= 1 && mean_a.is_floating_point(), "gaussian_kl: the means must be floating (B, S...) "
              "tensors, got ", mean_a.sizes(), " ", mean_a.dtype());
  if (!(std > 0.0)) return torch::zeros({mean_a.size(0)}, mean_a.options());
  return exec::dispatch<Exec>(mean_a, [&] {
    return detail::reduce_elements((mean_a - mean_b.to(mean_a.scalar_type())).square() / (2.0 * std * std), r);
  });
}

/// Evaluates one step of `sampler` at state `x` (B, S...) from time `t` to `t_next`:
/// `mean = cx x + cm model(x, t, cond)` in the model output's dtype (reference: two scaled
/// tensors and their sum; CPU: `add(cx x, out, alpha = cm)`, one multiply-add kernel).
template <ExecutionPolicy Exec = exec::automatic, class S, class M>
  requires SamplerFor<S, M>
gaussian_step denoise_step(const S& sampler, M& model, const torch::Tensor& x, double t, double t_next,
                           const torch::Tensor& cond) {
  const auto c = sampler.coefficients(model, t, t_next);
  const auto out = sampler.predict(model, x, t, cond);
  const auto xs = x.to(out.scalar_type());
  return {exec::dispatch<Exec>(
              out, [&] { return c.cx * xs + c.cm * out; }, [&] { return torch::add(xs * c.cx, out, c.cm); }),
          c.std};
}

namespace detail {
/// The floating type of a trajectory drawn without given noise: the model's (`dtype()`, else its
/// first floating parameter), else the conditions' when they are floating embeddings, else
/// LibTorch's default dtype.
template <class M>
torch::ScalarType sample_dtype(M& model, const torch::Tensor& cond) {
  if constexpr (requires {
                  { model.dtype() } -> std::convertible_to<torch::ScalarType>;
                }) {
    return model.dtype();
  } else {
    if constexpr (requires { model.parameters(); })
      for (const auto& p : model.parameters())
        if (p.defined() && p.is_floating_point()) return p.scalar_type();
    if (cond.is_floating_point()) return cond.scalar_type();
    return c10::typeMetaToScalarType(torch::get_default_dtype());
  }
}
}  // namespace detail

/// Runs `sampler` from noise to samples for every condition in `cond` ((B,) labels or (B, D)),
/// without gradients, recording the trajectory, means, stds and log-probs. `noise` (B, S...)
/// fixes the initial state (evaluation with common random numbers) and its floating type; by
/// default it is drawn in the model's floating type (`detail::sample_dtype`).
template <ExecutionPolicy Exec = exec::automatic, class S, class M>
  requires SamplerFor<S, M>
flow_rollout sample_trajectory(const S& sampler, M& model, const torch::Tensor& cond, const torch::Tensor& noise = {}) {
  torch::NoGradGuard no_grad;
  UNIRL_CHECK(cond.defined() && cond.dim() >= 1, "sample_trajectory: conditions must be (B,) or (B, D)");
  const auto b = cond.size(0);
  std::vector<std::int64_t> shape{b};
  for (auto s : model.sample_shape()) shape.push_back(s);
  torch::Tensor x;
  if (noise.defined()) {
    UNIRL_CHECK(noise.sizes() == c10::IntArrayRef(shape), "sample_trajectory: noise has sizes ", noise.sizes(),
                "; expected ", c10::IntArrayRef(shape));
    UNIRL_CHECK(noise.is_floating_point(), "sample_trajectory: noise has dtype ", noise.dtype(),
                "; expected a floating type");
    x = noise.to(cond.device());
  } else {
    x = torch::randn(shape, torch::TensorOptions().dtype(detail::sample_dtype(model, cond)).device(cond.device()));
  }
  const std::vector<double> ts = sampler.timesteps(model);
  const auto K = static_cast<std::int64_t>(ts.size()) - 1;
  UNIRL_CHECK(K >= 1, "sample_trajectory: the sampler gave ", ts.size(), " timesteps; expected >= 2");
  std::vector<torch::Tensor> states{x}, means, logps;
  std::vector<double> stds;
  for (std::int64_t k = 0; k < K; ++k) {
    const auto st = denoise_step<Exec>(sampler, model, x, ts[static_cast<std::size_t>(k)],
                                       ts[static_cast<std::size_t>(k) + 1], cond);
    const auto next = st.std > 0.0 ? st.mean + st.std * torch::randn_like(st.mean) : st.mean;
    logps.push_back(gaussian_log_prob<Exec>(next, st.mean, st.std, sampler.reduction()));
    means.push_back(st.mean);
    stds.push_back(st.std);
    states.push_back(next);
    x = next;
  }
  const auto dopt = torch::TensorOptions().dtype(torch::kFloat64).device(cond.device());
  flow_rollout r;
  r.conditions = cond;
  r.trajectory = torch::stack(states, 1);
  r.means = torch::stack(means, 1);
  r.log_probs = torch::stack(logps, 1);
  r.stds = torch::tensor(stds, torch::kFloat64).to(cond.device()).unsqueeze(0).expand({b, K}).contiguous();
  r.timesteps = torch::tensor(ts, torch::kFloat64).to(dopt).unsqueeze(0).expand({b, K + 1}).contiguous();
  return r;
}

/// Re-evaluates step `k` of a stored rollout under `model`: the mean, std and the log-prob of
/// the stored next state. On the policy that drew it, this reproduces `log_probs[:, k]` exactly.
struct replayed_step {
  gaussian_step step;
  torch::Tensor log_prob;  // (B,)
};

template <ExecutionPolicy Exec = exec::automatic, class S, class M>
  requires SamplerFor<S, M>
replayed_step replay_step(const S& sampler, M& model, const flow_rollout& b, std::int64_t k) {
  UNIRL_CHECK(k >= 0 && k < b.steps(), "replay_step: step ", k, " out of [0, ", b.steps(), ")");
  const auto ts = b.timesteps.select(0, 0).to(torch::kCPU);
  const double t = ts[k].item<double>(), tn = ts[k + 1].item<double>();
  auto st = denoise_step<Exec>(sampler, model, b.trajectory.select(1, k), t, tn, b.conditions);
  auto lp = gaussian_log_prob<Exec>(b.trajectory.select(1, k + 1), st.mean, st.std, sampler.reduction());
  return {std::move(st), std::move(lp)};
}

}  // namespace unirl
