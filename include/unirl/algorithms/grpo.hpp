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

namespace unirl::algo {

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

  template <CausalLM M>
  torch::Tensor advantage(model_set<M>&, token_rollout& batch, const torch::Tensor& rewards, const step_info& info) {
    const auto G = info.group_size;
    const auto mask = batch.completion_mask;
    auto r = rewards.to(mask.device(), torch::kFloat);
    if (o_.overlong_buffer > 0) {
      const auto pen = overlong_penalty(batch.lengths(), o_.sampling.max_new_tokens, o_.overlong_buffer);
      info.report("overlong_penalty", pen.mean());
      r = r + o_.overlong_factor * pen;
    }
    if (o_.advantage == advantage_kind::reinforce_pp) {
      batch.advantages = reinforce_pp_advantage(batch, r);
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

  /// REINFORCE++ token advantages: r_t = -beta k1_t (+ outcome on the last token), discounted
  /// returns, whitened over the valid tokens of the batch. (B, T).
  torch::Tensor reinforce_pp_advantage(const token_rollout& b, const torch::Tensor& outcome) const {
    const auto mask = b.completion_mask;
    const auto T = mask.size(1);
    auto tok = torch::zeros_like(mask);
    if (b.ref_logp.defined() && o_.kl_coef > 0.0) tok = tok - o_.kl_coef * (b.old_logp - b.ref_logp) * mask;
    const auto last = (b.lengths() - 1).clamp_min(0);
    tok = tok.scatter_add(1, last.unsqueeze(1), outcome.unsqueeze(1).to(tok.scalar_type()));
    auto ret = torch::zeros_like(tok);
    auto run = torch::zeros({mask.size(0)}, tok.options());
    for (std::int64_t t = T - 1; t >= 0; --t) {
      run = tok.select(1, t) + o_.gamma * run * mask.select(1, t);
      ret.select(1, t).copy_(run);
    }
    return masked_normalize<Exec>(ret * mask, mask);
  }

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
    const auto pl = o_.dppo_mask ? dppo_mask_loss<Exec>(logp, mb.old_logp, mb.advantages, o_.dppo_delta)
                                 : ppo_clip_loss<Exec>(logp, mb.old_logp, mb.advantages, o_.clip_low, o_.clip_high,
                                                       o_.dual_clip);
    const auto L = o_.max_len > 0 ? o_.max_len : o_.sampling.max_new_tokens;
    auto agg = [&](const torch::Tensor& x) { return aggregate<Exec>(x, mask, o_.agg, L); };
    const torch::Tensor policy = agg(pl.loss);
    torch::Tensor total = policy;
    loss_terms out;  // figures stay detached tensors: the trainer reads them once per step
    out.policy = policy;
    if (mb.ref_logp.defined() && o_.kl_coef > 0.0) {
      const torch::Tensor kl = agg(kl_penalty<Exec>(logp, mb.ref_logp, o_.kl));
      if (o_.advantage != advantage_kind::reinforce_pp) total = total + o_.kl_coef * kl;  // R++: KL is in the reward
      out.kl = kl;
    }
    const torch::Tensor entropy = agg(ent);
    if (o_.ent_coef != 0.0) total = total - o_.ent_coef * entropy;
    out.entropy = entropy;
    out.total = total;
    torch::NoGradGuard ng;
    out.ratio_mean = masked_mean<Exec>(pl.ratio.detach(), mask);
    out.clip_fraction = masked_mean<Exec>(pl.clipped, mask);
    const auto lr = logp.detach() - mb.old_logp;
    out.extra["approx_kl"] = masked_mean<Exec>(lr.exp() - 1.0 - lr, mask);
    out.extra["response_length"] = mask.sum(1).mean();
    return out;
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
      const auto r = filter_(b).to(torch::kCPU, torch::kFloat).reshape({-1, G});
      const auto varied = to_host(r.amax(1) != r.amin(1));  // one read per candidate batch
      for (std::int64_t g = 0; g < r.size(0); ++g) {
        if (varied[static_cast<std::size_t>(g)] == 0.0) continue;
        const auto idx = torch::arange(g * G, (g + 1) * G, torch::kInt64);
        auto part = b.select(idx.to(b.completion_ids.device()));
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
