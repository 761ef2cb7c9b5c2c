#pragma once
/// \file flow_matching.hpp
/// Flow-matching (rectified-flow) pretraining of a velocity model on data — the flow track's
/// supervised stage: `flow_matching_trainer<Model>` runs the velocity loss with the RL trainer's
/// optimizer, schedule, clipping, guard, metrics and checkpoints (train/supervised.hpp).
///
/// ```cpp
/// using flow_t = unirl::models::flow_model<unirl::models::mlp_velocity_net>;
/// unirl::train::flow_matching_trainer<flow_t> fm(flow_t(net, {1, 8, 8}),
///     {.objective = {.p_uncond = 0.1}, .optim = {.lr = 1e-3},
///      .schedule = {.kind = unirl::train::schedule_kind::cosine}, .batch_size = 256, .steps = 800,
///      .out = "runs/pretrain"});                    // checkpoints: a finished run loads instead of training
/// fm.run([&](std::int64_t n) {
///   const auto idx = torch::randint(0, images.size(0), {n}, torch::kInt64);
///   return unirl::train::flow_matching_batch{images.index_select(0, idx), labels.index_select(0, idx)};
/// });
/// ```
/// The loss, for data x0, noise eps ~ N(0, I), t ~ U(0, 1) (or logit-normal) and the path
/// x_t = (1 - t) x0 + t eps (t = 1 is noise, as the samplers integrate it):
/// `mean over batch and elements of (v_theta(x_t, t, c) - (eps - x0))^2`, with each condition
/// replaced by the network's null condition with probability `p_uncond` (for classifier-free
/// guidance later). The network is called directly (no guidance), as in the model adapters'
/// `flow_matching_loss`, whose random draws (t, then eps, then the dropout) this follows.
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/flow.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/train/supervised.hpp>

namespace unirl::train {

/// How the flow-matching time is drawn: uniform on (0, 1), or logit-normal (sigmoid of a normal
/// with `logit_mean`, `logit_std`: more weight on the middle of the path, as SD3).
enum class flow_time_sampling { uniform, logit_normal };

}  // namespace unirl::train

template <>
inline constexpr std::array unirl::enum_names<unirl::train::flow_time_sampling>{std::string_view{"uniform"},
                                                                                std::string_view{"logit_normal"}};

namespace unirl::train {

/// Options of the flow-matching objective.
struct flow_matching_options {
  double p_uncond = 0.0;                                  // probability of the null condition (CFG training)
  flow_time_sampling time = flow_time_sampling::uniform;  // how t is drawn
  double logit_mean = 0.0;                                // logit-normal: mean of the normal
  double logit_std = 1.0;                                 // logit-normal: std of the normal

  void validate(const std::string& p) const {
    options::require(p_uncond >= 0.0 && p_uncond <= 1.0, p + "p_uncond", p_uncond, "in [0, 1]");
    options::require(logit_std > 0.0 && std::isfinite(logit_std), p + "logit_std", logit_std, "a finite number > 0");
    options::require(std::isfinite(logit_mean), p + "logit_mean", logit_mean, "a finite number");
  }
};

/// Data of one flow-matching step.
struct flow_matching_batch {
  torch::Tensor x0;    // (B, S...) data samples (the model's sample_shape)
  torch::Tensor cond;  // (B, ...) conditions (class ids, embeddings)
  std::int64_t size() const { return x0.defined() ? x0.size(0) : 0; }
  /// The samples `index` ((n,) int64, any device): a micro-batch (`micro_batch_size`).
  flow_matching_batch select(const torch::Tensor& index) const {
    return {x0.index_select(0, index.to(x0.device())), cond.index_select(0, index.to(cond.device()))};
  }
};

/// The flow-matching loss on given draws: `mean((net(x_t, t, cond) - (eps - x0))^2)` with
/// `x_t = (1 - t) x0 + t eps`; x0, eps (B, S...), t (B,) in [0, 1]. Differentiable in the net.
template <class Net>
torch::Tensor flow_matching_loss(Net& net, const torch::Tensor& x0, const torch::Tensor& cond, const torch::Tensor& t,
                                 const torch::Tensor& eps) {
  UNIRL_CHECK(x0.dim() >= 2 && eps.sizes() == x0.sizes(), "flow_matching_loss: x0 ", x0.sizes(), " and eps ",
              eps.sizes(), ": expected equal sizes (B, S...)");
  UNIRL_CHECK(t.dim() == 1 && t.size(0) == x0.size(0), "flow_matching_loss: t has sizes ", t.sizes(),
              "; expected (", x0.size(0), ",)");
  UNIRL_CHECK(cond.defined() && cond.dim() >= 1 && cond.size(0) == x0.size(0), "flow_matching_loss: cond has sizes ",
              cond.defined() ? cond.sizes() : c10::IntArrayRef{}, "; expected (", x0.size(0), ", ...)");
  std::vector<std::int64_t> shape(static_cast<std::size_t>(x0.dim()), 1);
  shape[0] = x0.size(0);
  const auto tb = t.reshape(shape);
  const auto xt = (1 - tb) * x0 + tb * eps;
  const auto v = net->forward(xt, t, cond);
  return (v - (eps - x0)).pow(2).mean();
}

/// The flow-matching objective of `supervised_trainer` on a velocity adapter whose `net()` is a
/// `ConditionalNet` (`models::flow_model`, `models::video_flow_model`): draws t, eps and the
/// condition dropout, then `flow_matching_loss`.
template <class M>
  requires VelocityModel<M> && requires(M& m) {
    { m.net() } -> ConditionalNet;
  }
struct flow_matching_objective {
  using options = flow_matching_options;
  using batch_type = flow_matching_batch;
  static constexpr std::string_view name = "flow_matching";
  options o{};
  explicit flow_matching_objective(options opts = {}) : o(opts) {}

  supervised_loss loss(M& model, const flow_matching_batch& b) const {
    const auto shape = model.sample_shape();
    if (!b.x0.defined() || b.x0.dim() != static_cast<std::int64_t>(shape.size()) + 1 ||
        b.x0.sizes().slice(1).vec() != shape) {
      std::string want = "(B";
      for (const auto d : shape) want += ", " + std::to_string(d);
      UNIRL_CHECK(false, "flow_matching_trainer: x0 has sizes ", b.x0.defined() ? b.x0.sizes() : c10::IntArrayRef{},
                  "; expected ", want, "), the model's sample shape after the batch axis");
    }
    const auto dev = model.parameters().front().device();
    const auto x0 = b.x0.to(dev), cond = b.cond.to(dev);
    const auto n = x0.size(0);
    torch::Tensor t;
    if (o.time == flow_time_sampling::uniform) t = torch::rand({n}, x0.options());
    else t = torch::sigmoid(torch::randn({n}, x0.options()) * o.logit_std + o.logit_mean);
    const auto eps = torch::randn_like(x0);
    auto& net = model.net();
    auto c = cond;
    if (o.p_uncond > 0.0) {
      const auto drop = torch::rand({n}, torch::TensorOptions().device(cond.device())) < o.p_uncond;
      std::vector<std::int64_t> s(static_cast<std::size_t>(cond.dim()), 1);
      s[0] = n;
      c = torch::where(drop.reshape(s), net->null_condition(cond), cond);
    }
    return {flow_matching_loss(net, x0, c, t, eps), n, 0};
  }
};

/// The flow track's pretraining stage: `supervised_trainer` over `flow_matching_objective`
/// (see train/supervised.hpp for the options, `step`, `run`, `save` / `load`).
template <class M, class Parallel = ::unirl::parallel::single_device>
using flow_matching_trainer = supervised_trainer<M, flow_matching_objective<M>, Parallel>;

}  // namespace unirl::train

BOOST_HANA_ADAPT_STRUCT(unirl::train::flow_matching_options, p_uncond, time, logit_mean, logit_std);
