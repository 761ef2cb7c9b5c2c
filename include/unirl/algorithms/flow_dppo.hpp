#pragma once
/// \file flow_dppo.hpp
/// Flow-DPPO (UniRL `flowdppo.py`, docs/flow.md): no ratio clip; a trust-region mask from
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

/// Options of `flow_dppo<Sampler>`: `SamplerOptions` is `Sampler::options` (the sampler carries its own).
template <class SamplerOptions = rollout::flow_sampler_options>
struct basic_flow_dppo_options {
  double delta = 1e-5;             // trust-region size on the per-step Gaussian KL
  double beta = 0.0;               // KL-to-reference coefficient; 0 builds no reference
  double adv_clip_max = 0.0;       // > 0: advantages clipped to +-adv_clip_max; 0: unclipped
  double timestep_fraction = 1.0;  // train on the first fraction of the stochastic steps
  flow_advantage_options advantage{};
  SamplerOptions sampler{};        // the sampler's own options (`Sampler::options`)

  void validate(const std::string& p) const {
    options::require(delta >= 0.0, p + "delta", delta, ">= 0");
    options::require(adv_clip_max >= 0.0, p + "adv_clip_max", adv_clip_max, ">= 0 (0 = off)");
    flow::validate_ratio_options(*this, p);
  }
};

/// The options of `flow_dppo` with any built-in sampler (their `options` are `flow_sampler_options`).
using flow_dppo_options = basic_flow_dppo_options<>;
}  // namespace unirl::algo

// basic_flow_dppo_options is a template, so BOOST_HANA_ADAPT_STRUCT cannot adapt it: this is the table the
// macro would generate (tests/static checks that it lists every member).
namespace boost::hana {
template <class S>
struct accessors_impl<unirl::algo::basic_flow_dppo_options<S>> {
#define UNIRL_MEMBER(name) \
  make_pair(BOOST_HANA_STRING(#name), [](auto&& s) -> decltype(auto) { return (static_cast<decltype(s)&&>(s).name); })
  static constexpr auto apply() {
    return make_tuple(UNIRL_MEMBER(delta),
                      UNIRL_MEMBER(beta),
                      UNIRL_MEMBER(adv_clip_max),
                      UNIRL_MEMBER(timestep_fraction),
                      UNIRL_MEMBER(advantage),
                      UNIRL_MEMBER(sampler));
  }
#undef UNIRL_MEMBER
};
}  // namespace boost::hana

namespace unirl::algo {

/// Flow-DPPO with the sampler policy `Sampler`.
template <class Sampler = rollout::sde::flow_grpo>
class flow_dppo : public flow::ratio_algorithm_base<basic_flow_dppo_options<typename Sampler::options>, Sampler> {
  using base = flow::ratio_algorithm_base<basic_flow_dppo_options<typename Sampler::options>, Sampler>;

 public:
  using typename base::options;

  explicit flow_dppo(const options& o = {}) : base(o) {}

  /// `-A rho keep` over the trained steps of the minibatch (+ beta KL); see the file comment.
  template <class M>
  loss_terms loss(model_set<M>& ms, const rollout::flow_rollout& mb, const step_info&) {
    const auto f64 = torch::TensorOptions(torch::kFloat64).device(mb.trajectory.device());
    torch::Tensor masked = torch::zeros({}, f64), kl_old = torch::zeros({}, f64);
    auto [out, n] = this->ratio_loss(
        "flow_dppo", ms, mb,
        [&](std::int64_t k, const rollout::replayed_step& r, const torch::Tensor& ratio, const torch::Tensor& a) {
          torch::Tensor keep, kl_k;
          {
            torch::NoGradGuard ng;
            // The trust region always uses the per-element mean (UniRL flowdppo.py).
            kl_k =
                rollout::gaussian_kl(r.step.mean, mb.means.select(1, k), r.step.std, rollout::logprob_reduction::mean);
            const auto pushed = ((ratio > 1.0) & (a > 0)) | ((ratio < 1.0) & (a < 0));
            keep = torch::logical_not((kl_k >= this->opts_.delta) & pushed).to(ratio.scalar_type());
          }
          masked = masked + (1.0 - keep.to(torch::kFloat64).mean());
          kl_old = kl_old + kl_k.to(torch::kFloat64).mean();
          return (-a * ratio * keep).mean();
        });
    out.clip_fraction = masked / n;
    out.extra["flow/kl_to_old"] = kl_old / n;
    return out;
  }
};
static_assert(Algorithm<flow_dppo<>>);

}  // namespace unirl::algo
