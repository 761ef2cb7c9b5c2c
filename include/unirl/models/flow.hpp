#pragma once
/// \file flow.hpp
/// Model adapters of the flow track: a flow-matching adapter (velocity `v(x_t, t, cond)`), a
/// DDPM adapter (noise prediction `eps(x_t, t, cond)` with `q_sample` and the float64 beta
/// schedule) and a video adapter over (B, F, C, H, W). All three apply classifier-free guidance.
///
/// Conventions (docs/flow.md): t = 0 is data, t = 1 noise, `x_t = (1-t) x0 + t eps`,
/// target velocity `eps - x0`.
///
/// ```cpp
/// auto model = unirl::models::flow_model<unirl::models::mlp_velocity_net>(
///     unirl::models::mlp_velocity_net({.shape = {1, 8, 8}, .num_classes = 10}), {1, 8, 8},
///     {.guidance = 2.0});
/// auto v = model.velocity(x, torch::full({x.size(0)}, 0.5), labels);   // guided velocity
/// auto loss = model.flow_matching_loss(images, labels, 0.1);           // pretraining
/// ```
///
/// A network `Net` (a `torch::nn::ModuleHolder`) plugs in when it has
/// `torch::Tensor forward(x, t, cond)` with t a (B,) float tensor in [0, 1], and
/// `torch::Tensor null_condition(cond)` giving the unconditional condition of the same shape.
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/flow.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/concepts/track.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/precision.hpp>
#include <unirl/models/module_adapter.hpp>

namespace unirl::models {

// VelocityModel, NoiseModel and ConditionalNet: concepts/flow.hpp.

/// Options shared by the flow and DDPM adapters.
struct flow_model_options {
  double guidance = 1.0;  // classifier-free guidance scale w: v_u + w (v_c - v_u); 1 = conditional only

  void validate(const std::string& prefix) const {
    options::require(guidance >= 0.0, prefix + "guidance", guidance, ">= 0");
  }
};

/// The DDPM beta schedule (docs/flow.md): linear betas, abar in float64.
struct ddpm_schedule {
  std::int64_t num_train_timesteps = 1000;
  double beta_start = 1e-4;
  double beta_end = 0.02;

  void validate(const std::string& prefix) const {
    options::require(num_train_timesteps >= 2, prefix + "num_train_timesteps", num_train_timesteps, ">= 2");
    options::require(beta_start > 0.0 && beta_start <= beta_end && beta_end < 1.0, prefix + "beta_start",
                     beta_start, "0 < beta_start <= beta_end < 1");
  }
};

}  // namespace unirl::models

BOOST_HANA_ADAPT_STRUCT(unirl::models::flow_model_options, guidance);
BOOST_HANA_ADAPT_STRUCT(unirl::models::ddpm_schedule, num_train_timesteps, beta_start, beta_end);

namespace unirl::models {

/// `abar_t = prod_{s<=t} (1 - beta_s)`, t = 0..T-1, betas linear from beta_start to beta_end,
/// computed in float64 (as diffusers).
/// ```cpp
/// auto abar = unirl::models::ddpm_alphas_cumprod({});   // (1000,) float64, abar[0] = 1 - 1e-4
/// ```
inline torch::Tensor ddpm_alphas_cumprod(const ddpm_schedule& s) {
  options::validate(s);
  const auto betas = torch::linspace(s.beta_start, s.beta_end, s.num_train_timesteps, torch::kFloat64);
  return torch::cumprod(1.0 - betas, 0);
}

namespace detail {
inline void check_sample(const torch::Tensor& x, const std::vector<std::int64_t>& shape, const char* who) {
  UNIRL_CHECK(x.dim() == static_cast<std::int64_t>(shape.size()) + 1, who, ": input has sizes ", x.sizes(),
              "; expected (B, ", c10::IntArrayRef(shape), ")");
  for (std::size_t i = 0; i < shape.size(); ++i)
    UNIRL_CHECK(x.size(static_cast<std::int64_t>(i) + 1) == shape[i], who, ": input has sizes ", x.sizes(),
                "; expected (B, ", c10::IntArrayRef(shape), ")");
}

// Classifier-free guidance around one network call: `out_u + w (out_c - out_u)` in one batched
// forward when w != 1.
template <class Net>
torch::Tensor guided(Net net, const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond, double w) {
  if (w == 1.0) return upcast(net->forward(x, t, cond));  // float32 under autocast: the samplers' means
  const auto b = x.size(0);
  const auto out =
      upcast(net->forward(torch::cat({x, x}), torch::cat({t, t}), torch::cat({cond, net->null_condition(cond)})));
  const auto c = out.slice(0, 0, b), u = out.slice(0, b, 2 * b);
  return u + w * (c - u);
}

inline torch::Tensor as_time(const torch::Tensor& t, const torch::Tensor& x) {
  auto tt = t.to(x.device(), x.scalar_type());
  if (tt.dim() == 0) tt = tt.expand({x.size(0)});
  UNIRL_CHECK(tt.dim() == 1 && tt.size(0) == x.size(0), "time tensor has sizes ", t.sizes(), "; expected (",
              x.size(0), ",) or a scalar");
  return tt;
}

// The unconditional-dropout used in pretraining: each condition replaced by the null one with
// probability p.
template <class Net>
torch::Tensor drop_conditions(Net& net, const torch::Tensor& cond, double p) {
  if (p <= 0.0) return cond;
  const auto drop = torch::rand({cond.size(0)}, torch::TensorOptions().device(cond.device())) < p;
  auto shape = std::vector<std::int64_t>(static_cast<std::size_t>(cond.dim()), 1);
  shape[0] = cond.size(0);
  return torch::where(drop.reshape(shape), net->null_condition(cond), cond);
}

/// Shared implementation of the velocity adapters (image and video).
template <class Derived, class Net>
class velocity_adapter : public module_adapter<Derived, Net> {
 public:
  using track = flow_track;

  velocity_adapter(Net net, std::vector<std::int64_t> sample_shape, flow_model_options o = {})
      : module_adapter<Derived, Net>(std::move(net)), shape_(std::move(sample_shape)), opts_(o) {
    options::validate(opts_);
  }

  /// Guided velocity (B, S...) at `x` (B, S...), time `t` ((B,) or scalar) and `cond`.
  torch::Tensor velocity(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond) {
    check_sample(x, shape_, "flow_model::velocity");
    return guided(this->net_, x, as_time(t, x), cond, opts_.guidance);
  }

  /// Conditional flow-matching loss `mean ||v(x_t, t, c) - (eps - x0)||^2`, t ~ U(0, 1), with
  /// the condition dropped to the null one with probability `p_uncond` (for guidance later).
  torch::Tensor flow_matching_loss(const torch::Tensor& x0, const torch::Tensor& cond, double p_uncond = 0.0) {
    check_sample(x0, shape_, "flow_model::flow_matching_loss");
    const auto b = x0.size(0);
    const auto t = torch::rand({b}, x0.options());
    const auto eps = torch::randn_like(x0);
    auto tb = t.reshape(bshape(b));
    const auto xt = (1 - tb) * x0 + tb * eps;
    const auto v = this->net_->forward(xt, t, drop_conditions(this->net_, cond, p_uncond));
    return (v - (eps - x0)).pow(2).mean();
  }

  std::vector<std::int64_t> sample_shape() const { return shape_; }
  double guidance() const { return opts_.guidance; }
  void set_guidance(double w) {
    UNIRL_CHECK(w >= 0.0, "set_guidance: w = ", w, ": expected >= 0");
    opts_.guidance = w;
  }

 protected:
  std::vector<std::int64_t> bshape(std::int64_t b) const {
    std::vector<std::int64_t> s(shape_.size() + 1, 1);
    s[0] = b;
    return s;
  }
  std::vector<std::int64_t> shape_;
  flow_model_options opts_;
};
}  // namespace detail

/// Flow-matching adapter over an image network: `velocity(x_t, t, cond)` with guidance.
template <class Net>
class flow_model : public detail::velocity_adapter<flow_model<Net>, Net> {
 public:
  using detail::velocity_adapter<flow_model<Net>, Net>::velocity_adapter;
};

/// Flow-matching adapter over clips (B, F, C, H, W): the samplers and algorithms of the flow
/// track run on it unchanged (they reduce over every non-batch axis).
template <class Net>
class video_flow_model : public detail::velocity_adapter<video_flow_model<Net>, Net> {
  using base = detail::velocity_adapter<video_flow_model<Net>, Net>;

 public:
  video_flow_model(Net net, std::vector<std::int64_t> clip_shape, flow_model_options o = {})
      : base(std::move(net), std::move(clip_shape), o) {
    UNIRL_CHECK(this->shape_.size() == 4, "video_flow_model: clip shape has ", this->shape_.size(),
                " axes; expected 4 (F, C, H, W)");
  }
  std::int64_t frames() const { return this->shape_[0]; }
};

/// DDPM (noise-prediction) adapter: `epsilon(x_t, t, cond)` with t the 0-based timestep index,
/// `q_sample`, and the float64 `alphas_cumprod`. The network sees t / T in [0, 1).
/// ```cpp
/// unirl::models::ddpm_model<Net> m(net, {1, 8, 8});
/// auto xt = m.q_sample(x0, torch::full({b}, 500, torch::kLong), torch::randn_like(x0));
/// ```
template <class Net>
class ddpm_model : public module_adapter<ddpm_model<Net>, Net> {
 public:
  using track = flow_track;

  ddpm_model(Net net, std::vector<std::int64_t> sample_shape, flow_model_options o = {}, ddpm_schedule s = {})
      : module_adapter<ddpm_model<Net>, Net>(std::move(net)),
        shape_(std::move(sample_shape)),
        opts_(o),
        schedule_(s),
        abar_(ddpm_alphas_cumprod(s)) {
    options::validate(opts_);
  }

  /// Guided noise prediction at timestep indices `t` ((B,) or scalar, 0..T-1).
  torch::Tensor epsilon(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& cond) {
    detail::check_sample(x, shape_, "ddpm_model::epsilon");
    const auto tt = detail::as_time(t, x) / static_cast<double>(schedule_.num_train_timesteps);
    return detail::guided(this->net_, x, tt, cond, opts_.guidance);
  }

  /// `x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps` at indices `t` ((B,) int64).
  torch::Tensor q_sample(const torch::Tensor& x0, const torch::Tensor& t, const torch::Tensor& eps) const {
    const auto idx = t.to(torch::kCPU, torch::kInt64);
    UNIRL_CHECK(idx.dim() == 1 && idx.size(0) == x0.size(0), "ddpm_model::q_sample: t has sizes ", t.sizes(),
                "; expected (", x0.size(0), ",)");
    UNIRL_CHECK(idx.numel() == 0 || (idx.min().item<std::int64_t>() >= 0 &&
                                     idx.max().item<std::int64_t>() < schedule_.num_train_timesteps),
                "ddpm_model::q_sample: timestep out of [0, ", schedule_.num_train_timesteps, ")");
    std::vector<std::int64_t> s(shape_.size() + 1, 1);
    s[0] = x0.size(0);
    const auto a = abar_.index_select(0, idx).to(x0.device(), x0.scalar_type()).reshape(s);
    return a.sqrt() * x0 + (1 - a).sqrt() * eps;
  }

  /// Noise-prediction loss `mean ||eps_hat(x_t, t) - eps||^2` with t uniform over 0..T-1.
  torch::Tensor epsilon_loss(const torch::Tensor& x0, const torch::Tensor& cond, double p_uncond = 0.0) {
    detail::check_sample(x0, shape_, "ddpm_model::epsilon_loss");
    const auto b = x0.size(0);
    const auto t = torch::randint(0, schedule_.num_train_timesteps, {b}, torch::kInt64);
    const auto eps = torch::randn_like(x0);
    const auto xt = q_sample(x0, t, eps);
    const auto tt = t.to(x0.device(), x0.scalar_type()) / static_cast<double>(schedule_.num_train_timesteps);
    const auto out = this->net_->forward(xt, tt, detail::drop_conditions(this->net_, cond, p_uncond));
    return (out - eps).pow(2).mean();
  }

  torch::Tensor alphas_cumprod() const { return abar_; }
  std::int64_t num_train_timesteps() const { return schedule_.num_train_timesteps; }
  std::vector<std::int64_t> sample_shape() const { return shape_; }
  double guidance() const { return opts_.guidance; }
  void set_guidance(double w) {
    UNIRL_CHECK(w >= 0.0, "set_guidance: w = ", w, ": expected >= 0");
    opts_.guidance = w;
  }

 private:
  std::vector<std::int64_t> shape_;
  flow_model_options opts_;
  ddpm_schedule schedule_;
  torch::Tensor abar_;  // (T,) float64, on the CPU
};

}  // namespace unirl::models
