#pragma once
/// \file episode_grpo.hpp
/// The GRPO family over multi-turn episodes: a group is G episodes of one task (the layout
/// `run_episodes` returns), each episode's reward is the sum of its turn rewards, and the loss is
/// `algo::grpo_loss` on the policy's tokens only — tool replies, observations and template
/// markers are attended but never trained. Normalisation per token (`agg = token_mean`) or per
/// episode (`agg = seq_mean_token_mean`); the KL to a reference, clip-higher and the dual clip
/// apply unchanged (they are `grpo_options`). The update runs with the library's optimizer
/// (`train::optimizer`) and gradient clipping (`train::clip_grad_norm`).
///
/// ```cpp
/// unirl::agents::episode_grpo<unirl::models::gpt> learner{model, {.algorithm = {.clip_high = 0.28,
///     .agg = unirl::algo::loss_agg::token_mean}, .optim = {.lr = 1e-3}}};
/// auto out = unirl::agents::run_episodes(model, env, seeds, 8, tools, text, agent);
/// auto stats = learner.step(out.episodes, 8, pad_id);   // {"loss": ..., "ratio_mean": ..., ...}
/// ```
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/agents/trajectory.hpp>
#include <unirl/algorithms/estimators.hpp>
#include <unirl/algorithms/grpo.hpp>
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/rollout/token_logprob.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/train/sft.hpp>

namespace unirl::agents {

/// Episodes as one right-padded batch: position t of `ids` predicts token t+1, so the per-token
/// tensors have L-1 columns and column t is token t+1's.
struct episode_batch {
  torch::Tensor ids;          // (B, L) int64, right-padded with pad_id
  torch::Tensor mask;         // (B, L) float, 1 = real token (attended)
  torch::Tensor policy_mask;  // (B, L-1) float, 1 where token t+1 is the policy's (trained)
  torch::Tensor old_logp;     // (B, L-1) float64, behaviour log-probs of those tokens (0 elsewhere)
  torch::Tensor rewards;      // (B,) float64, each episode's reward
  std::int64_t size() const { return ids.defined() ? ids.size(0) : 0; }
};

/// Lays `episodes` out as an `episode_batch` (the trajectory's tokens exactly, none re-encoded).
inline episode_batch make_episode_batch(const std::vector<trajectory>& episodes, std::int64_t pad_id) {
  UNIRL_CHECK(!episodes.empty(), "make_episode_batch: no episodes");
  std::size_t L = 2;
  for (std::size_t i = 0; i < episodes.size(); ++i) {
    const auto& t = episodes[i];
    UNIRL_CHECK(t.policy.size() == t.tokens.size() && t.logp.size() == t.tokens.size(), "make_episode_batch: episode ",
                i, " has ", t.tokens.size(), " tokens, ", t.policy.size(), " mask entries and ", t.logp.size(),
                " log-probs; expected as many");
    UNIRL_CHECK(t.tokens.empty() || t.policy.front() == 0, "make_episode_batch: episode ", i,
                " starts with a policy token; expected a prompt first");
    L = std::max(L, t.tokens.size());
  }
  const auto B = static_cast<std::int64_t>(episodes.size()), Li = static_cast<std::int64_t>(L);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(B * Li), pad_id);
  std::vector<float> mask(static_cast<std::size_t>(B * Li), 0.f), pm(static_cast<std::size_t>(B * (Li - 1)), 0.f);
  std::vector<double> lp(static_cast<std::size_t>(B * (Li - 1)), 0.0), r(static_cast<std::size_t>(B));
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& t = episodes[static_cast<std::size_t>(b)];
    r[static_cast<std::size_t>(b)] = t.reward;
    for (std::size_t j = 0; j < t.tokens.size(); ++j) {
      ids[static_cast<std::size_t>(b * Li) + j] = t.tokens[j];
      mask[static_cast<std::size_t>(b * Li) + j] = 1.f;
      if (j > 0 && t.policy[j]) {
        pm[static_cast<std::size_t>(b * (Li - 1)) + j - 1] = 1.f;
        lp[static_cast<std::size_t>(b * (Li - 1)) + j - 1] = t.logp[j];
      }
    }
  }
  return {torch::tensor(ids, torch::kInt64).view({B, Li}), torch::tensor(mask).view({B, Li}),
          torch::tensor(pm).view({B, Li - 1}), torch::tensor(lp, torch::kDouble).view({B, Li - 1}),
          torch::tensor(r, torch::kDouble)};
}

/// Episodes as an SFT batch (`train::sft_loss`): the cross-entropy of the policy tokens only, the
/// supervised stage on demonstration trajectories (their `logp` is not read).
/// ```cpp
/// auto loss = unirl::train::sft_loss(model, unirl::agents::sft_batch_of(demos, pad_id));
/// ```
inline train::sft_batch sft_batch_of(const std::vector<trajectory>& episodes, std::int64_t pad_id) {
  auto b = make_episode_batch(episodes, pad_id);
  return {b.ids, b.mask, b.policy_mask};
}

/// Log-probs (and entropies) of tokens 1..L-1 of `b` under `model` at `temperature`: (B, L-1) each.
/// Only the policy's tokens are targets (a context token's column reads token 0 in their place):
/// the context may hold ids beyond the vocabulary, such as a VLM's image-slot ids.
template <CausalLM M>
std::pair<torch::Tensor, torch::Tensor> episode_logprob(const M& model, const episode_batch& b, double temperature,
                                                        bool with_entropy = true) {
  torch::Device dev = b.ids.device();
  if constexpr (requires { { model.device() } -> std::convertible_to<torch::Device>; }) dev = model.device();
  const auto L = b.ids.size(1);
  const auto ids = b.ids.to(dev), mask = b.mask.to(dev);
  const auto logits = model.logits(ids.slice(1, 0, L - 1), mask.slice(1, 0, L - 1));
  const auto targets = ids.slice(1, 1, L).masked_fill(b.policy_mask.to(dev) == 0, 0);
  return rollout::token_logprob(logits, targets, temperature, with_entropy);
}

namespace detail {
// The rows `idx` of `b`.
inline episode_batch select_episodes(const episode_batch& b, const torch::Tensor& idx) {
  return {b.ids.index_select(0, idx), b.mask.index_select(0, idx), b.policy_mask.index_select(0, idx),
          b.old_logp.index_select(0, idx), b.rewards.index_select(0, idx)};
}

// `epochs` x `minibatches` optimizer updates over `units` units of `unit` contiguous episodes
// (GRPO: groups of one task; PPO: single episodes), each minibatch whole units, in a fresh random
// order every epoch. `loss(rows)` gives a minibatch's loss terms; `params` are clipped to
// `max_grad_norm`. The figures of every update are summed on the device and read once, together
// with `tail` (whose values are returned); their means go into `s` under `names` (of the loss
// terms: loss, policy_loss, value_loss, kl, entropy, ratio_mean, clip_fraction), with grad_norm,
// updates and skipped_updates.
template <class Loss>
std::vector<double> run_episode_updates(train::optimizer& optim, const std::vector<torch::Tensor>& params,
                                        double max_grad_norm, std::int64_t epochs, std::int64_t minibatches,
                                        std::int64_t units, std::int64_t unit, Loss&& loss,
                                        const std::vector<torch::Tensor>& tail, const std::vector<std::string>& names,
                                        std::map<std::string, double>& s) {
  const auto mbs = std::min(minibatches, units);
  std::int64_t updates = 0;
  torch::Tensor sums;
  double grad_norm_sum = 0.0;
  for (std::int64_t ep = 0; ep < epochs; ++ep) {
    const auto perm = torch::randperm(units, torch::kInt64);  // a host tensor: no device read
    const auto* order = perm.data_ptr<std::int64_t>();
    for (std::int64_t m = 0; m < mbs; ++m) {
      const auto lo = m * units / mbs, hi = (m + 1) * units / mbs;
      std::vector<std::int64_t> rows;
      for (std::int64_t g = lo; g < hi; ++g)
        for (std::int64_t k = 0; k < unit; ++k) rows.push_back(order[g] * unit + k);
      const loss_terms terms = loss(torch::tensor(rows, torch::kInt64));
      optim.zero_grad();
      terms.total.backward();
      const double norm = train::clip_grad_norm(params, max_grad_norm);
      if (!std::isfinite(norm)) {
        ++s["skipped_updates"];
        continue;
      }
      optim.step();
      ++updates;
      const auto dev = terms.total.device();
      std::vector<torch::Tensor> row;
      for (const auto& n : names) {
        const scalar_stat& x = n == "loss"          ? scalar_stat(terms.total)
                               : n == "policy_loss" ? terms.policy
                               : n == "value_loss"  ? terms.value
                               : n == "kl"          ? terms.kl
                               : n == "entropy"     ? terms.entropy
                               : n == "ratio_mean"  ? terms.ratio_mean
                                                    : terms.clip_fraction;
        row.push_back(x.tensor(dev));
      }
      sums = sums.defined() ? sums + torch::stack(row) : torch::stack(row);
      grad_norm_sum += norm;
    }
  }
  std::vector<torch::Tensor> tails;
  for (const auto& t : tail) tails.push_back(t.reshape({1}).to(torch::kDouble));
  auto tail_t = torch::cat(tails);
  const auto read = to_host(sums.defined() ? torch::cat({sums.to(tail_t.device()), tail_t}) : tail_t);  // one read
  const std::size_t n = sums.defined() ? names.size() : 0;
  for (std::size_t i = 0; i < names.size(); ++i)
    s[names[i]] = updates > 0 && sums.defined() ? read[i] / static_cast<double>(updates) : 0.0;
  s["grad_norm"] = updates > 0 ? grad_norm_sum / static_cast<double>(updates) : 0.0;
  s["updates"] = static_cast<double>(updates);
  return {read.begin() + static_cast<std::ptrdiff_t>(n), read.end()};
}
}  // namespace detail

/// Options of `episode_grpo`.
struct episode_grpo_options {
  algo::grpo_options algorithm{};  // clip, KL, agg (token_mean: per token; seq_mean_token_mean: per episode), advantage
  train::optimizer_options optim{.lr = 1e-3};
  train::clip_options clip{.max_grad_norm = 1.0};
  std::int64_t epochs = 1;         // passes over the episodes per step
  std::int64_t minibatches = 1;    // per pass (whole groups each)

  void validate(const std::string& p) const {
    options::require(epochs >= 1, p + "epochs", epochs, ">= 1");
    options::require(minibatches >= 1, p + "minibatches", minibatches, ">= 1");
    options::require(algorithm.advantage != algo::advantage_kind::reinforce_pp, p + "algorithm.advantage",
                     std::string("reinforce_pp"), "group, dr_grpo or rloo (an outcome estimator over episodes)");
  }
};

}  // namespace unirl::agents

BOOST_HANA_ADAPT_STRUCT(unirl::agents::episode_grpo_options, algorithm, optim, clip, epochs, minibatches);

namespace unirl::agents {

/// GRPO over episodes (see the file comment) for the policy `model` (trained in place); a
/// `reference` (same architecture) is needed when `algorithm.kl_coef > 0`.
template <CausalLM M>
class episode_grpo {
 public:
  using options = episode_grpo_options;

  episode_grpo(M& model, options o, const M* reference = nullptr)
      : model_(model), o_((unirl::options::validate(o), o)), ref_(reference),
        optim_(model.named_parameters(), o_.optim) {
    UNIRL_CHECK(o_.algorithm.kl_coef == 0.0 || ref_ != nullptr, "episode_grpo: algorithm.kl_coef = ",
                o_.algorithm.kl_coef, " needs a reference model; pass one or set kl_coef = 0");
  }

  const options& opts() const { return o_; }
  train::optimizer& optimizer() { return optim_; }

  /// Per-episode advantages of `rewards` ((B,), groups of `group` contiguous episodes).
  torch::Tensor advantages(const torch::Tensor& rewards, std::int64_t group) const {
    const auto& a = o_.algorithm;
    switch (a.advantage) {
      case algo::advantage_kind::dr_grpo: return algo::estimate<exec::automatic>(algo::dr_grpo{}, rewards, group);
      case algo::advantage_kind::rloo: return algo::estimate<exec::automatic>(algo::rloo{}, rewards, group);
      default:
        return algo::estimate<exec::automatic>(
            algo::group_normalized{{.unbiased_std = a.unbiased_std, .eps = a.adv_eps}}, rewards, group);
    }
  }

  /// The loss of `b` with per-episode advantages `adv` ((B,)) and pi_old `old_logp` ((B, L-1)).
  loss_terms loss(const episode_batch& b, const torch::Tensor& adv, const torch::Tensor& old_logp) const {
    const auto& a = o_.algorithm;
    auto [logp, ent] = episode_logprob(model_, b, a.sampling.temperature, true);
    const auto dev = logp.device();
    const auto pm = b.policy_mask.to(dev);
    torch::Tensor ref;
    if (ref_ != nullptr && a.kl_coef > 0.0) {
      torch::NoGradGuard ng;
      ref = episode_logprob(*ref_, b, a.sampling.temperature, false).first;
    }
    auto ao = a;
    if (ao.max_len == 0) ao.max_len = std::max<std::int64_t>(1, pm.size(1));
    return algo::grpo_loss(ao, {.logp = logp, .entropy = ent, .old_logp = old_logp.to(dev, logp.scalar_type()),
                                .ref_logp = ref, .advantages = adv.to(dev, logp.scalar_type()).unsqueeze(1) * pm,
                                .mask = pm});
  }

  /// One step on `episodes` (groups of `group` contiguous episodes of one task): advantages,
  /// then `epochs` x `minibatches` updates. Returns the figures (means over the updates).
  std::map<std::string, double> step(const std::vector<trajectory>& episodes, std::int64_t group, std::int64_t pad_id) {
    const auto B = static_cast<std::int64_t>(episodes.size());
    UNIRL_CHECK(group >= 1 && B % group == 0, "episode_grpo::step: ", B, " episodes are not groups of ", group);
    const auto all = make_episode_batch(episodes, pad_id);
    const auto adv = advantages(all.rewards, group);
    model_.train(true);
    std::map<std::string, double> s;
    const auto& a = o_.algorithm;
    // pi_old at the update's geometry (ratio exactly 1 on the first update), or the sampler's.
    torch::Tensor old = all.old_logp;
    if (a.recompute_old_logp) {
      torch::NoGradGuard ng;
      old = episode_logprob(model_, all, a.sampling.temperature, false).first.to(torch::kCPU, torch::kDouble) *
            all.policy_mask.to(torch::kDouble);
      s["sampler_logp_max_diff"] = static_cast<double>(scalar_stat(((old - all.old_logp) * all.policy_mask).abs().max()));
    }
    const auto groups = B / group;
    const auto tail = detail::run_episode_updates(
        optim_, model_.parameters(), o_.clip.max_grad_norm, o_.epochs, o_.minibatches, groups, group,
        [&](const torch::Tensor& idx) {
          return loss(detail::select_episodes(all, idx), adv.index_select(0, idx), old.index_select(0, idx));
        },
        {all.rewards.mean(), all.policy_mask.sum()},
        {"loss", "policy_loss", "kl", "entropy", "ratio_mean", "clip_fraction"}, s);
    s["reward_mean"] = tail[0];
    s["policy_tokens"] = tail[1];
    model_.train(false);
    return s;
  }

 private:
  M& model_;
  options o_;
  const M* ref_;
  train::optimizer optim_;
};

}  // namespace unirl::agents


