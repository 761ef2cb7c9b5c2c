#pragma once
/// \file ram.hpp
/// RAM — Reinforce Adjoint Matching (arXiv 2605.10759, docs/flow.md). Endpoints x0 are drawn
/// from the EMA policy, rewards become group advantages A, then a plain regression on freshly
/// noised `x_t = (1-t) x0 + t eps` (`draws` pairs (t, eps) per endpoint, `p(t) ∝ t`):
/// `target = v_ref(x_t, t) + m A ((eps - x0) - v_old(x_t, t))` (`ram_target`),
/// `L = mean (v_theta - sg(target))^2` (`ram_loss`), with v_old the EMA policy (decay `ema_decay`)
/// and m the reward multiplier. No SDE log-probs, no reward gradients, no clipping. For a
/// noise-prediction (DDPM) model the same regression runs on `target_eps = eps_ref + m A (eps -
/// eps_old)` at `x_t = q_sample(x0, t, eps)`. The target and the loss are free functions on given
/// tensors; `Exec` (an `ExecutionPolicy`) goes to every op the algorithm calls.
///
/// Exactness: for a Gaussian base N(mu, s^2) and a linear reward r = c x with advantages
/// `A = r - mean` (`advantage.scale_by_std = false`) the fixed point is N(mu + m c s^2, s^2) —
/// the KL-regularised optimum with lambda = 1/m (a test pins it).
///
/// `reward_weighted = true` is the simplified `mse(v, eps - x0) * (1 + alpha r)` regression of
/// the seed tutorial (`reward_weighted_loss`) — a baseline, not RAM.
///
/// ```cpp
/// unirl::trainer<model_t, unirl::algo::ram<>, my_reward> t{model, reward,
///     {.algorithm = {.multiplier = 1.0, .draws = 4}, .group_size = 8}};
/// auto target = unirl::algo::ram_target(v_ref, v_old, eps - x0, adv, 1.0);   // (B, S...)
/// auto loss = unirl::algo::ram_loss(v_theta, target);                         // () scalar
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
#include <unirl/core/lora_guard.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/flow_samplers.hpp>

namespace unirl::algo {

/// Options of `ram<Sampler>`: `SamplerOptions` is `Sampler::options` (the sampler carries its own).
template <class SamplerOptions = flow_sampler_options>
struct basic_ram_options {
  double multiplier = 1.0;        // m: reward multiplier (1 / lambda of the KL-regularised objective)
  std::int64_t draws = 4;         // (t, eps) pairs per endpoint
  double ema_decay = 0.9;         // EMA of the policy that draws rollouts and gives v_old
  bool reward_weighted = false;   // true: the seed's mse * (1 + alpha r) baseline instead of RAM
  double alpha = 1.0;             // weight of the reward in the reward_weighted baseline
  flow_advantage_options advantage{};
  SamplerOptions sampler{};        // the sampler's own options (`Sampler::options`)

  void validate(const std::string& p) const {
    options::require(multiplier >= 0.0, p + "multiplier", multiplier, ">= 0");
    options::require(draws >= 1, p + "draws", draws, ">= 1");
    options::require(ema_decay >= 0.0 && ema_decay < 1.0, p + "ema_decay", ema_decay, "in [0, 1)");
  }
};

/// The options of `ram` with any built-in sampler (their `options` are `flow_sampler_options`).
using ram_options = basic_ram_options<>;
}  // namespace unirl::algo

// basic_ram_options is a template, so BOOST_HANA_ADAPT_STRUCT cannot adapt it: this is the table the
// macro would generate (tests/static checks that it lists every member).
namespace boost::hana {
template <class S>
struct accessors_impl<unirl::algo::basic_ram_options<S>> {
#define UNIRL_MEMBER(name) \
  make_pair(BOOST_HANA_STRING(#name), [](auto&& s) -> decltype(auto) { return (static_cast<decltype(s)&&>(s).name); })
  static constexpr auto apply() {
    return make_tuple(UNIRL_MEMBER(multiplier),
                      UNIRL_MEMBER(draws),
                      UNIRL_MEMBER(ema_decay),
                      UNIRL_MEMBER(reward_weighted),
                      UNIRL_MEMBER(alpha),
                      UNIRL_MEMBER(advantage),
                      UNIRL_MEMBER(sampler));
  }
#undef UNIRL_MEMBER
};
}  // namespace boost::hana

namespace unirl::algo {

/// RAM's regression target: `target = ref_out + m A (fm_target - old_out)` — with velocities
/// `v_ref + m A ((eps - x0) - v_old)`, with noise predictions `eps_ref + m A (eps - eps_old)`.
/// ref_out, old_out, fm_target (B, S...), adv (B,) -> (B, S...) in ref_out's dtype.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor ram_target(const torch::Tensor& ref_out, const torch::Tensor& old_out, const torch::Tensor& fm_target,
                         const torch::Tensor& adv, double multiplier) {
  detail::check_same_shape(ref_out, old_out, "ram_target", "ref_out", "old_out");
  detail::check_same_shape(ref_out, fm_target, "ram_target", "ref_out", "fm_target");
  detail::check_per_sample(adv, ref_out, "ram_target", "adv");
  return exec::dispatch<Exec>(ref_out, [&] {
    const auto dt = ref_out.scalar_type();
    return ref_out + multiplier * detail::per_sample_like(adv, ref_out) * (fm_target.to(dt) - old_out.to(dt));
  });
}

/// RAM's loss: `mean over every element of (pred - sg(target))^2` (the target is a constant).
/// pred, target (B, S...) -> () in pred's dtype.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor ram_loss(const torch::Tensor& pred, const torch::Tensor& target) {
  detail::check_same_shape(pred, target, "ram_loss", "pred", "target");
  return exec::dispatch<Exec>(pred, [&] { return (pred - target.detach().to(pred.scalar_type())).square().mean(); });
}

/// The reward-weighted flow-matching baseline (`reward_weighted = true`, not RAM):
/// `mean_b [ mean_el (pred - fm_target)^2 (1 + alpha r_b) ]`. pred, fm_target (B, S...),
/// rewards (B,) -> () in pred's dtype; fm_target and rewards are constants.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor reward_weighted_loss(const torch::Tensor& pred, const torch::Tensor& fm_target,
                                   const torch::Tensor& rewards, double alpha) {
  detail::check_same_shape(pred, fm_target, "reward_weighted_loss", "pred", "fm_target");
  detail::check_per_sample(rewards, pred, "reward_weighted_loss", "rewards");
  return exec::dispatch<Exec>(pred, [&] {
    const auto w = 1.0 + alpha * rewards.detach().to(pred.scalar_type());
    return ((pred - fm_target.detach().to(pred.scalar_type())).square().flatten(1).mean(1) * w).mean();
  });
}

/// RAM with rollouts drawn by `Sampler` (deterministic ODE by default; `sde::ddim` with
/// `ddim_eta = 0` for DDPM models) and execution policy `Exec`.
template <class Sampler = ode::euler, ExecutionPolicy Exec = exec::automatic>
class ram : public flow::algorithm_base<basic_ram_options<typename Sampler::options>, Sampler, true, Exec> {
  using base = flow::algorithm_base<basic_ram_options<typename Sampler::options>, Sampler, true, Exec>;

 public:
  using typename base::options;
  static constexpr bool requires_reference = true;
  static constexpr bool requires_ema_rollout = true;

  explicit ram(const options& o = {}) : base(o) {}

  bool uses_reference() const { return !this->opts_.reward_weighted; }

  template <class M>
  loss_terms loss(model_set<M>& ms, const flow_rollout& mb, const step_info&) {
    UNIRL_CHECK(mb.advantages.defined(), "ram: the minibatch has no advantages (advantage() not run)");
    const auto& o = this->opts_;
    const auto d = o.draws;
    const torch::Tensor x0 = mb.samples().repeat_interleave(d, 0);
    const torch::Tensor cond = mb.conditions.repeat_interleave(d, 0);
    const torch::Tensor adv = mb.advantages.repeat_interleave(d, 0);
    const auto n = x0.size(0);
    // p(t) ∝ t on [0, 1]: t = sqrt(u).
    const torch::Tensor t = torch::rand({n}, x0.options()).sqrt();
    const torch::Tensor eps = torch::randn_like(x0);
    torch::Tensor pred, target, plain;
    if constexpr (NoiseModel<M>) {
      const auto T = ms.policy.alphas_cumprod().size(0);
      const torch::Tensor idx = (t * static_cast<double>(T)).floor().clamp(0, static_cast<double>(T - 1)).to(torch::kInt64);
      const torch::Tensor xt = ms.policy.q_sample(x0, idx, eps);
      const torch::Tensor tf = idx.to(x0.scalar_type());
      pred = ms.policy.epsilon(xt, tf, cond);
      torch::NoGradGuard ng;
      plain = eps;
      if (!o.reward_weighted) {
        UNIRL_CHECK(ms.reference.has_value(), "ram: no reference model");
        auto& old = ms.ema ? *ms.ema : ms.policy;
        // A policy with LoRA adapters is its own reference: the adapters off.
        const auto ref = lora::without_adapters([&] { return ms.reference->epsilon(xt, tf, cond); });
        target = ram_target<Exec>(ref, old.epsilon(xt, tf, cond), plain, adv, o.multiplier);
      }
    } else {
      const torch::Tensor xt = flow_interpolate<Exec>(x0, eps, t);
      pred = ms.policy.velocity(xt, t, cond);
      torch::NoGradGuard ng;
      plain = eps - x0;
      if (!o.reward_weighted) {
        UNIRL_CHECK(ms.reference.has_value(), "ram: no reference model");
        auto& old = ms.ema ? *ms.ema : ms.policy;
        // A policy with LoRA adapters is its own reference: the adapters off.
        const auto ref = lora::without_adapters([&] { return ms.reference->velocity(xt, t, cond); });
        target = ram_target<Exec>(ref, old.velocity(xt, t, cond), plain, adv, o.multiplier);
      }
    }
    loss_terms out;
    if (o.reward_weighted) {
      const torch::Tensor r = mb.rewards.defined() ? mb.rewards : mb.advantages;
      out.total = reward_weighted_loss<Exec>(pred, plain, r.repeat_interleave(d, 0), o.alpha);
    } else {
      out.total = ram_loss<Exec>(pred, target);
    }
    out.policy = out.total.detach();
    {
      torch::NoGradGuard ng;
      out.extra["ram/fm_mse"] = (pred.detach() - plain).pow(2).mean();
    }
    return out;
  }

  /// Moves the EMA policy (rollouts and v_old) towards the policy.
  template <class M>
  void after_optimizer_step(model_set<M>& ms) {
    if (ms.ema) flow::ema_update(*ms.ema, ms.policy, this->opts_.ema_decay);
  }
};
static_assert(Algorithm<ram<>>);

}  // namespace unirl::algo
