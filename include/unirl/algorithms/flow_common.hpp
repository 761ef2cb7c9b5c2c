#pragma once
/// \file flow_common.hpp
/// Pieces shared by the flow-track algorithms (Flow-GRPO, Flow-DPPO, RAM, DiffusionNFT): the
/// options of group advantages per condition, drawing a grouped rollout from conditions, picking
/// the trained steps, the EMA update, the base of all four, and the base of the two that replay
/// the SDE steps with an importance ratio (Flow-GRPO, Flow-DPPO).
///
/// ```cpp
/// auto batch = unirl::algo::flow::sample_groups(sampler, model, labels, info);  // labels repeated G times
/// ```
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>

#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/concepts/flow_sampler.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/flow_samplers.hpp>

namespace unirl::algo {

/// Group advantages per condition (Flow-GRPO): `A = (r - mean_g) / (std_g + eps)`.
struct flow_advantage_options {
  bool scale_by_std = true;    // false: A = r - mean_g
  bool unbiased_std = true;
  double eps = 1e-6;

  void validate(const std::string& p) const { options::require(eps >= 0.0, p + "eps", eps, ">= 0"); }
};

}  // namespace unirl::algo

BOOST_HANA_ADAPT_STRUCT(unirl::algo::flow_advantage_options, scale_by_std, unbiased_std, eps);

namespace unirl::algo::flow {

/// Repeats each condition `info.group_size` times (groups contiguous, as `group_advantage`
/// expects), moves them to the step's device and runs the sampler on `model`.
template <class S, class M>
rollout::flow_rollout sample_groups(const S& sampler, M& model, const torch::Tensor& conditions, const step_info& info) {
  UNIRL_CHECK(conditions.defined() && conditions.dim() >= 1 && conditions.size(0) >= 1,
              "flow sample: conditions must be a non-empty (N,) or (N, D) tensor, got ",
              conditions.defined() ? conditions.sizes() : c10::IntArrayRef{});
  const auto cond = conditions.repeat_interleave(info.group_size, 0).to(info.device);
  return rollout::sample_trajectory(sampler, model, cond);
}

/// Stores group advantages (and the rewards) in the batch and returns the advantages.
inline torch::Tensor group_advantages(rollout::flow_rollout& b, const torch::Tensor& rewards, const step_info& info,
                                      const flow_advantage_options& o) {
  UNIRL_CHECK(rewards.dim() == 1 && rewards.size(0) == b.size(), "flow advantage: rewards have sizes ",
              rewards.sizes(), "; expected (", b.size(), ",)");
  b.rewards = rewards.to(torch::kFloat32);
  b.advantages = group_advantage(b.rewards, info.group_size, {o.scale_by_std, o.unbiased_std, o.eps});
  return b.advantages;
}

/// The steps a loss trains on: the stochastic steps (std > 0), the first
/// `max(1, round(fraction * n))` of them (Flow-GRPO's `timestep_fraction`).
inline std::vector<std::int64_t> trained_steps(const rollout::flow_rollout& b, double fraction) {
  const auto stds = to_host(b.stds.select(0, 0));  // one read
  std::vector<std::int64_t> s;
  for (std::size_t k = 0; k < stds.size(); ++k)
    if (stds[k] > 0.0) s.push_back(static_cast<std::int64_t>(k));
  UNIRL_CHECK(!s.empty(), "flow loss: the rollout has no stochastic step (was it drawn with an ODE sampler?); "
                          "policy-gradient losses need an SDE sampler");
  const auto n = std::max<std::int64_t>(1, std::llround(fraction * static_cast<double>(s.size())));
  s.resize(static_cast<std::size_t>(std::min<std::int64_t>(n, static_cast<std::int64_t>(s.size()))));
  return s;
}

/// `ema = decay * ema + (1 - decay) * policy`, parameter by parameter (buffers copied).
template <class M>
void ema_update(M& ema, const M& policy, double decay) {
  torch::NoGradGuard ng;
  auto e = ema.named_parameters();
  auto p = policy.named_parameters();
  UNIRL_CHECK(e.size() == p.size(), "ema_update: the EMA model has ", e.size(), " parameters, the policy ", p.size());
  for (std::size_t i = 0; i < e.size(); ++i) e[i].second.mul_(decay).add_(p[i].second.detach(), 1.0 - decay);
  auto eb = ema.named_buffers();
  auto pb = policy.named_buffers();
  for (std::size_t i = 0; i < eb.size() && i < pb.size(); ++i) eb[i].second.copy_(pb[i].second);
}

/// Broadcasts a (B,) per-sample tensor against (B, S...).
inline torch::Tensor per_sample(const torch::Tensor& v, const torch::Tensor& like) {
  std::vector<std::int64_t> s(static_cast<std::size_t>(like.dim()), 1);
  s[0] = v.size(0);
  return v.reshape(s);
}

/// Checks the options the ratio algorithms share (`beta`, `timestep_fraction`) of `o`, whose
/// members are named with the prefix `p`.
template <class Options>
void validate_ratio_options(const Options& o, const std::string& p) {
  options::require(o.beta >= 0.0, p + "beta", o.beta, ">= 0");
  options::require(o.timestep_fraction > 0.0 && o.timestep_fraction <= 1.0, p + "timestep_fraction",
                   o.timestep_fraction, "in (0, 1]");
}

/// What the flow algorithms share: options and sampler, the flow track, a group, several updates
/// per rollout, group advantages per condition, and rollouts from the policy — or from its EMA
/// copy when `FromEma` (RAM, DiffusionNFT). Each algorithm adds its flags and its loss.
template <class Options, class Sampler, bool FromEma>
class algorithm_base {
 public:
  using options = Options;
  using sampler_type = Sampler;
  static constexpr bool requires_critic = false;
  static constexpr bool requires_group = true;
  static constexpr bool supports_multi_update = true;
  template <class Track>
  static constexpr bool supports_track = std::is_same_v<Track, rollout::flow_track>;

  explicit algorithm_base(const options& o) : opts_(o), sampler_(o.sampler) { unirl::options::validate(opts_); }

  const options& settings() const { return opts_; }
  const Sampler& sampler() const { return sampler_; }

  // Constrained on the sampler: `AlgorithmFor` is false for a model the sampler cannot drive
  // (a noise-prediction model under a velocity sampler, and the other way round).
  template <class M>
    requires SamplerFor<Sampler, M>
  rollout::flow_rollout sample(model_set<M>& ms, const torch::Tensor& conditions, const step_info& info) {
    if constexpr (FromEma) return sample_groups(sampler_, ms.ema ? *ms.ema : ms.policy, conditions, info);
    else return sample_groups(sampler_, ms.policy, conditions, info);
  }

  template <class M>
    requires SamplerFor<Sampler, M>
  torch::Tensor advantage(model_set<M>&, rollout::flow_rollout& b, const torch::Tensor& rewards,
                          const step_info& info) {
    return group_advantages(b, rewards, info, opts_.advantage);
  }

 protected:
  Options opts_;
  Sampler sampler_;
};

/// The base of the algorithms that replay the SDE steps of the rollout on the policy and weigh
/// them by the importance ratio (Flow-GRPO, Flow-DPPO): rollouts from the policy, a reference
/// model used (and built) only when `beta > 0`, and the loop of their loss. `Options` has
/// `beta`, `adv_clip_max` (> 0: advantages clipped to +-adv_clip_max), `timestep_fraction`.
template <class Options, class Sampler>
class ratio_algorithm_base : public algorithm_base<Options, Sampler, false> {
 public:
  static constexpr bool requires_reference = true;  // built only when beta > 0
  static constexpr bool requires_ema_rollout = false;

  explicit ratio_algorithm_base(const Options& o) : algorithm_base<Options, Sampler, false>(o) {}

  bool uses_reference() const { return this->opts_.beta > 0.0; }

 protected:
  /// For each trained step k of `mb`: replays it on the policy (`r`), `ratio = exp(log pi(x_k+1 |
  /// x_k) - the rollout's log-prob)`, the step's policy term `step_loss(k, r, ratio, a)` (a: the
  /// possibly clipped advantages in the ratio's dtype), plus `beta * KL(policy step || reference
  /// step)` (the sampler's reduction, averaged over samples) when beta > 0. Returns the loss terms
  /// (total, policy, kl, ratio_mean: means over the steps) and the number of steps; `step_loss`
  /// accumulates the algorithm's own figures. `name` prefixes the errors.
  template <class M, class StepLoss>
  std::pair<loss_terms, double> ratio_loss(const char* name, model_set<M>& ms, const rollout::flow_rollout& mb,
                                           StepLoss&& step_loss) const {
    UNIRL_CHECK(mb.advantages.defined(), name, ": the minibatch has no advantages (advantage() not run)");
    const auto& o = this->opts_;
    const auto steps = trained_steps(mb, o.timestep_fraction);
    const torch::Tensor adv = o.adv_clip_max > 0.0 ? mb.advantages.clamp(-o.adv_clip_max, o.adv_clip_max)
                                                   : mb.advantages;
    const bool kl_on = o.beta > 0.0;
    UNIRL_CHECK(!kl_on || ms.reference.has_value(), name, ": beta = ", o.beta, " but no reference model");
    torch::Tensor total, policy, kl, ratio_sum;  // figures as detached tensors: read once per step
    auto add = [](torch::Tensor& acc, const torch::Tensor& x) {
      const auto v = x.detach().to(torch::kFloat64);  // summed in double, as the figures always were
      acc = acc.defined() ? acc + v : v;
    };
    for (const auto k : steps) {
      const rollout::replayed_step r = rollout::replay_step(this->sampler_, ms.policy, mb, k);
      const torch::Tensor ratio = torch::exp(r.log_prob - mb.log_probs.select(1, k));
      const torch::Tensor a = adv.to(ratio.scalar_type());
      const torch::Tensor pl = step_loss(k, r, ratio, a);
      torch::Tensor term = pl;
      if (kl_on) {
        torch::Tensor ref_mean;
        {
          torch::NoGradGuard ng;
          ref_mean = rollout::replay_step(this->sampler_, *ms.reference, mb, k).step.mean;
        }
        const torch::Tensor klk =
            rollout::gaussian_kl(r.step.mean, ref_mean, r.step.std, this->sampler_.reduction()).mean();
        term = term + o.beta * klk;
        add(kl, klk);
      }
      total = total.defined() ? total + term : term;
      add(policy, pl);
      add(ratio_sum, ratio.mean());
    }
    const double n = static_cast<double>(steps.size());
    loss_terms out;
    out.total = total / n;
    out.policy = policy / n;
    if (kl.defined()) out.kl = kl / n;
    out.ratio_mean = ratio_sum / n;
    return {std::move(out), n};
  }
};

}  // namespace unirl::algo::flow
