#pragma once
/// \file flow_grpo.hpp
/// Flow-GRPO (arXiv 2505.05470, docs/flow.md): group advantages per condition, then per
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

/// Options of `flow_grpo<Sampler>`: `SamplerOptions` is `Sampler::options` (the sampler carries its own).
template <class SamplerOptions = rollout::flow_sampler_options>
struct basic_flow_grpo_options {
  double clip_range = 1e-4;        // eps of the ratio clip (mean-reduced log-probs)
  double adv_clip_max = 5.0;       // advantages clipped to [-adv_clip_max, adv_clip_max]
  double beta = 0.04;              // KL-to-reference coefficient; 0 builds no reference
  double timestep_fraction = 1.0;  // train on the first fraction of the stochastic steps
  flow_advantage_options advantage{};
  SamplerOptions sampler{};        // the sampler's own options (`Sampler::options`)

  void validate(const std::string& p) const {
    options::require(clip_range > 0.0, p + "clip_range", clip_range, "> 0");
    options::require(adv_clip_max > 0.0, p + "adv_clip_max", adv_clip_max, "> 0");
    flow::validate_ratio_options(*this, p);
  }
};

/// The options of `flow_grpo` with any built-in sampler (their `options` are `flow_sampler_options`).
using flow_grpo_options = basic_flow_grpo_options<>;
}  // namespace unirl::algo

// basic_flow_grpo_options is a template, so BOOST_HANA_ADAPT_STRUCT cannot adapt it: this is the table the
// macro would generate (tests/static checks that it lists every member).
namespace boost::hana {
template <class S>
struct accessors_impl<unirl::algo::basic_flow_grpo_options<S>> {
#define UNIRL_MEMBER(name) \
  make_pair(BOOST_HANA_STRING(#name), [](auto&& s) -> decltype(auto) { return (static_cast<decltype(s)&&>(s).name); })
  static constexpr auto apply() {
    return make_tuple(UNIRL_MEMBER(clip_range),
                      UNIRL_MEMBER(adv_clip_max),
                      UNIRL_MEMBER(beta),
                      UNIRL_MEMBER(timestep_fraction),
                      UNIRL_MEMBER(advantage),
                      UNIRL_MEMBER(sampler));
  }
#undef UNIRL_MEMBER
};
}  // namespace boost::hana

namespace unirl::algo {

/// Flow-GRPO with the sampler policy `Sampler` (see the file comment).
template <class Sampler = rollout::sde::flow_grpo>
class flow_grpo : public flow::ratio_algorithm_base<basic_flow_grpo_options<typename Sampler::options>, Sampler> {
  using base = flow::ratio_algorithm_base<basic_flow_grpo_options<typename Sampler::options>, Sampler>;

 public:
  using typename base::options;

  explicit flow_grpo(const options& o = {}) : base(o) {}

  /// The clipped surrogate over the trained steps of the minibatch (+ beta KL).
  template <class M>
  loss_terms loss(model_set<M>& ms, const rollout::flow_rollout& mb, const step_info&) {
    const double eps = this->opts_.clip_range;
    torch::Tensor clipped = torch::zeros({}, torch::TensorOptions(torch::kFloat64).device(mb.trajectory.device()));
    auto [out, n] = this->ratio_loss("flow_grpo", ms, mb,
                                     [&](std::int64_t, const rollout::replayed_step&, const torch::Tensor& ratio,
                                         const torch::Tensor& a) {
                                       clipped = clipped + ((ratio.detach() - 1.0).abs() > eps).to(torch::kFloat64).mean();
                                       return torch::max(-a * ratio, -a * ratio.clamp(1.0 - eps, 1.0 + eps)).mean();
                                     });
    out.clip_fraction = clipped / n;
    out.extra["flow/trained_steps"] = n;
    return out;
  }
};
static_assert(Algorithm<flow_grpo<>>);

}  // namespace unirl::algo
