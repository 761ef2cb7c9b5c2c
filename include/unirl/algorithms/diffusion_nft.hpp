#pragma once
/// \file diffusion_nft.hpp
/// DiffusionNFT (arXiv 2509.16117, docs/flow.md): online RL on the forward process. With
/// `r = 0.5 + 0.5 clip(A / Z, -1, 1)` in [0, 1] (`nft_weight`), an implicit positive and negative
/// policy `v+ = (1-beta) v_old + beta v_theta`, `v- = (1+beta) v_old - beta v_theta`, and
/// `L = r ||v+ - (eps - x0)||^2 + (1-r) ||v- - (eps - x0)||^2` (`nft_loss`; squared norms as means
/// over elements, averaged over the batch) on `x_t = (1-t) x0 + t eps`, t ~ U(0, 1). v_old is the
/// EMA policy that also draws the rollouts. `Exec` (an `ExecutionPolicy`) goes to every op it calls.
///
/// ```cpp
/// unirl::trainer<model_t, unirl::algo::diffusion_nft<>, my_reward> t{model, reward,
///     {.algorithm = {.beta = 1.0, .adv_clip_max = 5.0}, .group_size = 8}};
/// auto loss = unirl::algo::nft_loss(v_theta, v_old, eps - x0, unirl::algo::nft_weight(adv, 5.0), 1.0);
/// ```
#include <cstdint>
#include <string>
#include <type_traits>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/flow_common.hpp>
#include <unirl/algorithms/policy_loss.hpp>
#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/concepts/flow.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/flow_samplers.hpp>

namespace unirl::algo {

/// Options of `diffusion_nft<Sampler>`: `SamplerOptions` is `Sampler::options` (the sampler carries its own).
template <class SamplerOptions = flow_sampler_options>
struct basic_diffusion_nft_options {
  double beta = 1.0;           // mixing of v_theta into the implicit positive / negative policies
  double adv_clip_max = 5.0;   // Z: r = 0.5 + 0.5 clip(A / Z, -1, 1)
  std::int64_t draws = 1;      // (t, eps) pairs per endpoint
  double ema_decay = 0.9;      // EMA of the policy that draws rollouts and gives v_old
  flow_advantage_options advantage{};
  SamplerOptions sampler{};        // the sampler's own options (`Sampler::options`)

  void validate(const std::string& p) const {
    options::require(beta > 0.0, p + "beta", beta, "> 0");
    options::require(adv_clip_max > 0.0, p + "adv_clip_max", adv_clip_max, "> 0");
    options::require(draws >= 1, p + "draws", draws, ">= 1");
    options::require(ema_decay >= 0.0 && ema_decay < 1.0, p + "ema_decay", ema_decay, "in [0, 1)");
  }
};

/// The options of `diffusion_nft` with any built-in sampler (their `options` are `flow_sampler_options`).
using diffusion_nft_options = basic_diffusion_nft_options<>;
}  // namespace unirl::algo

// basic_diffusion_nft_options is a template, so BOOST_HANA_ADAPT_STRUCT cannot adapt it: this is the table the
// macro would generate (tests/static checks that it lists every member).
namespace boost::hana {
template <class S>
struct accessors_impl<unirl::algo::basic_diffusion_nft_options<S>> {
#define UNIRL_MEMBER(name) \
  make_pair(BOOST_HANA_STRING(#name), [](auto&& s) -> decltype(auto) { return (static_cast<decltype(s)&&>(s).name); })
  static constexpr auto apply() {
    return make_tuple(UNIRL_MEMBER(beta),
                      UNIRL_MEMBER(adv_clip_max),
                      UNIRL_MEMBER(draws),
                      UNIRL_MEMBER(ema_decay),
                      UNIRL_MEMBER(advantage),
                      UNIRL_MEMBER(sampler));
  }
#undef UNIRL_MEMBER
};
}  // namespace boost::hana

namespace unirl::algo {

/// DiffusionNFT's optimality weight: `r = 0.5 + 0.5 clip(A / Z, -1, 1)` in [0, 1], Z =
/// `adv_clip_max`. adv (B,) -> (B,) in its floating type.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor nft_weight(const torch::Tensor& adv, double adv_clip_max) {
  UNIRL_CHECK(adv.defined() && adv.is_floating_point(), "nft_weight: expected defined floating advantages");
  UNIRL_CHECK(adv_clip_max > 0.0, "nft_weight: adv_clip_max = ", adv_clip_max, ": expected > 0");
  return exec::dispatch<Exec>(adv, [&] { return 0.5 + 0.5 * (adv / adv_clip_max).clamp(-1.0, 1.0); });
}

/// The DiffusionNFT loss: `v+ = (1-beta) v_old + beta v_theta`, `v- = (1+beta) v_old - beta v_theta`,
/// `L = mean_b [ r_b mean_el (v+ - target)^2 + (1 - r_b) mean_el (v- - target)^2 ]`.
/// v_theta, v_old, target (B, S...), r (B,) -> () in v_theta's dtype; v_old, target, r are constants.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor nft_loss(const torch::Tensor& v_theta, const torch::Tensor& v_old, const torch::Tensor& target,
                       const torch::Tensor& r, double beta) {
  detail::check_same_shape(v_theta, v_old, "nft_loss", "v_theta", "v_old");
  detail::check_same_shape(v_theta, target, "nft_loss", "v_theta", "target");
  detail::check_per_sample(r, v_theta, "nft_loss", "r");
  return exec::dispatch<Exec>(v_theta, [&] {
    const auto dt = v_theta.scalar_type();
    const auto vo = v_old.detach().to(dt), tg = target.detach().to(dt), w = r.detach().to(dt);
    const auto vp = (1.0 - beta) * vo + beta * v_theta;
    const auto vn = (1.0 + beta) * vo - beta * v_theta;
    const auto lp = (vp - tg).square().flatten(1).mean(1);
    const auto ln = (vn - tg).square().flatten(1).mean(1);
    return (w * lp + (1.0 - w) * ln).mean();
  });
}

/// DiffusionNFT for velocity models, rollouts drawn by `Sampler` from the EMA policy, execution
/// policy `Exec`.
template <class Sampler = ode::euler, ExecutionPolicy Exec = exec::automatic>
class diffusion_nft
    : public flow::algorithm_base<basic_diffusion_nft_options<typename Sampler::options>, Sampler, true, Exec> {
  using base = flow::algorithm_base<basic_diffusion_nft_options<typename Sampler::options>, Sampler, true, Exec>;

 public:
  using typename base::options;
  static constexpr bool requires_reference = false;
  static constexpr bool requires_ema_rollout = true;

  explicit diffusion_nft(const options& o = {}) : base(o) {}

  // Velocity models only (flow_model, video_flow_model): `AlgorithmFor` is false for a DDPM model.
  template <class M>
    requires VelocityModel<M>
  loss_terms loss(model_set<M>& ms, const flow_rollout& mb, const step_info&) {
    UNIRL_CHECK(mb.advantages.defined(), "diffusion_nft: the minibatch has no advantages (advantage() not run)");
    const auto d = this->opts_.draws;
    const torch::Tensor x0 = mb.samples().repeat_interleave(d, 0);
    const torch::Tensor cond = mb.conditions.repeat_interleave(d, 0);
    const auto n = x0.size(0);
    const torch::Tensor t = torch::rand({n}, x0.options());
    const torch::Tensor eps = torch::randn_like(x0);
    const torch::Tensor xt = flow_interpolate<Exec>(x0, eps, t);
    const torch::Tensor r = nft_weight<Exec>(mb.advantages.repeat_interleave(d, 0), this->opts_.adv_clip_max);
    const torch::Tensor v = ms.policy.velocity(xt, t, cond);
    torch::Tensor v_old;
    {
      torch::NoGradGuard ng;
      v_old = (ms.ema ? *ms.ema : ms.policy).velocity(xt, t, cond);
    }
    loss_terms out;
    out.total = nft_loss<Exec>(v, v_old, eps - x0, r, this->opts_.beta);
    out.policy = out.total.detach();
    return out;
  }

  template <class M>
  void after_optimizer_step(model_set<M>& ms) {
    if (ms.ema) flow::ema_update(*ms.ema, ms.policy, this->opts_.ema_decay);
  }
};
static_assert(Algorithm<diffusion_nft<>>);

}  // namespace unirl::algo
