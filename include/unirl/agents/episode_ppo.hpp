#pragma once
/// \file episode_ppo.hpp
/// PPO over multi-turn episodes with GAE over the policy's tokens (docs/agents.md, "PPO over
/// episodes"). The critic is the one the token track's PPO uses: `make_critic()` of the policy
/// (its backbone's weights, a fresh scalar head), evaluated on the whole trajectory, so its value
/// at a policy token has attended to every earlier reply and observation. The convention:
/// - a turn's reward sits on the **last policy token of that turn** (`turn_token_rewards`), minus
///   `kl_coef` x KL on every policy token when `kl_in_reward` and a reference are given;
/// - GAE runs over the policy tokens only (`masked_gae`): the tokens of the prompt, tool replies,
///   observations and template markers are attended but skipped — no value target, no TD error,
///   no discount step, no loss — so GAE sees the sequence of policy tokens with each turn's reward
///   on its last one (verl's `compute_gae_advantage_return` with a response mask, the multi-turn
///   PPO RAGEN trains with; ArCHer / token-level credit in the same spirit);
/// - the loss is `algo::ppo_loss` (clipped surrogate, clipped value loss, entropy, KL) with the
///   policy mask as its mask: a non-policy token has no term in it and gets no gradient.
///
/// ```cpp
/// unirl::agents::episode_ppo<unirl::models::gpt> learner{model, {.algorithm = {.gamma = 1.0, .lambda = 0.95},
///                                                                 .optim = {.lr = 1e-3}}};
/// auto out = unirl::agents::run_episodes(model, env, seeds, 1, tools, text, agent);
/// auto stats = learner.step(out.episodes, pad_id);   // {"loss": ..., "value_loss": ..., ...}
/// ```
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/agents/episode_grpo.hpp>
#include <unirl/agents/trajectory.hpp>
#include <unirl/algorithms/kl.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/optimizer.hpp>

namespace unirl::agents {

/// Per-token rewards of `episodes` in the `episode_batch` layout ((B, L-1) float64, column t is
/// token t+1): each turn's reward on the last policy token of that turn (before its
/// `turn_ends`), 0 elsewhere. `L` is the batch's padded length.
/// ```cpp
/// auto r = unirl::agents::turn_token_rewards(episodes, batch.ids.size(1));
/// ```
inline torch::Tensor turn_token_rewards(const std::vector<trajectory>& episodes, std::int64_t L) {
  UNIRL_CHECK(L >= 2, "turn_token_rewards: L = ", L, ": expected >= 2");
  const auto B = static_cast<std::int64_t>(episodes.size());
  std::vector<double> r(static_cast<std::size_t>(B * (L - 1)), 0.0);
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& t = episodes[static_cast<std::size_t>(b)];
    UNIRL_CHECK(t.turn_rewards.size() == t.turn_ends.size(), "turn_token_rewards: episode ", b, " has ",
                t.turn_rewards.size(), " turn rewards and ", t.turn_ends.size(), " turn ends; expected one each");
    UNIRL_CHECK(t.size() <= L, "turn_token_rewards: episode ", b, " has ", t.size(), " tokens; L = ", L);
    for (std::size_t k = 0; k < t.turn_ends.size(); ++k) {
      std::int64_t j = t.turn_ends[k] - 1;
      UNIRL_CHECK(j < t.size(), "turn_token_rewards: episode ", b, " turn ", k, " ends at ", t.turn_ends[k],
                  ", past its ", t.size(), " tokens");
      while (j >= 1 && !t.policy[static_cast<std::size_t>(j)]) --j;
      UNIRL_CHECK(j >= 1, "turn_token_rewards: episode ", b, " turn ", k, " (ending at token ", t.turn_ends[k],
                  ") has no policy token at or before its end; expected the policy to have written one");
      r[static_cast<std::size_t>(b * (L - 1) + j - 1)] += t.turn_rewards[k];
    }
  }
  return torch::tensor(r, torch::kDouble).view({B, L - 1});
}

/// GAE over the policy's tokens (see the file comment): `rewards`, `values`, `policy_mask`
/// (B, T) -> advantages and returns (B, T), float64 on the host, 0 off the mask. Along each row
/// the masked-out positions are skipped: with p_0 < p_1 < ... < p_n the row's policy positions,
/// `delta_i = r_{p_i} + gamma V_{p_{i+1}} - V_{p_i}` (`V_{p_{n+1}} = 0`: the episode ends after
/// its last policy token) and `A_{p_i} = delta_i + gamma lambda A_{p_{i+1}}`; returns = A + V.
/// Rewards off the mask are an error (they would be dropped).
/// ```cpp
/// auto g = unirl::agents::masked_gae(r, v, b.policy_mask, 1.0, 0.95);   // g.advantages, g.returns
/// ```
inline algo::gae_result masked_gae(const torch::Tensor& rewards, const torch::Tensor& values,
                                   const torch::Tensor& policy_mask, double gamma, double lambda) {
  UNIRL_CHECK(policy_mask.defined() && policy_mask.dim() == 2, "masked_gae: policy_mask must be (B, T), got sizes ",
              policy_mask.defined() ? policy_mask.sizes() : torch::IntArrayRef{});
  UNIRL_CHECK(rewards.defined() && rewards.sizes() == policy_mask.sizes(), "masked_gae: rewards sizes ",
              rewards.defined() ? rewards.sizes() : torch::IntArrayRef{}, " differ from the mask's ", policy_mask.sizes());
  UNIRL_CHECK(values.defined() && values.sizes() == policy_mask.sizes(), "masked_gae: values sizes ",
              values.defined() ? values.sizes() : torch::IntArrayRef{}, " differ from the mask's ", policy_mask.sizes());
  UNIRL_CHECK(gamma >= 0.0 && gamma <= 1.0, "masked_gae: gamma = ", gamma, ": expected in [0, 1]");
  UNIRL_CHECK(lambda >= 0.0 && lambda <= 1.0, "masked_gae: lambda = ", lambda, ": expected in [0, 1]");
  const auto host = [](const torch::Tensor& x) { return x.to(torch::kCPU, torch::kDouble).contiguous(); };
  const auto r = host(rewards), v = host(values), m = host(policy_mask);
  const auto B = m.size(0), T = m.size(1);
  auto adv = torch::zeros({B, T}, torch::kDouble), ret = torch::zeros({B, T}, torch::kDouble);
  const double *pr = r.data_ptr<double>(), *pv = v.data_ptr<double>(), *pm = m.data_ptr<double>();
  double *pa = adv.data_ptr<double>(), *pg = ret.data_ptr<double>();
  for (std::int64_t b = 0; b < B; ++b) {
    double next_v = 0.0, last = 0.0;
    for (std::int64_t t = T - 1; t >= 0; --t) {
      const auto i = b * T + t;
      if (pm[i] == 0.0) {
        UNIRL_CHECK(pr[i] == 0.0, "masked_gae: row ", b, " has reward ", pr[i], " at position ", t,
                    ", which is not a policy token; expected rewards on policy tokens only");
        continue;
      }
      const double delta = pr[i] + gamma * next_v - pv[i];
      last = delta + gamma * lambda * last;
      pa[i] = last;
      pg[i] = last + pv[i];
      next_v = pv[i];
    }
  }
  return {adv, ret};
}

/// Options of `episode_ppo`: PPO's own (`algo::ppo_options`: clip, value clip, vf / entropy /
/// KL coefficients, gamma, lambda, advantage whitening, loss aggregation), the temperature the
/// episodes were sampled at, the optimizer (policy and critic together) and the update schedule.
struct episode_ppo_options {
  algo::ppo_options algorithm{.ent_coef = 0.0, .gamma = 1.0, .lambda = 0.95};
  double temperature = 1.0;         // the rollout's sampling temperature (the log-probs are taken at it)
  train::optimizer_options optim{.lr = 1e-3};
  train::clip_options clip{.max_grad_norm = 1.0};
  std::int64_t epochs = 1;          // passes over the episodes per step
  std::int64_t minibatches = 1;     // per pass (whole episodes each)

  void validate(const std::string& p) const {
    options::require(temperature > 0.0, p + "temperature", temperature, "> 0 (the log-probs are taken at it)");
    options::require(epochs >= 1, p + "epochs", epochs, ">= 1");
    options::require(minibatches >= 1, p + "minibatches", minibatches, ">= 1");
  }
};

}  // namespace unirl::agents

BOOST_HANA_ADAPT_STRUCT(unirl::agents::episode_ppo_options, algorithm, temperature, optim, clip, epochs, minibatches);

namespace unirl::agents {

/// PPO over episodes (see the file comment) for the policy `model` (trained in place) and the
/// critic it makes (`make_critic()`, trained with it by one optimizer); a `reference` (same
/// architecture) is needed when `algorithm.kl_coef > 0`.
template <CausalLM M>
  requires CriticFactory<M>
class episode_ppo {
 public:
  using options = episode_ppo_options;
  using critic_type = decltype(std::declval<const M&>().make_critic());
  static_assert(TokenCritic<critic_type>, "episode_ppo: make_critic() of the policy must give a unirl::TokenCritic");

  episode_ppo(M& model, options o, const M* reference = nullptr)
      : model_(model), o_((unirl::options::validate(o), o)), ref_(reference), critic_(model.make_critic()),
        optim_(parameters_of(model, critic_), o_.optim) {
    UNIRL_CHECK(o_.algorithm.kl_coef == 0.0 || ref_ != nullptr, "episode_ppo: algorithm.kl_coef = ",
                o_.algorithm.kl_coef, " needs a reference model; pass one or set kl_coef = 0");
  }

  const options& opts() const { return o_; }
  critic_type& critic() { return critic_; }
  train::optimizer& optimizer() { return optim_; }

  /// What the update needs of a batch, computed once per step without gradients: pi_old at the
  /// update's geometry, the critic's values, the reference's log-probs (KL), the token rewards
  /// and GAE over the policy tokens. (B, L-1) each.
  struct targets {
    torch::Tensor old_logp, values, ref_logp, rewards, advantages, returns;
  };

  /// The targets of `b` (the layout of `episodes`).
  targets prepare(const episode_batch& b, const std::vector<trajectory>& episodes) const {
    torch::NoGradGuard ng;
    const auto& a = o_.algorithm;
    targets t;
    const auto pm = b.policy_mask;
    t.old_logp = episode_logprob(model_, b, o_.temperature, false).first;
    const auto dev = t.old_logp.device();
    const auto pmd = pm.to(dev, t.old_logp.scalar_type());
    t.old_logp = t.old_logp * pmd;
    t.values = values(b) * pmd.to(dev);
    t.rewards = turn_token_rewards(episodes, b.ids.size(1));
    // The values (and the KL of a KL-in-reward) come to the host in one read: GAE is a
    // sequential pass over each row.
    torch::Tensor host_values;
    if (ref_ != nullptr && a.kl_coef > 0.0) {
      t.ref_logp = episode_logprob(*ref_, b, o_.temperature, false).first * pmd;
      if (a.kl_in_reward) {
        const auto kl = algo::kl_penalty(t.old_logp, t.ref_logp, a.kl) * pmd;
        const auto both = to_host_tensor(torch::stack({t.values.to(kl.scalar_type()), kl}));
        host_values = both[0];
        t.rewards = t.rewards - a.kl_coef * both[1];
      }
    }
    if (!host_values.defined()) host_values = to_host_tensor(t.values);
    auto g = masked_gae(t.rewards, host_values, pm, a.gamma, a.lambda);
    t.advantages = g.advantages.to(dev, t.values.scalar_type());
    t.returns = g.returns.to(dev, t.values.scalar_type());
    return t;
  }

  /// The critic's values of `b`: V before each token t+1, (B, L-1), with gradients when enabled.
  torch::Tensor values(const episode_batch& b) const {
    torch::Device dev = b.ids.device();
    if constexpr (requires { { model_.device() } -> std::convertible_to<torch::Device>; }) dev = model_.device();
    const auto L = b.ids.size(1);
    return critic_.values(b.ids.to(dev).slice(1, 0, L - 1), b.mask.to(dev).slice(1, 0, L - 1));
  }

  /// The PPO evaluation of minibatch `b` with its rows `t` of the targets: differentiable
  /// log-probs, entropies and values, masked by the policy mask.
  algo::ppo_eval evaluate(const episode_batch& b, const targets& t) const {
    algo::ppo_eval ev;
    std::tie(ev.logp, ev.entropy) = episode_logprob(model_, b, o_.temperature, true);
    const auto dev = ev.logp.device();
    const auto dt = ev.logp.scalar_type();
    ev.mask = b.policy_mask.to(dev, dt);
    ev.old_logp = t.old_logp.to(dev, dt);
    ev.advantages = t.advantages.to(dev, dt);
    ev.values = values(b);
    ev.old_values = t.values.to(ev.values.device(), ev.values.scalar_type());
    ev.returns = t.returns.to(ev.values.device(), ev.values.scalar_type());
    if (t.ref_logp.defined()) ev.ref_logp = t.ref_logp.to(dev, dt);
    ev.max_len = std::max<std::int64_t>(1, ev.mask.size(1));
    return ev;
  }

  /// The loss of one evaluated minibatch (`algo::ppo_loss`).
  loss_terms loss(const algo::ppo_eval& ev) const { return algo::ppo_loss(o_.algorithm, ev); }

  /// One step on `episodes`: targets, then `epochs` x `minibatches` updates of the policy and
  /// the critic. Returns the figures (means over the updates; value_mean / return_mean /
  /// advantage_mean over the policy tokens).
  std::map<std::string, double> step(const std::vector<trajectory>& episodes, std::int64_t pad_id) {
    const auto all = make_episode_batch(episodes, pad_id);
    const auto B = all.size();
    model_.train(true);
    critic_.train(true);
    const auto tg = prepare(all, episodes);
    std::map<std::string, double> s;
    std::vector<torch::Tensor> params = model_.parameters();
    for (const auto& p : critic_.parameters()) params.push_back(p);
    const auto rows = [](const torch::Tensor& x, const torch::Tensor& idx) {
      return x.defined() ? x.index_select(0, idx.to(x.device())) : x;
    };
    const auto pm = all.policy_mask.to(tg.values.device(), tg.values.scalar_type());
    const auto n = pm.sum().clamp_min(1.0);
    const auto tail = detail::run_episode_updates(
        optim_, params, o_.clip.max_grad_norm, o_.epochs, o_.minibatches, B, 1,
        [&](const torch::Tensor& idx) {
          const targets t{rows(tg.old_logp, idx),   rows(tg.values, idx),     rows(tg.ref_logp, idx),
                          rows(tg.rewards, idx),    rows(tg.advantages, idx), rows(tg.returns, idx)};
          return loss(evaluate(detail::select_episodes(all, idx), t));
        },
        {all.rewards.mean(), all.policy_mask.sum(), (tg.values * pm).sum() / n, (tg.returns * pm).sum() / n,
         (tg.advantages * pm).sum() / n},
        {"loss", "policy_loss", "value_loss", "kl", "entropy", "ratio_mean", "clip_fraction"}, s);
    s["reward_mean"] = tail[0];
    s["policy_tokens"] = tail[1];
    s["value_mean"] = tail[2];
    s["return_mean"] = tail[3];
    s["advantage_mean"] = tail[4];
    model_.train(false);
    critic_.train(false);
    return s;
  }

 private:
  static named_tensors parameters_of(const M& model, const critic_type& critic) {
    named_tensors all = model.named_parameters();
    for (auto& [n, t] : critic.named_parameters()) all.emplace_back("critic." + n, t);
    return all;
  }
  // A tensor's values on the host as a float64 CPU tensor, through `to_host` (a counted read).
  static torch::Tensor to_host_tensor(const torch::Tensor& x) {
    const auto sizes = x.sizes().vec();
    return torch::tensor(to_host(x), torch::kDouble).view(sizes);
  }

  M& model_;
  options o_;
  const M* ref_;
  critic_type critic_;
  train::optimizer optim_;
};

}  // namespace unirl::agents
