#pragma once
/// \file flow_common.hpp
/// Pieces shared by the flow-track algorithms (Flow-GRPO, Flow-DPPO, RAM, DiffusionNFT): the
/// free functions on given tensors they share — group advantages per condition (`flow_advantage`),
/// the advantage clip (`clip_advantage`), the forward-process interpolation (`flow_interpolate`)
/// — and drawing a grouped rollout from conditions, picking the trained steps, the EMA update,
/// the base of all four, and the base of the two that replay the SDE steps with an importance
/// ratio (Flow-GRPO, Flow-DPPO). Each algorithm's own loss is a free function in its header
/// (`flow_grpo_loss`, `flow_dppo_keep` / `flow_dppo_loss`, `ram_target` / `ram_loss`,
/// `nft_weight` / `nft_loss`); docs/flow.md lists them with their formulas. Every function
/// computes in its inputs' floating type and takes the execution policy first.
///
/// ```cpp
/// auto a = unirl::algo::flow_advantage(torch::tensor({1.0, 0.0, 5.0, 5.0}, torch::kFloat64), 2);  // float64
/// auto x_t = unirl::algo::flow_interpolate(x0, eps, t);                  // (1 - t) x0 + t eps
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
#include <unirl/algorithms/policy_loss.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/concepts/flow_sampler.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/lora_guard.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>
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

namespace unirl::algo {

/// Group advantages per condition (Flow-GRPO): `A_i = (r_i - mean_g) / (std_g + eps)`, or
/// `r_i - mean_g` with `scale_by_std = false`; a group whose rewards are all equal gives exactly 0.
/// `rewards` (B*G,) grouped contiguously -> (B*G,) in the rewards' floating type (integers: float32).
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor flow_advantage(const torch::Tensor& rewards, std::int64_t group_size,
                             const flow_advantage_options& o = {}) {
  return group_advantage<Exec>(rewards, group_size, {o.scale_by_std, o.unbiased_std, o.eps});
}

/// Advantages clipped to `[-max_abs, max_abs]` (Flow-GRPO's `adv_clip_max`); `max_abs <= 0`
/// returns them unchanged.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor clip_advantage(const torch::Tensor& adv, double max_abs) {
  UNIRL_CHECK(adv.defined() && adv.is_floating_point(), "clip_advantage: expected defined floating advantages");
  if (!(max_abs > 0.0)) return adv;
  return exec::dispatch<Exec>(adv, [&] { return adv.clamp(-max_abs, max_abs); });
}

/// The forward process `x_t = (1 - t) x0 + t eps`: x0, eps (B, S...), t (B,) -> (B, S...), in
/// x0's dtype.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor flow_interpolate(const torch::Tensor& x0, const torch::Tensor& eps, const torch::Tensor& t) {
  UNIRL_CHECK(x0.defined() && eps.defined() && x0.sizes() == eps.sizes(), "flow_interpolate: x0 sizes ",
              x0.defined() ? x0.sizes() : c10::IntArrayRef{}, " differ from eps sizes ",
              eps.defined() ? eps.sizes() : c10::IntArrayRef{});
  UNIRL_CHECK(x0.dim() >= 1 && t.defined() && t.dim() == 1 && t.size(0) == x0.size(0), "flow_interpolate: t has sizes ",
              t.defined() ? t.sizes() : c10::IntArrayRef{}, "; expected (", x0.dim() >= 1 ? x0.size(0) : 0, ",)");
  return exec::dispatch<Exec>(x0, [&] {
    std::vector<std::int64_t> s(static_cast<std::size_t>(x0.dim()), 1);
    s[0] = x0.size(0);
    const auto tb = t.to(x0.scalar_type()).reshape(s);
    return (1 - tb) * x0 + tb * eps.to(x0.scalar_type());
  });
}

namespace detail {
// (B,) `v` as (B, 1, ...) against `like` (B, S...), in `like`'s dtype.
inline torch::Tensor per_sample_like(const torch::Tensor& v, const torch::Tensor& like) {
  std::vector<std::int64_t> s(static_cast<std::size_t>(like.dim()), 1);
  s[0] = v.size(0);
  return v.to(like.scalar_type()).reshape(s);
}
inline void check_per_sample(const torch::Tensor& v, const torch::Tensor& like, const char* who, const char* name) {
  UNIRL_CHECK(v.defined() && v.dim() == 1 && like.defined() && like.dim() >= 1 && v.size(0) == like.size(0), who, ": ",
              name, " has sizes ", v.defined() ? v.sizes() : c10::IntArrayRef{}, "; expected (",
              like.defined() && like.dim() >= 1 ? like.size(0) : 0, ",), one per sample");
}
}  // namespace detail

}  // namespace unirl::algo

namespace unirl::algo::flow {

/// Repeats each condition `info.group_size` times (groups contiguous, as `group_advantage`
/// expects), moves them to the step's device and runs the sampler on `model`.
template <ExecutionPolicy Exec = exec::automatic, class S, class M>
flow_rollout sample_groups(const S& sampler, M& model, const torch::Tensor& conditions, const step_info& info) {
  UNIRL_CHECK(conditions.defined() && conditions.dim() >= 1 && conditions.size(0) >= 1,
              "flow sample: conditions must be a non-empty (N,) or (N, D) tensor, got ",
              conditions.defined() ? conditions.sizes() : c10::IntArrayRef{});
  const auto cond = conditions.repeat_interleave(info.group_size, 0).to(info.device);
  return sample_trajectory<Exec>(sampler, model, cond);
}

/// Stores the rewards (their floating type kept) and the group advantages (`flow_advantage`) in
/// the batch and returns the advantages.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor group_advantages(flow_rollout& b, const torch::Tensor& rewards, const step_info& info,
                               const flow_advantage_options& o) {
  UNIRL_CHECK(rewards.dim() == 1 && rewards.size(0) == b.size(), "flow advantage: rewards have sizes ",
              rewards.sizes(), "; expected (", b.size(), ",)");
  b.rewards = rewards.is_floating_point() ? rewards : rewards.to(torch::kFloat32);
  b.advantages = flow_advantage<Exec>(b.rewards, info.group_size, o);
  return b.advantages;
}

/// The steps a loss trains on: the stochastic steps (std > 0), the first
/// `max(1, round(fraction * n))` of them (Flow-GRPO's `timestep_fraction`).
inline std::vector<std::int64_t> trained_steps(const flow_rollout& b, double fraction) {
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
/// copy when `FromEma` (RAM, DiffusionNFT). Each algorithm adds its flags and its loss. `Exec`
/// goes to every op: the sampler's steps, the advantages, the losses.
template <class Options, class Sampler, bool FromEma, ExecutionPolicy Exec>
class algorithm_base {
 public:
  using options = Options;
  using sampler_type = Sampler;
  using exec_policy = Exec;
  static constexpr bool requires_critic = false;
  static constexpr bool requires_group = true;
  static constexpr bool supports_multi_update = true;
  template <class Track>
  static constexpr bool supports_track = std::is_same_v<Track, flow_track>;

  explicit algorithm_base(const options& o) : opts_(o), sampler_(o.sampler) { unirl::options::validate(opts_); }

  const options& settings() const { return opts_; }
  const Sampler& sampler() const { return sampler_; }

  // Constrained on the sampler: `AlgorithmFor` is false for a model the sampler cannot drive
  // (a noise-prediction model under a velocity sampler, and the other way round).
  template <class M>
    requires SamplerFor<Sampler, M>
  flow_rollout sample(model_set<M>& ms, const torch::Tensor& conditions, const step_info& info) {
    if constexpr (FromEma) return sample_groups<Exec>(sampler_, ms.ema ? *ms.ema : ms.policy, conditions, info);
    else return sample_groups<Exec>(sampler_, ms.policy, conditions, info);
  }

  template <class M>
    requires SamplerFor<Sampler, M>
  torch::Tensor advantage(model_set<M>&, flow_rollout& b, const torch::Tensor& rewards, const step_info& info) {
    return group_advantages<Exec>(b, rewards, info, opts_.advantage);
  }

 protected:
  Options opts_;
  Sampler sampler_;
};

/// The base of the algorithms that replay the SDE steps of the rollout on the policy and weigh
/// them by the importance ratio (Flow-GRPO, Flow-DPPO): rollouts from the policy, a reference
/// model used (and built) only when `beta > 0`, and the loop of their loss. `Options` has
/// `beta`, `adv_clip_max` (> 0: advantages clipped to +-adv_clip_max), `timestep_fraction`.
template <class Options, class Sampler, ExecutionPolicy Exec>
class ratio_algorithm_base : public algorithm_base<Options, Sampler, false, Exec> {
 public:
  static constexpr bool requires_reference = true;  // built only when beta > 0
  static constexpr bool requires_ema_rollout = false;

  explicit ratio_algorithm_base(const Options& o) : algorithm_base<Options, Sampler, false, Exec>(o) {}

  bool uses_reference() const { return this->opts_.beta > 0.0; }

 protected:
  /// For each trained step k of `mb`: replays it on the policy (`r`), the step's per-sample
  /// policy loss `step_loss(k, r, old_logp, a)` (a `clip_loss_result`; old_logp the rollout's
  /// log-probs of step k, a the `clip_advantage`d advantages), averaged over the samples, plus
  /// `beta * KL(policy step || reference step)` (`gaussian_kl` with the sampler's reduction,
  /// averaged over samples) when beta > 0. Returns the loss terms (total, policy, kl, ratio_mean,
  /// clip_fraction: means over the steps) and the number of steps. `name` prefixes the errors.
  template <class M, class StepLoss>
  std::pair<loss_terms, double> ratio_loss(const char* name, model_set<M>& ms, const flow_rollout& mb,
                                           StepLoss&& step_loss) const {
    UNIRL_CHECK(mb.advantages.defined(), name, ": the minibatch has no advantages (advantage() not run)");
    const auto& o = this->opts_;
    const auto steps = trained_steps(mb, o.timestep_fraction);
    const torch::Tensor adv = clip_advantage<Exec>(mb.advantages, o.adv_clip_max);
    const bool kl_on = o.beta > 0.0;
    UNIRL_CHECK(!kl_on || ms.reference.has_value(), name, ": beta = ", o.beta, " but no reference model");
    torch::Tensor total, policy, kl, ratio_sum, clipped;  // figures as detached tensors: read once per step
    auto add = [](torch::Tensor& acc, const torch::Tensor& x) {
      const auto v = x.detach().to(torch::kFloat64);  // summed in double, as the figures always were
      acc = acc.defined() ? acc + v : v;
    };
    for (const auto k : steps) {
      const replayed_step r = replay_step<Exec>(this->sampler_, ms.policy, mb, k);
      const clip_loss_result res = step_loss(k, r, mb.log_probs.select(1, k), adv);
      const torch::Tensor pl = res.loss.mean();
      torch::Tensor term = pl;
      if (kl_on) {
        torch::Tensor ref_mean;
        {
          torch::NoGradGuard ng;
          const lora::disabled_guard base;  // a policy with LoRA adapters is its own reference, adapters off
          ref_mean = replay_step<Exec>(this->sampler_, *ms.reference, mb, k).step.mean;
        }
        const torch::Tensor klk = gaussian_kl<Exec>(r.step.mean, ref_mean, r.step.std, this->sampler_.reduction()).mean();
        term = term + o.beta * klk;
        add(kl, klk);
      }
      total = total.defined() ? total + term : term;
      add(policy, pl);
      add(ratio_sum, res.ratio.mean());
      add(clipped, res.clipped.to(torch::kFloat64).mean());
    }
    const double n = static_cast<double>(steps.size());
    loss_terms out;
    out.total = total / n;
    out.policy = policy / n;
    if (kl.defined()) out.kl = kl / n;
    out.ratio_mean = ratio_sum / n;
    out.clip_fraction = clipped / n;
    return {std::move(out), n};
  }
};

}  // namespace unirl::algo::flow
