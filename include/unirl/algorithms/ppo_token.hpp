#pragma once
/// \file ppo_token.hpp
/// PPO on the token track: `ppo_track<token_track>` — completions from the KV-cache sampler, a
/// token-level critic (`make_critic()` of the model), outcome reward on each completion's last
/// token (minus `kl_coef` x KL per token when `kl_in_reward`), GAE along the completion.
/// `pack_sequences` packs the update forward without padding (the policy, and the critic when it
/// has `values_packed`); losses and gradients equal the padded path.
///
/// ```cpp
/// #include <unirl/algorithms/ppo_token.hpp>
/// unirl::trainer<unirl::models::gpt, unirl::algo::ppo<>, my_reward> t{model, reward,
///     {.algorithm = {.ent_coef = 0.0, .gamma = 1.0, .lambda = 0.95, .sampling = {.max_new_tokens = 8}}}};
/// ```
#include <cstdint>
#include <tuple>

#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/algorithms/kl.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/algorithms/token_common.hpp>
#include <unirl/core/context.hpp>
#include <unirl/models/causal_lm.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::algo {

namespace detail {
// V(prefix before completion token t) for every t: (B, T), from the critic's full forward.
template <class Critic>
torch::Tensor completion_values(const Critic& critic, const token_rollout& b) {
  const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1);
  const auto ids = b.full_ids(), mask = b.full_mask();
  return critic.values(ids.slice(1, 0, P + T - 1), mask.slice(1, 0, P + T - 1)).slice(1, P - 1, P + T - 1);
}
// The same values through sequence packing when the critic supports it (`pack_sequences`), else padded.
template <class Critic>
torch::Tensor update_values(const Critic& critic, const token_rollout& b, bool pack) {
  if constexpr (PackedTokenCritic<Critic>) {
    if (pack) {
      const auto p = models::pack_rollout(b);
      return p.unpack(p.predictors(critic.values_packed(p.ids, p.positions, p.segments)));
    }
  }
  return completion_values(critic, b);
}
}  // namespace detail

/// PPO's token-track stages (see `ppo.hpp` for the shared loss).
template <>
struct ppo_track<token_track> {
  static models::update_layout layout(const ppo_options& o) {
    return o.pack_sequences ? models::update_layout::packed : models::update_layout::padded;
  }

  template <CausalLM M>
  static token_rollout sample(const ppo_options& o, model_set<M>& models, const prompt_batch& input,
                              const step_info& info) {
    static_assert(CriticFactory<M>, "ppo on the token track needs a model with make_critic() (a TokenCritic)");
    token_rollout b = sample_for_update(models, input, info, o.sampling, /*recompute_old_logp=*/true, layout(o));
    UNIRL_CHECK(models.critic.has_value(), "ppo: the trainer built no critic for this model");
    torch::NoGradGuard ng;
    b.values = detail::completion_values(*models.critic, b) * b.completion_mask;
    return b;
  }

  /// Token rewards (outcome on the last token, -kl_coef * KL per token when `kl_in_reward`), then
  /// GAE along each completion; fills `advantages` and `returns`. Returns per-sample advantages
  /// at the first token (B,).
  template <CausalLM M>
  static torch::Tensor advantage(const ppo_options& o, model_set<M>&, token_rollout& b, const torch::Tensor& rewards,
                                 const step_info& info) {
    const auto mask = b.completion_mask;
    const auto B = mask.size(0);
    auto tok = torch::zeros_like(mask);
    if (o.kl_in_reward && o.kl_coef > 0.0 && b.ref_logp.defined()) {
      const torch::Tensor kl = kl_penalty(b.old_logp, b.ref_logp, o.kl) * mask;
      info.report("kl_reward", (kl.sum(1)).mean().item<double>());
      tok = tok - o.kl_coef * kl;
    }
    const auto last = (b.lengths() - 1).clamp_min(0);
    tok = tok.scatter_add(1, last.unsqueeze(1), rewards.to(tok.device(), tok.scalar_type()).unsqueeze(1));
    // Positions after a completion's end start "new episodes": no bootstrapping across them.
    auto dones = (1.0 - mask).t().contiguous();  // (T, B)
    const auto g = gae(tok.t(), b.values.t(), dones, torch::zeros({B}, tok.options()), torch::ones({B}, tok.options()),
                       o.gamma, o.lambda);
    b.advantages = g.advantages.t().contiguous() * mask;
    b.returns = g.returns.t().contiguous() * mask;
    return b.advantages.select(1, 0);
  }

  template <CausalLM M>
  static ppo_eval evaluate(const ppo_options& o, model_set<M>& models, const token_rollout& minibatch,
                           const step_info&) {
    const token_rollout mb = minibatch.trimmed();  // dynamic padding
    UNIRL_CHECK(mb.advantages.defined() && mb.returns.defined(), "ppo: the minibatch has no advantages/returns");
    ppo_eval ev;
    std::tie(ev.logp, ev.entropy) =
        models::update_logprob(models.policy, mb, o.sampling.temperature, true, layout(o));
    ev.old_logp = mb.old_logp;
    ev.advantages = mb.advantages;
    ev.mask = mb.completion_mask;
    ev.values = detail::update_values(*models.critic, mb, o.pack_sequences);
    ev.old_values = mb.values;
    ev.returns = mb.returns;
    ev.ref_logp = mb.ref_logp;
    return ev;
  }
};

static_assert(ppo<>::supports_track<token_track>);

}  // namespace unirl::algo
