#pragma once
/// \file flow_dppo.hpp
/// Flow-DPPO (UniRL `flowdppo.py`, docs/flow.md): no ratio clip; a trust-region mask from
/// the exact Gaussian KL between the current and the sampling policy's step. Per (sample, step):
/// `KL_k = mean over elements of (mu_new - mu_old)^2 / (2 s_k^2)` (`gaussian_kl`); the term is
/// dropped (`keep = 0`, `flow_dppo_keep`) only when `KL_k >= delta` and the ratio moved in the
/// direction the advantage pushes (`rho > 1, A > 0` or `rho < 1, A < 0`); loss `-A rho keep`
/// (`flow_dppo_loss`) averaged over samples and steps, optionally `+ beta KL(pi || pi_ref)`.
/// `Exec` (an `ExecutionPolicy`) goes to every op it calls.
///
/// `trust_region = clamped_kl` is seed 000's listing instead: the same per-step KL, clamped to
/// `[region_min, region_max]` (0.01, 0.2), is the clip range of a PPO surrogate,
/// `-min(rho A, clip(rho, 1 - eps, 1 + eps) A)`, `eps = clamp(KL_k, min, max)`
/// (`flow_dppo_clamped_loss`; the KL is a constant there, as PPO's epsilon is).
///
/// ```cpp
/// unirl::trainer<model_t, unirl::algo::flow_dppo<>, my_reward> t{model, reward,
///     {.algorithm = {.delta = 1e-5}, .group_size = 8, .minibatches = 2}};
/// auto keep = unirl::algo::flow_dppo_keep(ratio, adv, kl_to_old, 1e-5);   // (B,) bool
/// // seed 000's variant (recipes: algorithm.trust_region=clamped_kl):
/// unirl::algo::flow_dppo<> seed000({.trust_region = unirl::algo::dppo_trust_region::clamped_kl});
/// ```
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

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

/// Flow-DPPO's trust region: `kl_mask` (UniRL `flowdppo.py`, the default) drops a term whose
/// step left `KL_k < delta` in the direction the advantage pushes it (`flow_dppo_loss`);
/// `clamped_kl` (seed 000's listing) clips the ratio to `1 +- clamp(KL_k, region_min,
/// region_max)` (`flow_dppo_clamped_loss`).
enum class dppo_trust_region { kl_mask, clamped_kl };
}  // namespace unirl::algo

template <>
inline constexpr std::array unirl::enum_names<unirl::algo::dppo_trust_region>{std::string_view{"kl_mask"},
                                                                              std::string_view{"clamped_kl"}};

namespace unirl::algo {

/// Options of `flow_dppo<Sampler>`: `SamplerOptions` is `Sampler::options` (the sampler carries its own).
template <class SamplerOptions = flow_sampler_options>
struct basic_flow_dppo_options {
  double delta = 1e-5;             // trust-region size on the per-step Gaussian KL
  dppo_trust_region trust_region = dppo_trust_region::kl_mask;  // kl_mask (UniRL) or clamped_kl (seed 000)
  double region_min = 0.01;        // clamped_kl: the clip range is clamp(KL_k, region_min, region_max)
  double region_max = 0.2;
  double beta = 0.0;               // KL-to-reference coefficient; 0 builds no reference
  double adv_clip_max = 0.0;       // > 0: advantages clipped to +-adv_clip_max; 0: unclipped
  double timestep_fraction = 1.0;  // train on the first fraction of the stochastic steps
  flow_advantage_options advantage{};
  SamplerOptions sampler{};        // the sampler's own options (`Sampler::options`)

  void validate(const std::string& p) const {
    options::require(delta >= 0.0, p + "delta", delta, ">= 0");
    options::require(region_min >= 0.0, p + "region_min", region_min, ">= 0");
    options::require(region_max >= region_min, p + "region_max", region_max,
                     ">= region_min (" + options::detail::value_text(region_min) + ")");
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
                      UNIRL_MEMBER(trust_region),
                      UNIRL_MEMBER(region_min),
                      UNIRL_MEMBER(region_max),
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

/// Flow-DPPO's trust-region mask per sample: `keep = not (kl >= delta and ((rho > 1 and A > 0)
/// or (rho < 1 and A < 0)))` — a term is dropped only when the step left the trust region
/// (`kl`: the exact Gaussian KL to the sampling policy's step, `gaussian_kl` with the mean
/// reduction) in the direction the advantage pushes it. ratio, adv, kl (B,) -> (B,) bool.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor flow_dppo_keep(const torch::Tensor& ratio, const torch::Tensor& adv, const torch::Tensor& kl,
                             double delta) {
  detail::check_same_shape(ratio, adv, "flow_dppo_keep", "ratio", "advantages");
  detail::check_same_shape(ratio, kl, "flow_dppo_keep", "ratio", "kl");
  UNIRL_CHECK(delta >= 0.0, "flow_dppo_keep: delta = ", delta, ": expected >= 0");
  return exec::dispatch<Exec>(ratio, [&] {
    torch::NoGradGuard ng;
    const auto rho = ratio.detach();
    const auto a = adv.detach();
    const auto pushed = ((rho > 1.0) & (a > 0)) | ((rho < 1.0) & (a < 0));
    return torch::logical_not((kl.detach() >= delta) & pushed);
  });
}

/// Flow-DPPO's loss per sample (one SDE step): `rho = exp(logp - old_logp)`,
/// `loss = -A rho keep` with `keep = flow_dppo_keep(rho, A, kl, delta)`; `clipped = not keep`.
/// logp, old_logp, adv, kl (B,) -> (B,) each, in logp's dtype; old_logp, adv and kl are constants.
template <ExecutionPolicy Exec = exec::automatic>
clip_loss_result flow_dppo_loss(const torch::Tensor& logp, const torch::Tensor& old_logp, const torch::Tensor& adv,
                                const torch::Tensor& kl, double delta) {
  detail::check_same_shape(logp, old_logp, "flow_dppo_loss", "logp", "old_logp");
  detail::check_same_shape(logp, adv, "flow_dppo_loss", "logp", "advantages");
  UNIRL_CHECK(logp.is_floating_point(), "flow_dppo_loss: logp has dtype ", logp.dtype(), "; expected a floating type");
  return exec::dispatch<Exec>(logp, [&] {
    const auto a = adv.detach().to(logp.scalar_type());
    const auto ratio = torch::exp(logp - old_logp.detach().to(logp.scalar_type()));
    const auto keep = flow_dppo_keep<Exec>(ratio, a, kl, delta);
    return clip_loss_result{-a * ratio * keep.to(logp.scalar_type()), keep.logical_not(), ratio};
  });
}

/// Seed 000's Flow-DPPO loss per sample (one SDE step): the per-step KL to the sampling policy,
/// clamped, is the clip range of a PPO surrogate — `rho = exp(logp - old_logp)`,
/// `eps = clamp(KL, region_min, region_max)`, `loss = max(-A rho, -A clip(rho, 1 - eps, 1 + eps))`
/// (= `-min(rho A, clip(rho, 1 - eps, 1 + eps) A)`); `clipped` = the clipped branch was taken
/// (`-A clip(rho) > -A rho`: rho is outside the range and moved the way A pushes it; its gradient
/// is 0). `kl` is a constant here (detached), as PPO's epsilon is: it sets the clip range. In seed
/// 000's Python listing the clamp's bounds would carry the KL's gradient, so a clipped term would
/// still push the policy through its bounds — not a trust region.
/// logp, old_logp, adv, kl (B,) -> (B,) each, in logp's dtype; old_logp, adv and kl are constants.
template <ExecutionPolicy Exec = exec::automatic>
clip_loss_result flow_dppo_clamped_loss(const torch::Tensor& logp, const torch::Tensor& old_logp,
                                        const torch::Tensor& adv, const torch::Tensor& kl, double region_min,
                                        double region_max) {
  detail::check_same_shape(logp, old_logp, "flow_dppo_clamped_loss", "logp", "old_logp");
  detail::check_same_shape(logp, adv, "flow_dppo_clamped_loss", "logp", "advantages");
  detail::check_same_shape(logp, kl, "flow_dppo_clamped_loss", "logp", "kl");
  UNIRL_CHECK(logp.is_floating_point(), "flow_dppo_clamped_loss: logp has dtype ", logp.dtype(),
              "; expected a floating type");
  UNIRL_CHECK(region_min >= 0.0, "flow_dppo_clamped_loss: region_min = ", region_min, ": expected >= 0");
  UNIRL_CHECK(region_max >= region_min, "flow_dppo_clamped_loss: region_max = ", region_max,
              ": expected >= region_min (", region_min, ")");
  return exec::dispatch<Exec>(logp, [&] {
    const auto t = logp.scalar_type();
    const auto a = adv.detach().to(t);
    const auto eps = kl.detach().to(t).clamp(region_min, region_max);
    const auto ratio = torch::exp(logp - old_logp.detach().to(t));
    const auto unclipped = -a * ratio;
    const auto clipped_term = -a * torch::min(torch::max(ratio, 1.0 - eps), 1.0 + eps);
    const auto clipped = clipped_term > unclipped;
    return clip_loss_result{torch::where(clipped, clipped_term, unclipped), clipped, ratio};
  });
}

/// Flow-DPPO with the sampler policy `Sampler` and execution policy `Exec`.
template <class Sampler = sde::flow_grpo, ExecutionPolicy Exec = exec::automatic>
class flow_dppo
    : public flow::ratio_algorithm_base<basic_flow_dppo_options<typename Sampler::options>, Sampler, Exec> {
  using base = flow::ratio_algorithm_base<basic_flow_dppo_options<typename Sampler::options>, Sampler, Exec>;

 public:
  using typename base::options;

  explicit flow_dppo(const options& o = {}) : base(o) {}

  /// `-A rho keep` (`flow_dppo_loss`), or with `trust_region = clamped_kl` seed 000's clipped
  /// surrogate (`flow_dppo_clamped_loss`), over the trained steps of the minibatch (+ beta KL);
  /// see the file comment. Figures: `flow/kl_to_old` (mean per-step KL to the sampling policy) and,
  /// for `clamped_kl`, `flow/clip_range` (mean of the clamped KL).
  template <class M>
  loss_terms loss(model_set<M>& ms, const flow_rollout& mb, const step_info&) {
    const auto& o = this->opts_;
    const bool clamped = o.trust_region == dppo_trust_region::clamped_kl;
    torch::Tensor kl_old, range;  // figures, summed in double
    auto [out, n] = this->ratio_loss(
        "flow_dppo", ms, mb,
        [&](std::int64_t k, const replayed_step& r, const torch::Tensor& old_logp, const torch::Tensor& a) {
          torch::Tensor kl_k;
          {
            torch::NoGradGuard ng;
            // The trust region always uses the per-element mean (UniRL flowdppo.py).
            kl_k = gaussian_kl<Exec>(r.step.mean, mb.means.select(1, k), r.step.std, logprob_reduction::mean);
          }
          const auto m = kl_k.to(torch::kFloat64).mean();
          kl_old = kl_old.defined() ? kl_old + m : m;
          if (!clamped) return flow_dppo_loss<Exec>(r.log_prob, old_logp, a, kl_k, o.delta);
          const auto e = kl_k.to(torch::kFloat64).clamp(o.region_min, o.region_max).mean();
          range = range.defined() ? range + e : e;
          return flow_dppo_clamped_loss<Exec>(r.log_prob, old_logp, a, kl_k, o.region_min, o.region_max);
        });
    out.extra["flow/kl_to_old"] = kl_old / n;
    if (clamped) out.extra["flow/clip_range"] = range / n;
    return out;
  }
};
static_assert(Algorithm<flow_dppo<>>);

}  // namespace unirl::algo
