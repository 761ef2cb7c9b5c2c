#pragma once
/// \file ppo.hpp
/// PPO, one algorithm for every track (docs/algorithms/ppo.md): the loss — clipped surrogate with
/// optional dual clip, clipped value loss, entropy bonus, KL to the reference in the loss or in
/// the reward — is written once here; each track says how to sample, how to compute advantages
/// over its layout and how to evaluate a minibatch, and which options it has of its own, by
/// specialising `ppo_track<Track>` in its own header. This header names no track.
///
/// `ppo<Exec>` is a family (see `Algorithm`): the trainer builds `ppo<Exec, M::track>`, whose
/// options are the shared ones plus the track's under `track`. Using `ppo<>` with a track whose
/// `ppo_track` specialisation is not visible fails to compile, naming the header to include.
///
/// ```cpp
/// // A track opts in (in its own header):
/// template <> struct unirl::algo::ppo_track<my_track> {
///   struct options { std::int64_t horizon = 64; };      // reflectable (BOOST_HANA_ADAPT_STRUCT)
///   using settings = unirl::algo::basic_ppo_options<options>;
///   template <unirl::ExecutionPolicy Exec, class M, class Input>
///   static unirl::rollout_t<M> sample(const settings&, unirl::model_set<M>&, Input&, const unirl::step_info&);
///   template <unirl::ExecutionPolicy Exec, class M>
///   static torch::Tensor advantage(const settings&, unirl::model_set<M>&, unirl::rollout_t<M>&,
///                                  const torch::Tensor& rewards, const unirl::step_info&);
///   template <unirl::ExecutionPolicy Exec, class M>
///   static unirl::algo::ppo_eval evaluate(const settings&, unirl::model_set<M>&, const unirl::rollout_t<M>&,
///                                         const unirl::step_info&);
/// };
/// unirl::trainer<my_model, unirl::algo::ppo<>, my_reward> t{model, reward,
///     {.algorithm = {.clip_low = 0.2, .track = {.horizon = 128}}}};
/// ```
#include <concepts>
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
#include <unirl/concepts/execution.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/config.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>

namespace unirl::algo {

/// Options of `ppo` for a track whose own options are `TrackOptions` (`ppo_track<Track>::options`,
/// nested under `track`). Token-track defaults follow verl; env-track ones CleanRL.
template <class TrackOptions>
struct basic_ppo_options {
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
  std::int64_t max_len = 0;       // L_max for seq_mean_token_sum_norm; 0 = the track's (token: max_new_tokens)
  TrackOptions track{};           // the track's own options (ppo_track<Track>::options)

  void validate(const std::string& prefix) const {
    options::require(clip_low >= 0.0 && clip_low < 1.0, prefix + "clip_low", clip_low, "in [0, 1)");
    options::require(clip_high >= 0.0, prefix + "clip_high", clip_high, ">= 0");
    options::require(dual_clip == 0.0 || dual_clip > 1.0, prefix + "dual_clip", dual_clip, "0 (off) or > 1");
    options::require(vf_coef >= 0.0, prefix + "vf_coef", vf_coef, ">= 0");
    options::require(kl_coef >= 0.0, prefix + "kl_coef", kl_coef, ">= 0");
    options::require(gamma >= 0.0 && gamma <= 1.0, prefix + "gamma", gamma, "in [0, 1]");
    options::require(lambda >= 0.0 && lambda <= 1.0, prefix + "lambda", lambda, "in [0, 1]");
    options::require(max_len >= 0, prefix + "max_len", max_len, ">= 0");
  }
};

/// The track options of the shared part alone (what `ppo_loss` reads needs no track).
struct ppo_no_track_options {};

/// The options every track shares, without a track's own: what `ppo_loss` reads.
using ppo_options = basic_ppo_options<ppo_no_track_options>;

}  // namespace unirl::algo

// basic_ppo_options is a template, so BOOST_HANA_ADAPT_STRUCT cannot adapt it: this is the table
// the macro would generate (tests/static checks that it lists every member).
namespace boost::hana {
template <class T>
struct accessors_impl<unirl::algo::basic_ppo_options<T>> {
#define UNIRL_MEMBER(name) \
  make_pair(BOOST_HANA_STRING(#name), [](auto&& s) -> decltype(auto) { return (static_cast<decltype(s)&&>(s).name); })
  static constexpr auto apply() {
    return make_tuple(UNIRL_MEMBER(clip_low), UNIRL_MEMBER(clip_high), UNIRL_MEMBER(dual_clip),
                      UNIRL_MEMBER(value_clip), UNIRL_MEMBER(vf_coef), UNIRL_MEMBER(ent_coef), UNIRL_MEMBER(kl_coef),
                      UNIRL_MEMBER(kl), UNIRL_MEMBER(kl_in_reward), UNIRL_MEMBER(gamma), UNIRL_MEMBER(lambda),
                      UNIRL_MEMBER(norm_adv), UNIRL_MEMBER(agg), UNIRL_MEMBER(max_len), UNIRL_MEMBER(track));
  }
#undef UNIRL_MEMBER
};
template <>
struct accessors_impl<unirl::algo::ppo_no_track_options> {
  static constexpr auto apply() { return make_tuple(); }
};
}  // namespace boost::hana

template <class T>
inline constexpr std::array unirl::options::field_docs<unirl::algo::basic_ppo_options<T>>{
    unirl::options::field_doc{"clip_low", "ratio clipped below at 1 - clip_low"},
    unirl::options::field_doc{"clip_high", "ratio clipped above at 1 + clip_high"},
    unirl::options::field_doc{"dual_clip", "0 = off; c > 1 caps the loss of A < 0 terms at -A c"},
    unirl::options::field_doc{"value_clip", "value-loss clip range; <= 0 = unclipped"},
    unirl::options::field_doc{"vf_coef", "weight of the value loss"},
    unirl::options::field_doc{"ent_coef", "entropy bonus"},
    unirl::options::field_doc{"kl_coef", "KL penalty to the reference model; 0 = no reference model"},
    unirl::options::field_doc{"kl", "KL estimator"},
    unirl::options::field_doc{"kl_in_reward", "true: -kl_coef * KL per token goes into the reward before GAE"},
    unirl::options::field_doc{"gamma", "GAE discount"},
    unirl::options::field_doc{"lambda", "GAE lambda"},
    unirl::options::field_doc{"norm_adv", "whiten advantages over each minibatch"},
    unirl::options::field_doc{"agg", "loss aggregation over tokens and sequences"},
    unirl::options::field_doc{"max_len", "L_max of seq_mean_token_sum_norm; 0 = the track's (sampling.max_new_tokens)"}};

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
  std::int64_t max_len = 0;  // the track's L_max for seq_mean_token_sum_norm when options.max_len = 0
  std::map<std::string, scalar_stat> extra{};  // track-specific figures for the statistics
};

/// Customisation point: a track's options and stages for `ppo` (see the file comment). The
/// primary template fails to compile: `ppo` trains exactly the tracks whose specialisation is
/// visible, and asking about any other is an error that says which header to include.
template <class Track>
struct ppo_track {
  static_assert(unirl::detail::dependent_false<Track>,
                "unirl::algo::ppo: no ppo_track<Track> specialisation is visible for this model's track. Include "
                "the track's PPO header — <unirl/algorithms/ppo_token.hpp> (token_track), "
                "<unirl/algorithms/ppo_env.hpp> (env_track), or the umbrella <unirl/token.hpp> / <unirl/env.hpp> — "
                "before naming unirl::algo::ppo<> with it; PPO does not train the flow track; a track of your "
                "own specialises unirl::algo::ppo_track<Track> (see algorithms/ppo.hpp)");
  using options = ppo_no_track_options;
};

/// The PPO loss over one evaluated minibatch — the part every track shares. The figures are
/// detached tensors (no host synchronisation).
/// ```cpp
/// unirl::loss_terms t = unirl::algo::ppo_loss(opts, ev);   // t.total is differentiable
/// ```
template <ExecutionPolicy Exec = exec::automatic, class TrackOptions>
loss_terms ppo_loss(const basic_ppo_options<TrackOptions>& o, const ppo_eval& ev) {
  UNIRL_CHECK(ev.logp.defined() && ev.old_logp.defined() && ev.advantages.defined(),
              "ppo: evaluate() must fill logp, old_logp and advantages");
  const auto mask = ev.mask.defined() ? ev.mask.to(ev.logp.scalar_type()) : torch::ones_like(ev.logp);
  const std::int64_t max_len = o.max_len > 0 ? o.max_len : (o.agg == loss_agg::seq_mean_token_sum_norm ? ev.max_len : 0);
  auto agg = [&](const torch::Tensor& x) { return aggregate<Exec>(x, mask, o.agg, max_len); };

  auto adv = ev.advantages.detach().to(ev.logp.scalar_type());
  if (o.norm_adv) adv = masked_normalize<Exec>(adv, mask);
  const auto pl = ppo_clip_loss<Exec>(ev.logp, ev.old_logp, adv, o.clip_low, o.clip_high, o.dual_clip);
  const auto policy = agg(pl.loss);
  auto total = policy;

  loss_terms out;
  out.policy = policy;
  if (ev.values.defined()) {
    UNIRL_CHECK(ev.returns.defined(), "ppo: evaluate() returned values but no returns");
    const auto vl = agg(value_loss<Exec>(ev.values, ev.old_values.defined() ? ev.old_values : ev.values.detach(),
                                         ev.returns, o.value_clip));
    total = total + o.vf_coef * vl;
    out.value = vl;
  }
  if (ev.entropy.defined()) {
    const auto ent = agg(ev.entropy);
    if (o.ent_coef != 0.0) total = total - o.ent_coef * ent;
    out.entropy = ent;
  }
  if (ev.ref_logp.defined()) {
    const auto kl = agg(kl_penalty<Exec>(ev.logp, ev.ref_logp, o.kl));
    if (!o.kl_in_reward && o.kl_coef > 0.0) total = total + o.kl_coef * kl;
    out.kl = kl;
  }
  out.total = total;
  {
    torch::NoGradGuard ng;
    const auto log_ratio = ev.logp.detach() - ev.old_logp.detach().to(ev.logp.scalar_type());
    out.ratio_mean = masked_mean<Exec>(pl.ratio.detach(), mask);
    out.clip_fraction = masked_mean<Exec>(pl.clipped, mask);
    out.extra["approx_kl"] = masked_mean<Exec>(log_ratio.exp() - 1.0 - log_ratio, mask);
  }
  for (const auto& [k, v] : ev.extra) out.extra[k] = v;
  return out;
}

/// Proximal policy optimisation (Schulman et al. 2017) on `Track`, through `ppo_track<Track>`.
/// `Exec` chooses the kernels of every op the loss and the track's stages call.
/// `ppo<Exec>` (no track) is the family the trainer binds to its model's track.
template <ExecutionPolicy Exec = exec::automatic, class Track = void>
struct ppo {
  using options = basic_ppo_options<typename ppo_track<Track>::options>;
  using exec_policy = Exec;
  using track = Track;
  template <class T>
  using for_track = ppo<Exec, T>;

  static constexpr bool requires_reference = true;   // built only when uses_reference()
  static constexpr bool requires_critic = true;
  static constexpr bool requires_ema_rollout = false;
  static constexpr bool requires_group = false;
  static constexpr bool supports_multi_update = true;
  template <class T>
  static constexpr bool supports_track = std::is_same_v<T, Track>;

  explicit ppo(const options& o = {}) : opts_(o) { unirl::options::validate(opts_); }

  const options& opts() const { return opts_; }
  /// A reference model is needed only for a KL term.
  bool uses_reference() const { return opts_.kl_coef > 0.0; }

  /// The track's checks of its settings against the model and of an input before sampling
  /// (optional hooks, concepts/algorithm.hpp), where the track has them.
  template <class M>
    requires requires(const options& o, const M& m, const std::string& k) { ppo_track<Track>::check_model(o, m, k); }
  void check_model(const M& model, const std::string& key) const {
    ppo_track<Track>::check_model(opts_, model, key);
  }
  template <class M, class Input>
    requires requires(const options& o, const M& m, const Input& in, const std::string& k) {
      ppo_track<Track>::check_input(o, m, in, k);
    }
  void check_input(const M& model, const Input& in, const std::string& key) const {
    ppo_track<Track>::check_input(opts_, model, in, key);
  }

  // Each stage is constrained by the track's own (`AlgorithmFor` and `SamplesFrom` see through).
  template <ModelAdapter M, class Input>
    requires requires(const options& o, model_set<M>& ms, Input& in, const step_info& i) {
      { ppo_track<Track>::template sample<Exec>(o, ms, in, i) } -> std::same_as<rollout_t<M>>;
    }
  rollout_t<M> sample(model_set<M>& models, Input& input, const step_info& info) {
    return ppo_track<Track>::template sample<Exec>(opts_, models, input, info);
  }

  template <ModelAdapter M>
    requires requires(const options& o, model_set<M>& ms, rollout_t<M>& b, const torch::Tensor& r,
                      const step_info& i) {
      { ppo_track<Track>::template advantage<Exec>(o, ms, b, r, i) } -> std::same_as<torch::Tensor>;
    }
  torch::Tensor advantage(model_set<M>& models, rollout_t<M>& batch, const torch::Tensor& rewards,
                          const step_info& info) {
    return ppo_track<Track>::template advantage<Exec>(opts_, models, batch, rewards, info);
  }

  template <ModelAdapter M>
    requires requires(const options& o, model_set<M>& ms, const rollout_t<M>& b, const step_info& i) {
      { ppo_track<Track>::template evaluate<Exec>(o, ms, b, i) } -> std::same_as<ppo_eval>;
    }
  loss_terms loss(model_set<M>& models, const rollout_t<M>& minibatch, const step_info& info) {
    if (info.micro_batches > 1 && opts_.norm_adv) {  // whitened over the minibatch by prepare_minibatch
      options o = opts_;
      o.norm_adv = false;
      return ppo_loss<Exec>(o, ppo_track<Track>::template evaluate<Exec>(opts_, models, minibatch, info));
    }
    return ppo_loss<Exec>(opts_, ppo_track<Track>::template evaluate<Exec>(opts_, models, minibatch, info));
  }

  /// Gradient accumulation (trainer option `micro_batch_size`): what the loss of `b` divides by —
  /// `aggregation_normaliser` of its completion mask on the token track; its transitions on a track
  /// without padding.
  template <class Rollout>
  torch::Tensor loss_normaliser(const Rollout& b) const {
    if constexpr (requires { b.completion_mask; }) return aggregation_normaliser(b.completion_mask, opts_.agg);
    else return torch::full({}, static_cast<double>(b.size()), torch::kFloat64);
  }

  /// Gradient accumulation: with `norm_adv`, the minibatch's advantages whitened once over all of
  /// its valid elements, so that every micro-batch's loss uses the minibatch's mean and std (its
  /// `loss` then skips its own whitening, `step_info::micro_batches > 1`).
  template <class Rollout>
  Rollout prepare_minibatch(const Rollout& mb) const {
    if (!opts_.norm_adv || !mb.advantages.defined()) return mb;
    Rollout out = mb;
    if constexpr (requires { mb.completion_mask; })
      out.advantages = masked_normalize<Exec>(mb.advantages.detach(), mb.completion_mask);
    else
      out.advantages = masked_normalize<Exec>(mb.advantages.detach(), torch::ones_like(mb.advantages));
    return out;
  }

 private:
  options opts_;
};

/// The family `ppo<Exec>`: not an `Algorithm` itself; the trainer builds `for_track<M::track>`.
template <ExecutionPolicy Exec>
struct ppo<Exec, void> {
  using exec_policy = Exec;
  template <class T>
  using for_track = ppo<Exec, T>;
};

}  // namespace unirl::algo
