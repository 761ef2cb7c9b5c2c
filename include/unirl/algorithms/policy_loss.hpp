#pragma once
/// \file policy_loss.hpp
/// Per-element policy and value losses shared by every track (docs/algorithms/ppo.md,
/// docs/algorithms/grpo.md): the PPO clipped
/// surrogate with optional dual clip, the DPPO token mask, and the clipped value loss. They
/// return one loss per element; `loss_agg.hpp` reduces them.
///
/// ```cpp
/// auto r = unirl::algo::ppo_clip_loss(logp, old_logp, adv, 0.2, 0.28);   // clip-higher (DAPO)
/// auto loss = unirl::algo::aggregate(r.loss, mask, unirl::algo::loss_agg::token_mean, 0);
/// ```
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/exec/policy.hpp>

namespace unirl::algo {

/// Per-element result of a ratio-based policy loss.
struct clip_loss_result {
  torch::Tensor loss;     // per element, differentiable
  torch::Tensor clipped;  // bool per element: the clip (or the mask) took the gradient away
  torch::Tensor ratio;    // per element, exp(logp - old_logp), differentiable
};

namespace detail {
inline void check_same_shape(const torch::Tensor& a, const torch::Tensor& b, const char* who, const char* na,
                             const char* nb) {
  UNIRL_CHECK(a.defined() && b.defined(), who, ": ", na, " and ", nb, " must be defined");
  UNIRL_CHECK(a.sizes() == b.sizes(), who, ": ", na, " sizes ", a.sizes(), " differ from ", nb, " sizes ", b.sizes());
}
}  // namespace detail

/// PPO clipped surrogate per element: `max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))`,
/// `rho = exp(logp - old_logp)`. With `dual_clip = c > 1` (verl), for `A < 0` the loss is further
/// capped at `-A c`; `dual_clip = 0` turns it off. `old_logp` and `adv` are treated as constants.
/// Reference implementation only (every policy), as the other losses of this file.
template <ExecutionPolicy Exec = exec::automatic>
clip_loss_result ppo_clip_loss(const torch::Tensor& logp, const torch::Tensor& old_logp,
                                      const torch::Tensor& adv, double eps_low, double eps_high,
                                      double dual_clip = 0.0) {
  detail::check_same_shape(logp, old_logp, "ppo_clip_loss", "logp", "old_logp");
  detail::check_same_shape(logp, adv, "ppo_clip_loss", "logp", "advantages");
  UNIRL_CHECK(eps_low >= 0.0 && eps_low < 1.0, "ppo_clip_loss: eps_low = ", eps_low, ": expected in [0, 1)");
  UNIRL_CHECK(eps_high >= 0.0, "ppo_clip_loss: eps_high = ", eps_high, ": expected >= 0");
  UNIRL_CHECK(dual_clip == 0.0 || dual_clip > 1.0, "ppo_clip_loss: dual_clip = ", dual_clip,
              ": expected 0 (off) or > 1");
  return exec::dispatch<Exec>(logp, [&] {
    const auto a = adv.detach().to(logp.scalar_type());
    const auto ratio = torch::exp(logp - old_logp.detach().to(logp.scalar_type()));
    const auto unclipped = -a * ratio;
    const auto clipped_term = -a * torch::clamp(ratio, 1.0 - eps_low, 1.0 + eps_high);
    auto loss = torch::max(unclipped, clipped_term);
    auto clipped = clipped_term > unclipped;
    if (dual_clip > 0.0) {
      const auto cap = -a * dual_clip;
      const auto capped = (a < 0) & (loss > cap);
      loss = torch::where(capped, cap, loss);
      clipped = clipped | capped;
    }
    return clip_loss_result{loss, clipped, ratio};
  });
}

/// DPPO token mask (UniRL `dppo.py`): no clip; a token keeps its gradient when
/// `A (rho - 1) <= 0` (the update moves it back toward pi_old) or `|p_new - p_old| <= delta`
/// (probabilities, not log-probabilities). Loss per element `-A rho keep`; `clipped` = not kept.
template <ExecutionPolicy Exec = exec::automatic>
clip_loss_result dppo_mask_loss(const torch::Tensor& logp, const torch::Tensor& old_logp,
                                       const torch::Tensor& adv, double delta = 0.15) {
  detail::check_same_shape(logp, old_logp, "dppo_mask_loss", "logp", "old_logp");
  detail::check_same_shape(logp, adv, "dppo_mask_loss", "logp", "advantages");
  UNIRL_CHECK(delta >= 0.0, "dppo_mask_loss: delta = ", delta, ": expected >= 0");
  return exec::dispatch<Exec>(logp, [&] {
    const auto a = adv.detach().to(logp.scalar_type());
    const auto old = old_logp.detach().to(logp.scalar_type());
    const auto ratio = torch::exp(logp - old);
    const auto lp = logp.detach();
    const auto keep = (a * (ratio.detach() - 1.0) <= 0) | ((lp.exp() - old.exp()).abs() <= delta);
    const auto loss = -a * ratio * keep.to(logp.scalar_type());
    return clip_loss_result{loss, keep.logical_not(), ratio};
  });
}

/// Value loss per element: `0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`;
/// `clip <= 0` gives the unclipped `0.5 (V - R)^2`. `v_old` and `returns` are constants.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor value_loss(const torch::Tensor& v, const torch::Tensor& v_old, const torch::Tensor& returns,
                         double clip) {
  detail::check_same_shape(v, returns, "value_loss", "values", "returns");
  if (clip > 0.0) detail::check_same_shape(v, v_old, "value_loss", "values", "old values");
  return exec::dispatch<Exec>(v, [&] {
    const auto r = returns.detach().to(v.scalar_type());
    const auto unclipped = (v - r).square();
    if (clip <= 0.0) return 0.5 * unclipped;
    const auto vo = v_old.detach().to(v.scalar_type());
    const auto v_clipped = vo + torch::clamp(v - vo, -clip, clip);
    return 0.5 * torch::max(unclipped, (v_clipped - r).square());
  });
}

}  // namespace unirl::algo
