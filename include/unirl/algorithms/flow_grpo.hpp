#pragma once
/// \file flow_grpo.hpp
/// Flow-GRPO (arXiv 2505.05470, ALGORITHMS.md §4): group advantages per condition, then per
/// (sample, trained step) the clipped surrogate `max(-A rho, -A clip(rho, 1 +- eps))` on the
/// SDE's Gaussian log-probs, advantages clipped to `+-adv_clip_max`, plus optionally
/// `beta * KL(pi || pi_ref)` in closed form; averaged over samples and trained steps.
/// DanceGRPO is this algorithm with the `sde::dance` sampler; DDPO-style training of a DDPM
/// model is this algorithm with `sde::ddim`.
///
/// ```cpp
/// using algo = unirl::algo::flow_grpo<>;                                // Flow-GRPO SDE
/// using dance = unirl::algo::flow_grpo<unirl::rollout::sde::dance>;     // DanceGRPO
/// unirl::trainer<model_t, algo, my_reward> t{model, reward, {.algorithm = {.beta = 0.04}, .group_size = 8}};
/// t.step(labels);   // (N,) conditions, each drawn group_size times
/// ```
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

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

/// Options of `flow_grpo`.
struct flow_grpo_options {
  double clip_range = 1e-4;        // eps of the ratio clip (mean-reduced log-probs)
  double adv_clip_max = 5.0;       // advantages clipped to [-adv_clip_max, adv_clip_max]
  double beta = 0.04;              // KL-to-reference coefficient; 0 builds no reference
  double timestep_fraction = 1.0;  // train on the first fraction of the stochastic steps
  flow_advantage_options advantage{};
  rollout::flow_sampler_options sampler{};

  void validate(const std::string& p) const {
    options::require(clip_range > 0.0, p + "clip_range", clip_range, "> 0");
    options::require(adv_clip_max > 0.0, p + "adv_clip_max", adv_clip_max, "> 0");
    options::require(beta >= 0.0, p + "beta", beta, ">= 0");
    options::require(timestep_fraction > 0.0 && timestep_fraction <= 1.0, p + "timestep_fraction",
                     timestep_fraction, "in (0, 1]");
  }
};

}  // namespace unirl::algo

BOOST_HANA_ADAPT_STRUCT(unirl::algo::flow_grpo_options, clip_range, adv_clip_max, beta, timestep_fraction, advantage,
                        sampler);

namespace unirl::algo {

/// Flow-GRPO with the sampler policy `Sampler` (see the file comment).
template <class Sampler = rollout::sde::flow_grpo>
class flow_grpo : public flow::algorithm_base<flow_grpo_options, Sampler, false> {
  using base = flow::algorithm_base<flow_grpo_options, Sampler, false>;

 public:
  using typename base::options;
  static constexpr bool requires_reference = true;  // built only when beta > 0
  static constexpr bool requires_ema_rollout = false;

  explicit flow_grpo(const options& o = {}) : base(o) {}

  bool uses_reference() const { return this->opts_.beta > 0.0; }

  /// The clipped surrogate over the trained steps of the minibatch (+ beta KL).
  template <class M>
  loss_terms loss(model_set<M>& ms, const rollout::flow_rollout& mb, const step_info&) {
    UNIRL_CHECK(mb.advantages.defined(), "flow_grpo: the minibatch has no advantages (advantage() not run)");
    const auto steps = flow::trained_steps(mb, this->opts_.timestep_fraction);
    const torch::Tensor adv = mb.advantages.clamp(-this->opts_.adv_clip_max, this->opts_.adv_clip_max);
    const bool kl_on = this->opts_.beta > 0.0;
    UNIRL_CHECK(!kl_on || ms.reference.has_value(), "flow_grpo: beta = ", this->opts_.beta, " but no reference model");
    torch::Tensor total;
    double policy = 0, kl = 0, ratio_sum = 0, clipped = 0;
    for (const auto k : steps) {
      const rollout::replayed_step r = rollout::replay_step(this->sampler_, ms.policy, mb, k);
      const torch::Tensor ratio = torch::exp(r.log_prob - mb.log_probs.select(1, k));
      const torch::Tensor a = adv.to(ratio.scalar_type());
      const torch::Tensor pl = torch::max(-a * ratio, -a * ratio.clamp(1.0 - this->opts_.clip_range, 1.0 + this->opts_.clip_range)).mean();
      torch::Tensor term = pl;
      if (kl_on) {
        torch::Tensor ref_mean;
        {
          torch::NoGradGuard ng;
          ref_mean = rollout::replay_step(this->sampler_, *ms.reference, mb, k).step.mean;
        }
        const torch::Tensor klk = rollout::gaussian_kl(r.step.mean, ref_mean, r.step.std, this->sampler_.reduction()).mean();
        term = term + this->opts_.beta * klk;
        kl += klk.item<double>();
      }
      total = total.defined() ? total + term : term;
      policy += pl.item<double>();
      ratio_sum += ratio.mean().item<double>();
      clipped += ((ratio - 1.0).abs() > this->opts_.clip_range).to(torch::kFloat64).mean().template item<double>();
    }
    const double n = static_cast<double>(steps.size());
    loss_terms out;
    out.total = total / n;
    out.policy = policy / n;
    out.kl = kl / n;
    out.ratio_mean = ratio_sum / n;
    out.clip_fraction = clipped / n;
    out.extra["flow/trained_steps"] = n;
    return out;
  }
};
static_assert(Algorithm<flow_grpo<>>);

}  // namespace unirl::algo
