#pragma once
/// \file flow_dppo.hpp
/// Flow-DPPO (UniRL `flowdppo.py`, ALGORITHMS.md §4): no ratio clip; a trust-region mask from
/// the exact Gaussian KL between the current and the sampling policy's step. Per (sample, step):
/// `KL_k = mean over elements of (mu_new - mu_old)^2 / (2 s_k^2)`; the term is dropped
/// (`keep = 0`) only when `KL_k >= delta` and the ratio moved in the direction the advantage
/// pushes (`rho > 1, A > 0` or `rho < 1, A < 0`); loss `-A rho keep` averaged over samples and
/// steps, optionally `+ beta KL(pi || pi_ref)`.
///
/// ```cpp
/// unirl::trainer<model_t, unirl::algo::flow_dppo<>, my_reward> t{model, reward,
///     {.algorithm = {.delta = 1e-5}, .group_size = 8, .minibatches = 2}};
/// ```
#include <cstdint>
#include <string>
#include <type_traits>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/flow_common.hpp>
#include <unirl/concepts/algorithm.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/flow_samplers.hpp>

namespace unirl::algo {

/// Options of `flow_dppo`.
struct flow_dppo_options {
  double delta = 1e-5;             // trust-region size on the per-step Gaussian KL
  double beta = 0.0;               // KL-to-reference coefficient; 0 builds no reference
  double adv_clip_max = 0.0;       // > 0: advantages clipped to +-adv_clip_max; 0: unclipped
  double timestep_fraction = 1.0;  // train on the first fraction of the stochastic steps
  flow_advantage_options advantage{};
  rollout::flow_sampler_options sampler{};

  void validate(const std::string& p) const {
    options::require(delta >= 0.0, p + "delta", delta, ">= 0");
    options::require(beta >= 0.0, p + "beta", beta, ">= 0");
    options::require(adv_clip_max >= 0.0, p + "adv_clip_max", adv_clip_max, ">= 0 (0 = off)");
    options::require(timestep_fraction > 0.0 && timestep_fraction <= 1.0, p + "timestep_fraction",
                     timestep_fraction, "in (0, 1]");
  }
};

}  // namespace unirl::algo

BOOST_HANA_ADAPT_STRUCT(unirl::algo::flow_dppo_options, delta, beta, adv_clip_max, timestep_fraction, advantage,
                        sampler);

namespace unirl::algo {

/// Flow-DPPO with the sampler policy `Sampler`.
template <class Sampler = rollout::sde::flow_grpo>
class flow_dppo : public flow::algorithm_base<flow_dppo_options, Sampler, false> {
  using base = flow::algorithm_base<flow_dppo_options, Sampler, false>;

 public:
  using typename base::options;
  static constexpr bool requires_reference = true;  // built only when beta > 0
  static constexpr bool requires_ema_rollout = false;

  explicit flow_dppo(const options& o = {}) : base(o) {}

  bool uses_reference() const { return this->opts_.beta > 0.0; }

  template <class M>
  loss_terms loss(model_set<M>& ms, const rollout::flow_rollout& mb, const step_info&) {
    UNIRL_CHECK(mb.advantages.defined(), "flow_dppo: the minibatch has no advantages (advantage() not run)");
    const auto steps = flow::trained_steps(mb, this->opts_.timestep_fraction);
    torch::Tensor adv = mb.advantages;
    if (this->opts_.adv_clip_max > 0.0) adv = adv.clamp(-this->opts_.adv_clip_max, this->opts_.adv_clip_max);
    const bool kl_on = this->opts_.beta > 0.0;
    UNIRL_CHECK(!kl_on || ms.reference.has_value(), "flow_dppo: beta = ", this->opts_.beta, " but no reference model");
    torch::Tensor total;
    double policy = 0, kl = 0, ratio_sum = 0, masked = 0, kl_old = 0;
    for (const auto k : steps) {
      const rollout::replayed_step r = rollout::replay_step(this->sampler_, ms.policy, mb, k);
      const torch::Tensor ratio = torch::exp(r.log_prob - mb.log_probs.select(1, k));
      const torch::Tensor a = adv.to(ratio.scalar_type());
      torch::Tensor keep, kl_k;
      {
        torch::NoGradGuard ng;
        // The trust region always uses the per-element mean (UniRL flowdppo.py).
        kl_k = rollout::gaussian_kl(r.step.mean, mb.means.select(1, k), r.step.std, rollout::logprob_reduction::mean);
        const auto pushed = ((ratio > 1.0) & (a > 0)) | ((ratio < 1.0) & (a < 0));
        keep = torch::logical_not((kl_k >= this->opts_.delta) & pushed).to(ratio.scalar_type());
      }
      const torch::Tensor pl = (-a * ratio * keep).mean();
      torch::Tensor term = pl;
      if (kl_on) {
        torch::Tensor ref_mean;
        {
          torch::NoGradGuard ng;
          ref_mean = rollout::replay_step(this->sampler_, *ms.reference, mb, k).step.mean;
        }
        const torch::Tensor klr = rollout::gaussian_kl(r.step.mean, ref_mean, r.step.std, this->sampler_.reduction()).mean();
        term = term + this->opts_.beta * klr;
        kl += klr.item<double>();
      }
      total = total.defined() ? total + term : term;
      policy += pl.item<double>();
      ratio_sum += ratio.mean().item<double>();
      masked += 1.0 - keep.to(torch::kFloat64).mean().item<double>();
      kl_old += kl_k.to(torch::kFloat64).mean().item<double>();
    }
    const double n = static_cast<double>(steps.size());
    loss_terms out;
    out.total = total / n;
    out.policy = policy / n;
    out.kl = kl / n;
    out.ratio_mean = ratio_sum / n;
    out.clip_fraction = masked / n;
    out.extra["flow/kl_to_old"] = kl_old / n;
    return out;
  }
};
static_assert(Algorithm<flow_dppo<>>);

}  // namespace unirl::algo
