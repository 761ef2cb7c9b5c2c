#pragma once
/// \file flow_grpo.hpp
/// Flow-GRPO (arXiv 2505.05470, docs/flow.md): group advantages per condition, then per
/// (sample, trained step) the clipped surrogate `max(-A rho, -A clip(rho, 1 +- eps))` on the
/// SDE's Gaussian log-probs (`flow_grpo_loss`, a free function on given log-probs), advantages
/// clipped to `+-adv_clip_max`, plus optionally `beta * KL(pi || pi_ref)` in closed form; averaged
/// over samples and trained steps. DanceGRPO is this algorithm with the `sde::dance` sampler;
/// DDPO-style training of a DDPM model is this algorithm with `sde::ddim`. `Exec` (an
/// `ExecutionPolicy`) goes to every op it calls.
///
/// ```cpp
/// using algo = unirl::algo::flow_grpo<>;                                     // Flow-GRPO SDE
/// using dance = unirl::algo::flow_grpo<unirl::sde::dance>;                   // DanceGRPO
/// using oracle = unirl::algo::flow_grpo<unirl::sde::flow_grpo, unirl::exec::reference>;
/// unirl::trainer<model_t, algo, my_reward> t{model, reward, {.algorithm = {.beta = 0.04}, .group_size = 8}};
/// t.step(labels);   // (N,) conditions, each drawn group_size times
/// auto r = unirl::algo::flow_grpo_loss(logp, old_logp, adv, 1e-4);          // r.loss: (B,)
/// ```
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/flow_common.hpp>
#include <unirl/algorithms/policy_loss.hpp>
#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/flow_samplers.hpp>

namespace unirl::algo {

/// Options of `flow_grpo<Sampler>`: `SamplerOptions` is `Sampler::options` (the sampler carries its own).
template <class SamplerOptions = flow_sampler_options>
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

/// Flow-GRPO's clipped surrogate per sample (one SDE step): `rho = exp(logp - old_logp)`,
/// `loss = max(-A rho, -A clip(rho, 1 - eps, 1 + eps))`, `clipped = |rho - 1| > eps` (the
/// reference code's clip fraction). logp, old_logp, adv (B,) -> (B,) each, in logp's dtype;
/// `old_logp` and `adv` are constants. The algorithm averages `loss` over samples and steps.
template <ExecutionPolicy Exec = exec::automatic>
clip_loss_result flow_grpo_loss(const torch::Tensor& logp, const torch::Tensor& old_logp, const torch::Tensor& adv,
                                double clip_range) {
  detail::check_same_shape(logp, old_logp, "flow_grpo_loss", "logp", "old_logp");
  detail::check_same_shape(logp, adv, "flow_grpo_loss", "logp", "advantages");
  UNIRL_CHECK(logp.is_floating_point(), "flow_grpo_loss: logp has dtype ", logp.dtype(), "; expected a floating type");
  UNIRL_CHECK(clip_range > 0.0, "flow_grpo_loss: clip_range = ", clip_range, ": expected > 0");
  return exec::dispatch<Exec>(logp, [&] {
    const auto a = adv.detach().to(logp.scalar_type());
    const auto ratio = torch::exp(logp - old_logp.detach().to(logp.scalar_type()));
    const auto loss = torch::max(-a * ratio, -a * ratio.clamp(1.0 - clip_range, 1.0 + clip_range));
    return clip_loss_result{loss, (ratio.detach() - 1.0).abs() > clip_range, ratio};
  });
}

/// Flow-GRPO with the sampler policy `Sampler` and execution policy `Exec` (see the file comment).
template <class Sampler = sde::flow_grpo, ExecutionPolicy Exec = exec::automatic>
class flow_grpo
    : public flow::ratio_algorithm_base<basic_flow_grpo_options<typename Sampler::options>, Sampler, Exec> {
  using base = flow::ratio_algorithm_base<basic_flow_grpo_options<typename Sampler::options>, Sampler, Exec>;

 public:
  using typename base::options;

  explicit flow_grpo(const options& o = {}) : base(o) {}

  /// The clipped surrogate (`flow_grpo_loss`) over the trained steps of the minibatch (+ beta KL).
  template <class M>
  loss_terms loss(model_set<M>& ms, const flow_rollout& mb, const step_info&) {
    const double eps = this->opts_.clip_range;
    auto [out, n] = this->ratio_loss("flow_grpo", ms, mb,
                                     [&](std::int64_t, const replayed_step& r, const torch::Tensor& old_logp,
                                         const torch::Tensor& a) {
                                       return flow_grpo_loss<Exec>(r.log_prob, old_logp, a, eps);
                                     });
    out.extra["flow/trained_steps"] = n;
    return out;
  }
};
static_assert(Algorithm<flow_grpo<>>);

}  // namespace unirl::algo
