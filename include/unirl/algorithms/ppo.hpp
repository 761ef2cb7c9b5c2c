#pragma once
/// \file ppo.hpp
/// PPO, one algorithm for every track (ALGORITHMS.md §1–2): the loss — clipped surrogate with
/// optional dual clip, clipped value loss, entropy bonus, KL to the reference in the loss or in
/// the reward — is written once here; each track says how to sample, how to compute advantages
/// over its layout and how to evaluate a minibatch by specialising `ppo_track<Track>`.
///
/// ```cpp
/// // A track opts in (e.g. in its own header):
/// template <> struct unirl::algo::ppo_track<my_track> {
///   template <class M, class Input>
///   static rollout_t<M> sample(const ppo_options&, model_set<M>&, Input&, const step_info&);
///   template <class M>
///   static torch::Tensor advantage(const ppo_options&, model_set<M>&, rollout_t<M>&,
///                                  const torch::Tensor& rewards, const step_info&);
///   template <class M>
///   static ppo_eval evaluate(const ppo_options&, model_set<M>&, const rollout_t<M>&, const step_info&);
/// };
/// unirl::trainer<my_model, unirl::algo::ppo<>, my_reward> t{model, reward, {.algorithm = {.clip_low = 0.2}}};
/// ```
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/algorithms/kl.hpp>
#include <unirl/algorithms/loss_agg.hpp>
#include <unirl/algorithms/policy_loss.hpp>
#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/rollout/sampling.hpp>

namespace unirl::algo {

/// Options of `ppo` (all tracks). Token-track defaults follow verl; env-track ones CleanRL.
struct ppo_options {
  double clip_low = 0.2;          // ratio clipped to [1 - clip_low, 1 + clip_high]
  double clip_high = 0.2;
  double dual_clip = 0.0;         // 0 = off; c > 1 caps the loss of A < 0 terms at -A c (verl uses 3)
  double value_clip = 0.2;        // <= 0: unclipped value loss
  double vf_coef = 0.5;
  double ent_coef = 0.01;
  double kl_coef = 0.0;           // 0: no reference model is built
  kl_estimator kl = kl_estimator::k1;
  bool kl_in_reward = true;       // true: -kl_coef * KL per token goes into the reward before GAE
  double gamma = 0.99;
  double lambda = 0.95;
  bool norm_adv = true;           // whiten advantages over each minibatch's valid elements
  loss_agg agg = loss_agg::token_mean;
  std::int64_t max_len = 0;       // L_max for seq_mean_token_sum_norm; 0 = sampling.max_new_tokens
  std::int64_t rollout_steps = 128;  // env track: steps per environment per rollout
  sampling_options sampling{};    // token track: how completions are drawn
  bool pack_sequences = false;    // token track: update forward packed into one row, no padding

  void validate(const std::string& prefix) const {
    options::require(clip_low >= 0.0 && clip_low < 1.0, prefix + "clip_low", clip_low, "in [0, 1)");
    options::require(clip_high >= 0.0, prefix + "clip_high", clip_high, ">= 0");
    options::require(dual_clip == 0.0 || dual_clip > 1.0, prefix + "dual_clip", dual_clip, "0 (off) or > 1");
    options::require(vf_coef >= 0.0, prefix + "vf_coef", vf_coef, ">= 0");
    options::require(kl_coef >= 0.0, prefix + "kl_coef", kl_coef, ">= 0");
    options::require(gamma >= 0.0 && gamma <= 1.0, prefix + "gamma", gamma, "in [0, 1]");
    options::require(lambda >= 0.0 && lambda <= 1.0, prefix + "lambda", lambda, "in [0, 1]");
    options::require(max_len >= 0, prefix + "max_len", max_len, ">= 0");
    options::require(rollout_steps >= 1, prefix + "rollout_steps", rollout_steps, ">= 1");
  }
};

}  // namespace unirl::algo

BOOST_HANA_ADAPT_STRUCT(unirl::algo::ppo_options, clip_low, clip_high, dual_clip, value_clip, vf_coef, ent_coef,
                        kl_coef, kl, kl_in_reward, gamma, lambda, norm_adv, agg, max_len, rollout_steps, sampling,
                        pack_sequences);

namespace unirl::algo {

/// What a track's `evaluate` hands to the shared PPO loss for one minibatch. Every tensor has
/// the same per-element shape ((B, T) tokens, (N,) transitions, ...).
struct ppo_eval {
  torch::Tensor logp;        // log pi_theta(a), differentiable
  torch::Tensor old_logp;    // log pi_old(a) from the rollout
  torch::Tensor advantages;  // from the advantage stage
  torch::Tensor mask;        // 1 = valid element (all ones when nothing is padded)
  torch::Tensor values;      // V_theta, differentiable; undefined when the track has no critic
  torch::Tensor old_values;  // V at rollout time (value clipping)
  torch::Tensor returns;     // GAE returns
  torch::Tensor entropy;     // per-element policy entropy, differentiable; undefined = no bonus
  torch::Tensor ref_logp{};  // log pi_ref(a); undefined when no reference model is used
  std::map<std::string, double> extra{};  // track-specific figures for the statistics
};

/// Customisation point: a track's sample / advantage / evaluate for `ppo` (see the file comment).
/// The primary template is left undefined: `ppo::supports_track<T>` is true exactly when a
/// specialisation for `T` is visible.
template <class Track>
struct ppo_track;

namespace detail {
template <class T, class = void>
struct is_complete : std::false_type {};
template <class T>
struct is_complete<T, std::void_t<decltype(sizeof(T))>> : std::true_type {};
}  // namespace detail

/// The PPO loss over one evaluated minibatch — the part every track shares.
/// ```cpp
/// unirl::loss_terms t = unirl::algo::ppo_loss(opts, ev);   // t.total is differentiable
/// ```
inline loss_terms ppo_loss(const ppo_options& o, const ppo_eval& ev) {
  UNIRL_CHECK(ev.logp.defined() && ev.old_logp.defined() && ev.advantages.defined(),
              "ppo: evaluate() must fill logp, old_logp and advantages");
  const auto mask = ev.mask.defined() ? ev.mask.to(ev.logp.scalar_type()) : torch::ones_like(ev.logp);
  const std::int64_t max_len =
      o.max_len > 0 ? o.max_len : (o.agg == loss_agg::seq_mean_token_sum_norm ? o.sampling.max_new_tokens : 0);
  auto agg = [&](const torch::Tensor& x) { return aggregate(x, mask, o.agg, max_len); };

  auto adv = ev.advantages.detach().to(ev.logp.scalar_type());
  if (o.norm_adv) adv = masked_normalize(adv, mask);
  const auto pl = ppo_clip_loss(ev.logp, ev.old_logp, adv, o.clip_low, o.clip_high, o.dual_clip);
  const auto policy = agg(pl.loss);
  auto total = policy;

  loss_terms out;
  out.policy = policy.item<double>();
  if (ev.values.defined()) {
    UNIRL_CHECK(ev.returns.defined(), "ppo: evaluate() returned values but no returns");
    const auto vl = agg(value_loss(ev.values, ev.old_values.defined() ? ev.old_values : ev.values.detach(),
                                   ev.returns, o.value_clip));
    total = total + o.vf_coef * vl;
    out.value = vl.item<double>();
  }
  if (ev.entropy.defined()) {
    const auto ent = agg(ev.entropy);
    if (o.ent_coef != 0.0) total = total - o.ent_coef * ent;
    out.entropy = ent.item<double>();
  }
  if (ev.ref_logp.defined()) {
    const auto kl = agg(kl_penalty(ev.logp, ev.ref_logp, o.kl));
    if (!o.kl_in_reward && o.kl_coef > 0.0) total = total + o.kl_coef * kl;
    out.kl = kl.item<double>();
  }
  out.total = total;
  {
    torch::NoGradGuard ng;
    const auto log_ratio = ev.logp.detach() - ev.old_logp.detach().to(ev.logp.scalar_type());
    out.ratio_mean = masked_mean(pl.ratio.detach(), mask).item<double>();
    out.clip_fraction = masked_mean(pl.clipped, mask).item<double>();
    out.extra["approx_kl"] = masked_mean(log_ratio.exp() - 1.0 - log_ratio, mask).item<double>();
  }
  for (const auto& [k, v] : ev.extra) out.extra[k] = v;
  return out;
}

/// Proximal policy optimisation (Schulman et al. 2017) for any track with a `ppo_track`.
/// `Exec` chooses the kernels of the hot ops (`exec::automatic` by device).
template <class Exec = exec::automatic>
struct ppo {
  using options = ppo_options;
  using exec_policy = Exec;

  static constexpr bool requires_reference = true;   // built only when uses_reference()
  static constexpr bool requires_critic = true;
  static constexpr bool requires_ema_rollout = false;
  static constexpr bool requires_group = false;
  static constexpr bool supports_multi_update = true;
  template <class Track>
  static constexpr bool supports_track = detail::is_complete<ppo_track<Track>>::value;

  explicit ppo(const options& o = {}) : opts_(o) { unirl::options::validate(opts_); }

  const options& opts() const { return opts_; }
  /// A reference model is needed only for a KL term.
  bool uses_reference() const { return opts_.kl_coef > 0.0; }

  template <ModelAdapter M, class Input>
  rollout_t<M> sample(model_set<M>& models, Input& input, const step_info& info) {
    return ppo_track<typename M::track>::sample(opts_, models, input, info);
  }

  template <ModelAdapter M>
  torch::Tensor advantage(model_set<M>& models, rollout_t<M>& batch, const torch::Tensor& rewards,
                          const step_info& info) {
    return ppo_track<typename M::track>::advantage(opts_, models, batch, rewards, info);
  }

  template <ModelAdapter M>
  loss_terms loss(model_set<M>& models, const rollout_t<M>& minibatch, const step_info& info) {
    return ppo_loss(opts_, ppo_track<typename M::track>::evaluate(opts_, models, minibatch, info));
  }

 private:
  options opts_;
};

static_assert(Algorithm<ppo<>>);

}  // namespace unirl::algo

