#pragma once
/// \file grpo.hpp
/// GRPO and its family on the token track (docs/algorithms/grpo.md), variants as options:
/// - GRPO (DeepSeekMath): group-normalised advantages, PPO clip, beta * k3 KL, `seq_mean_token_mean`;
/// - DAPO: `clip_high = 0.28`, `agg = token_mean`, `kl_coef = 0`, `dynamic_sampling`, `overlong_buffer`;
/// - Dr.GRPO: `advantage = dr_grpo`, `agg = seq_mean_token_sum_norm`;
/// - RLOO and REINFORCE++ advantages; the DPPO token mask instead of the clip (`dppo_mask`); the
///   outcome estimators are the policy types of estimators.hpp, one implementation each;
/// - `layout`: how the update forward lays out a minibatch — `shared_prompt` (default: each
///   distinct prompt once for its group), `packed` (no padding), `padded`; the same loss;
/// - `reuse_on_policy_logp` (default): a step with one update takes pi_old from that update's
///   forward instead of a separate forward after sampling (same values, one forward fewer).
/// `grpo<Exec>` passes the execution policy to every op it calls (log-probs, losses, advantages).
///
/// ```cpp
/// using algo = unirl::algo::grpo<>;
/// unirl::trainer<unirl::models::gpt, algo, my_reward> t{model, reward,
///     {.algorithm = {.clip_high = 0.28, .agg = unirl::algo::loss_agg::token_mean,
///                    .sampling = {.max_new_tokens = 8, .stop_tokens = {eos}}},
///      .group_size = 8}};
/// t.step(prompts);   // prompts: unirl::prompt_batch
/// ```
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/algorithms/estimators.hpp>
#include <unirl/algorithms/kl.hpp>
#include <unirl/algorithms/loss_agg.hpp>
#include <unirl/algorithms/policy_loss.hpp>
#include <unirl/algorithms/token_common.hpp>
#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_logprob.hpp>

namespace unirl::algo {

/// Which advantage estimator GRPO uses.
enum class advantage_kind {
  group,         // (r - mean_g) / (std_g + eps)          GRPO
  dr_grpo,       // r - mean_g                             Dr.GRPO
  rloo,          // r - mean of the others                 RLOO
  reinforce_pp   // discounted token returns incl. -beta k1, whitened over the batch   REINFORCE++
};

}  // namespace unirl::algo

template <>
inline constexpr std::array unirl::enum_names<unirl::algo::advantage_kind>{
    std::string_view{"group"}, std::string_view{"dr_grpo"}, std::string_view{"rloo"}, std::string_view{"reinforce_pp"}};

namespace unirl::algo {

/// Options of `grpo`. Defaults: GRPO as in verl.
struct grpo_options {
  double clip_low = 0.2;
  double clip_high = 0.2;               // DAPO clip-higher: 0.28
  double dual_clip = 0.0;               // 0 = off; c > 1 caps A < 0 losses at -A c
  double kl_coef = 0.0;                 // beta; the reference model is built only when > 0
  kl_estimator kl = kl_estimator::k3;
  loss_agg agg = loss_agg::seq_mean_token_mean;
  std::int64_t max_len = 0;             // L_max of seq_mean_token_sum_norm; 0 = sampling.max_new_tokens
  advantage_kind advantage = advantage_kind::group;
  bool unbiased_std = true;
  double adv_eps = 1e-6;
  double gamma = 1.0;                   // REINFORCE++ token discount
  double ent_coef = 0.0;
  bool dppo_mask = false;               // DPPO token mask instead of the ratio clip
  double dppo_delta = 0.15;
  bool dynamic_sampling = false;        // DAPO: resample groups whose rewards are all equal
  std::int64_t max_resample_rounds = 3;
  std::int64_t overlong_buffer = 0;     // DAPO soft overlong penalty L_c; 0 = off
  double overlong_factor = 1.0;         // scale of that penalty
  bool recompute_old_logp = true;       // pi_old from the training forward (ratio exactly 1 on-policy)
  bool reuse_on_policy_logp = true;     // one update per step: pi_old = that update's own forward, detached
  rollout::update_layout layout = rollout::update_layout::shared_prompt;  // update forward's layout
  sampling_options sampling{};

  void validate(const std::string& p) const {
    options::require(clip_low >= 0.0 && clip_low < 1.0, p + "clip_low", clip_low, "in [0, 1)");
    options::require(clip_high >= 0.0, p + "clip_high", clip_high, ">= 0");
    options::require(dual_clip == 0.0 || dual_clip > 1.0, p + "dual_clip", dual_clip, "0 (off) or > 1");
    options::require(kl_coef >= 0.0, p + "kl_coef", kl_coef, ">= 0");
    options::require(max_len >= 0, p + "max_len", max_len, ">= 0");
    options::require(adv_eps >= 0.0, p + "adv_eps", adv_eps, ">= 0");
    options::require(gamma >= 0.0 && gamma <= 1.0, p + "gamma", gamma, "in [0, 1]");
    options::require(dppo_delta >= 0.0, p + "dppo_delta", dppo_delta, ">= 0");
    options::require(max_resample_rounds >= 0, p + "max_resample_rounds", max_resample_rounds, ">= 0");
    options::require(overlong_buffer >= 0 && overlong_buffer <= sampling.max_new_tokens, p + "overlong_buffer",
                     overlong_buffer, "in [0, sampling.max_new_tokens]");
  }
};

}  // namespace unirl::algo

BOOST_HANA_ADAPT_STRUCT(unirl::algo::grpo_options, clip_low, clip_high, dual_clip, kl_coef, kl, agg, max_len,
                        advantage, unbiased_std, adv_eps, gamma, ent_coef, dppo_mask, dppo_delta, dynamic_sampling,
                        max_resample_rounds, overlong_buffer, overlong_factor, recompute_old_logp, reuse_on_policy_logp,
                        layout, sampling);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::algo::grpo_options>{
    unirl::options::field_doc{"clip_low", "ratio clipped below at 1 - clip_low"},
    unirl::options::field_doc{"clip_high", "ratio clipped above at 1 + clip_high (DAPO: 0.28)"},
    unirl::options::field_doc{"dual_clip", "0 = off; c > 1 caps the loss of A < 0 terms at -A c"},
    unirl::options::field_doc{"kl_coef", "KL penalty to the reference model; 0 = no reference model"},
    unirl::options::field_doc{"kl", "KL estimator"},
    unirl::options::field_doc{"agg", "loss aggregation over tokens and sequences"},
    unirl::options::field_doc{"max_len", "L_max of seq_mean_token_sum_norm; 0 = sampling.max_new_tokens"},
    unirl::options::field_doc{"advantage", "advantage estimator"},
    unirl::options::field_doc{"unbiased_std", "group std with Bessel's correction"},
    unirl::options::field_doc{"adv_eps", "added to the group std before dividing"},
    unirl::options::field_doc{"gamma", "REINFORCE++ token discount"},
    unirl::options::field_doc{"ent_coef", "entropy bonus"},
    unirl::options::field_doc{"dppo_mask", "DPPO token mask instead of the ratio clip"},
    unirl::options::field_doc{"dppo_delta", "DPPO mask threshold"},
    unirl::options::field_doc{"dynamic_sampling", "DAPO: resample groups whose rewards are all equal (filtered by the run's reward)"},
    unirl::options::field_doc{"max_resample_rounds", "resampling rounds of dynamic sampling at most"},
    unirl::options::field_doc{"overlong_buffer", "DAPO soft overlong penalty length L_c; 0 = off"},
    unirl::options::field_doc{"overlong_factor", "scale of the overlong penalty"},
    unirl::options::field_doc{"recompute_old_logp", "pi_old from the training forward (ratio exactly 1 on-policy)"},
    unirl::options::field_doc{"reuse_on_policy_logp", "one update per step: pi_old is that update's own forward, detached"},
    unirl::options::field_doc{"layout", "layout of the update forward: padded, packed or shared_prompt"},
    unirl::options::field_doc{"sampling", "sampling options (set through the sampling.* keys in a recipe)"}};

namespace unirl::algo {

/// What `grpo_loss` reads of one minibatch: per-token tensors of one shape ((B, T)).
struct grpo_eval {
  torch::Tensor logp;        // log pi_theta of the completion tokens, differentiable
  torch::Tensor entropy;     // per-token policy entropy, differentiable; undefined = no entropy term
  torch::Tensor old_logp;    // log pi_old (constant)
  torch::Tensor ref_logp;    // log pi_ref (constant); undefined = no KL term
  torch::Tensor advantages;  // per-token advantages (constant)
  torch::Tensor mask;        // 1 = valid token
};

/// The GRPO-family loss on given tensors (docs/algorithms/grpo.md), what `grpo::loss` computes
/// after its forward: per token the PPO clip (`clip_low`, `clip_high` — DAPO's clip-higher —,
/// `dual_clip`; `ppo_clip_loss`) or the DPPO mask (`dppo_mask`; `dppo_mask_loss`), reduced by `agg`
/// (`aggregate`, L_max = `max_len` or else `sampling.max_new_tokens`);
/// `total = policy + kl_coef KL - ent_coef H`, the KL (`kl_penalty` with `kl`, reduced the same
/// way) only with `ref_logp` and `kl_coef > 0`, and measured but not added for REINFORCE++ (its
/// KL is in the reward). Figures are detached tensors; the dtype is `logp`'s.
/// ```cpp
/// auto t = unirl::algo::grpo_loss(opts, {.logp = lp, .old_logp = old, .advantages = adv, .mask = m});
/// ```
template <ExecutionPolicy Exec = exec::automatic>
loss_terms grpo_loss(const grpo_options& o, const grpo_eval& ev) {
  UNIRL_CHECK(ev.logp.defined() && ev.old_logp.defined() && ev.advantages.defined() && ev.mask.defined(),
              "grpo_loss: logp, old_logp, advantages and mask must be defined");
  const auto& mask = ev.mask;
  const auto pl = o.dppo_mask ? dppo_mask_loss<Exec>(ev.logp, ev.old_logp, ev.advantages, o.dppo_delta)
                              : ppo_clip_loss<Exec>(ev.logp, ev.old_logp, ev.advantages, o.clip_low, o.clip_high,
                                                    o.dual_clip);
  const auto L = o.max_len > 0 ? o.max_len : o.sampling.max_new_tokens;
  auto agg = [&](const torch::Tensor& x) { return aggregate<Exec>(x, mask, o.agg, L); };
  const torch::Tensor policy = agg(pl.loss);
  torch::Tensor total = policy;
  loss_terms out;  // figures stay detached tensors: the trainer reads them once per step
  out.policy = policy;
  if (ev.ref_logp.defined() && o.kl_coef > 0.0) {
    const torch::Tensor kl = agg(kl_penalty<Exec>(ev.logp, ev.ref_logp, o.kl));
    if (o.advantage != advantage_kind::reinforce_pp) total = total + o.kl_coef * kl;  // R++: KL is in the reward
    out.kl = kl;
  }
  if (ev.entropy.defined()) {
    const torch::Tensor entropy = agg(ev.entropy);
    if (o.ent_coef != 0.0) total = total - o.ent_coef * entropy;
    out.entropy = entropy;
  }
  out.total = total;
  torch::NoGradGuard ng;
  out.ratio_mean = masked_mean<Exec>(pl.ratio.detach(), mask);
  out.clip_fraction = masked_mean<Exec>(pl.clipped, mask);
  const auto lr = ev.logp.detach() - ev.old_logp.to(ev.logp.scalar_type());
  out.extra["approx_kl"] = masked_mean<Exec>(lr.exp() - 1.0 - lr, mask);
  out.extra["response_length"] = mask.sum(1).mean();
  return out;
}

namespace detail {
// Concatenates rollouts of possibly different widths (written once over the batch's members,
// rollout/token.hpp).
using unirl::concat_rollouts;
}  // namespace detail

/// The GRPO family (see the file comment). `Exec` selects the implementation of every op it calls.
template <ExecutionPolicy Exec = exec::automatic>
class grpo {
 public:
  using options = grpo_options;
  using exec_policy = Exec;
  /// Scores a rollout for dynamic sampling (the trainer's reward, handed over by the user).
  using filter_reward = std::function<torch::Tensor(const token_rollout&)>;

  static constexpr bool requires_reference = true;  // built only when kl_coef > 0 (uses_reference)
  static constexpr bool requires_critic = false;
  static constexpr bool requires_ema_rollout = false;
  static constexpr bool requires_group = true;
  static constexpr bool supports_multi_update = true;
  template <class Track>
  static constexpr bool supports_track = std::is_same_v<Track, token_track>;

  explicit grpo(const options& o = {}) : o_(o) { unirl::options::validate(o_); }

  const options& opts() const { return o_; }
  bool uses_reference() const { return o_.kl_coef > 0.0; }

  /// The trainer's checks of the sampling settings against the model and of prompts before
  /// sampling (optional hooks, concepts/algorithm.hpp); `key` is where the options sit ("algorithm.").
  template <class M>
  void check_model(const M& model, const std::string& key) const {
    check_sampling_against_model(o_.sampling, model, key + "sampling.");
  }
  template <class M>
  void check_input(const M& model, const prompt_batch& in, const std::string& key) const {
    check_prompt_lengths(o_.sampling, model, in, key + "sampling.");
  }

  /// Gradient accumulation (trainer option `micro_batch_size`): what the loss of `b` divides by —
  /// its valid tokens under `token_mean`, its sequences otherwise (`aggregation_normaliser`).
  torch::Tensor loss_normaliser(const token_rollout& b) const {
    return aggregation_normaliser(b.completion_mask, o_.agg);
  }

  /// Dynamic sampling (DAPO) scores candidate groups with this function — pass the trainer's
  /// reward: `t.algorithm().set_filter_reward(std::ref(t.reward()))`.
  void set_filter_reward(filter_reward f) { filter_ = std::move(f); }

  template <CausalLM M>
  token_rollout sample(model_set<M>& models, const prompt_batch& input, const step_info& info) {
    auto batch = sample_for_update<Exec>(models, input, info, o_.sampling, recomputes_at_sampling(info), o_.layout);
    if (!o_.dynamic_sampling) return batch;
    UNIRL_CHECK(static_cast<bool>(filter_), "grpo: dynamic_sampling = true needs the reward to filter groups: call "
                                            "trainer.algorithm().set_filter_reward(...)");
    return refill(models, input, info, std::move(batch));
  }

  /// Fills `batch.advantages` ((B, T), 0 on masked tokens) and returns one advantage per sample
  /// (B,). Computed in the wider of the rewards' and the log-probs' floating types (a float64
  /// model gives float64 advantages; integer rewards count as float32).
  template <CausalLM M>
  torch::Tensor advantage(model_set<M>&, token_rollout& batch, const torch::Tensor& rewards, const step_info& info) {
    const auto G = info.group_size;
    const auto mask = batch.completion_mask;
    auto dtype = rewards.is_floating_point() ? rewards.scalar_type() : torch::kFloat;
    if (batch.old_logp.defined()) dtype = c10::promoteTypes(dtype, batch.old_logp.scalar_type());
    auto r = rewards.to(mask.device(), dtype);
    if (o_.overlong_buffer > 0) {
      const auto pen = overlong_penalty(batch.lengths(), o_.sampling.max_new_tokens, o_.overlong_buffer, dtype);
      info.report("overlong_penalty", pen.mean());
      r = r + o_.overlong_factor * pen;
    }
    if (o_.advantage == advantage_kind::reinforce_pp) {
      batch.advantages = algo::reinforce_pp_advantage<Exec>(r, mask, batch.old_logp, batch.ref_logp, o_.kl_coef,
                                                            o_.gamma);
      return batch.advantages.select(1, 0);
    }
    // The outcome estimators (estimators.hpp): the run-time option picks the policy type.
    torch::Tensor per_sample;
    switch (o_.advantage) {
      case advantage_kind::group:
        per_sample = estimate<Exec>(group_normalized{{.unbiased_std = o_.unbiased_std, .eps = o_.adv_eps}}, r, G);
        break;
      case advantage_kind::dr_grpo: per_sample = estimate<Exec>(dr_grpo{}, r, G); break;
      case advantage_kind::rloo: per_sample = estimate<Exec>(rloo{}, r, G); break;
      case advantage_kind::reinforce_pp: break;  // handled above
    }
    batch.advantages = per_sample.unsqueeze(1) * mask;
    return per_sample;
  }

  /// REINFORCE++ token advantages of `b` (the free `reinforce_pp_advantage`, advantage.hpp). (B, T).
  torch::Tensor reinforce_pp_advantage(const token_rollout& b, const torch::Tensor& outcome) const {
    return algo::reinforce_pp_advantage<Exec>(outcome, b.completion_mask, b.old_logp, b.ref_logp, o_.kl_coef,
                                              o_.gamma);
  }

  /// The GRPO loss of a minibatch: the update forward's log-probs and entropies, then `grpo_loss`.
  template <CausalLM M>
  loss_terms loss(model_set<M>& models, const token_rollout& minibatch, const step_info& info) {
    token_rollout mb = minibatch.trimmed();  // dynamic padding: only the minibatch's own width
    const auto mask = mb.completion_mask;
    torch::Tensor logp, ent;
    std::tie(logp, ent) = rollout::update_logprob<Exec>(models.policy, mb, o_.sampling.temperature, true, o_.layout);
    UNIRL_CHECK(mb.advantages.defined(), "grpo: the minibatch has no advantages; advantage() must run first");
    if (reuses_update_logp(info)) {
      // The step's only update is on-policy: pi_old is this very forward (what the recompute at
      // sampling would have produced), so the separate forward was skipped.
      torch::NoGradGuard ng;
      info.report("sampler_logp_max_diff", ((logp.detach() - mb.old_logp) * mask).abs().max());
      mb.old_logp = logp.detach() * mask;
    }
    return grpo_loss<Exec>(o_, {.logp = logp, .entropy = ent, .old_logp = mb.old_logp, .ref_logp = mb.ref_logp,
                                .advantages = mb.advantages, .mask = mask});
  }

 private:
  // pi_old comes from the update's own forward: the step takes one update and the advantage does
  // not read pi_old (REINFORCE++ with a KL does).
  bool reuses_update_logp(const step_info& info) const {
    return o_.recompute_old_logp && o_.reuse_on_policy_logp && info.updates == 1 &&
           !(o_.advantage == advantage_kind::reinforce_pp && o_.kl_coef > 0.0);
  }
  bool recomputes_at_sampling(const step_info& info) const {
    return o_.recompute_old_logp && !reuses_update_logp(info);
  }

  template <CausalLM M>
  token_rollout refill(model_set<M>& models, const prompt_batch& input, const step_info& info, token_rollout batch) {
    const auto G = info.group_size;
    const auto n = input.size();
    std::vector<bool> ok(static_cast<std::size_t>(n), false);
    std::vector<token_rollout> kept;
    auto absorb = [&](const token_rollout& b, const std::vector<std::int64_t>& prompt_of_group) {
      const auto varied = to_host(informative_groups(filter_(b), G));  // one read per candidate batch
      for (std::int64_t g = 0; g < static_cast<std::int64_t>(varied.size()); ++g) {
        if (varied[static_cast<std::size_t>(g)] == 0.0) continue;
        const auto idx = torch::arange(g * G, (g + 1) * G, torch::kInt64);
        auto part = b.select(idx);  // a host index: batch::select moves it, no device round trip
        part.prompt_index.fill_(prompt_of_group[static_cast<std::size_t>(g)]);
        kept.push_back(std::move(part));
        ok[static_cast<std::size_t>(prompt_of_group[static_cast<std::size_t>(g)])] = true;
      }
    };
    std::vector<std::int64_t> all(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) all[static_cast<std::size_t>(i)] = i;
    absorb(batch, all);
    for (std::int64_t round = 0; round < o_.max_resample_rounds; ++round) {
      prompt_batch again{.decode = input.decode, .pad_id = input.pad_id};
      std::vector<std::int64_t> which;
      for (std::int64_t i = 0; i < n; ++i) {
        if (ok[static_cast<std::size_t>(i)]) continue;
        which.push_back(i);
        again.tokens.push_back(input.tokens[static_cast<std::size_t>(i)]);
        if (!input.texts.empty()) again.texts.push_back(input.texts[static_cast<std::size_t>(i)]);
        if (!input.references.empty()) again.references.push_back(input.references[static_cast<std::size_t>(i)]);
      }
      if (which.empty()) break;
      absorb(sample_for_update<Exec>(models, again, info, o_.sampling, recomputes_at_sampling(info), o_.layout),
             which);
    }
    info.report("dynamic_sampling/kept_groups", static_cast<double>(kept.size()));
    if (kept.empty()) return batch;  // nothing informative: train on the batch as drawn (A = 0)
    return detail::concat_rollouts(kept, input.pad_id);
  }

  options o_;
  filter_reward filter_{};
};

}  // namespace unirl::algo
