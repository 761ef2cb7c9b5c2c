#pragma once
/// \file flow_common.hpp
/// Pieces shared by the flow-track algorithms (Flow-GRPO, Flow-DPPO, RAM, DiffusionNFT): the
/// options of group advantages per condition, drawing a grouped rollout from conditions, picking
/// the trained steps, and the EMA update.
///
/// ```cpp
/// auto batch = unirl::algo::flow::sample_groups(sampler, model, labels, info);  // labels repeated G times
/// ```
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <type_traits>

#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
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
  const auto stds = b.stds.select(0, 0).to(torch::kCPU);
  std::vector<std::int64_t> s;
  for (std::int64_t k = 0; k < stds.size(0); ++k)
    if (stds[k].item<double>() > 0.0) s.push_back(k);
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

  template <class M>
  rollout::flow_rollout sample(model_set<M>& ms, const torch::Tensor& conditions, const step_info& info) {
    if constexpr (FromEma) return sample_groups(sampler_, ms.ema ? *ms.ema : ms.policy, conditions, info);
    else return sample_groups(sampler_, ms.policy, conditions, info);
  }

  template <class M>
  torch::Tensor advantage(model_set<M>&, rollout::flow_rollout& b, const torch::Tensor& rewards,
                          const step_info& info) {
    return group_advantages(b, rewards, info, opts_.advantage);
  }

 protected:
  Options opts_;
  Sampler sampler_;
};

}  // namespace unirl::algo::flow
