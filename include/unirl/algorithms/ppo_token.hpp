#pragma once
/// \file ppo_token.hpp
/// PPO on the token track: `ppo_track<token_track>` — completions from the KV-cache sampler, a
/// token-level critic (`make_critic()` of the model), outcome reward on each completion's last
/// token (minus `kl_coef` x KL per token when `kl_in_reward`), GAE along the completion.
/// Its own options (`ppo_token_options`, under `.algorithm.track`): `sampling`, and `layout` —
/// `packed` packs the update forward without padding (the policy, and the critic when it has
/// `values_packed`); losses and gradients equal the padded path.
///
/// ```cpp
/// #include <unirl/algorithms/ppo_token.hpp>
/// unirl::trainer<unirl::models::gpt, unirl::algo::ppo<>, my_reward> t{model, reward,
///     {.algorithm = {.ent_coef = 0.0, .gamma = 1.0, .lambda = 0.95,
///                    .track = {.sampling = {.max_new_tokens = 8}}}}};
/// ```
#include <cstdint>
#include <string>
#include <tuple>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/algorithms/kl.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/algorithms/token_common.hpp>
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/packing.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_logprob.hpp>

namespace unirl::algo {

namespace detail {
// V(prefix before completion token t) for every t: (B, T), from the critic's full forward.
template <class Critic>
torch::Tensor completion_values(const Critic& critic, const token_rollout& b) {
  const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1);
  const auto ids = b.full_ids(), mask = b.full_mask();
  return critic.values(ids.slice(1, 0, P + T - 1), mask.slice(1, 0, P + T - 1)).slice(1, P - 1, P + T - 1);
}
// The same values through sequence packing when the critic supports it (`layout = packed`), else padded.
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

/// The token track's own options of `ppo`, under `.algorithm.track`.
struct ppo_token_options {
  sampling_options sampling{};                            // how completions are drawn
  rollout::update_layout layout = rollout::update_layout::padded;  // update forward: padded, packed, shared_prompt
};

}  // namespace unirl::algo

BOOST_HANA_ADAPT_STRUCT(unirl::algo::ppo_token_options, sampling, layout);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::algo::ppo_token_options>{
    unirl::options::field_doc{"sampling", "sampling options (set through the sampling.* keys in a recipe)"},
    unirl::options::field_doc{"layout", "layout of the update forward: padded, packed or shared_prompt"}};

namespace unirl::algo {

/// PPO's token-track stages (see `ppo.hpp` for the shared loss).
template <>
struct ppo_track<token_track> {
  using options = ppo_token_options;
  using settings = basic_ppo_options<options>;

  /// The sampling settings against the model, and prompts against its context (the trainer's checks).
  template <class M>
  static void check_model(const settings& o, const M& model, const std::string& key) {
    check_sampling_against_model(o.track.sampling, model, key + "track.sampling.");
  }
  template <class M>
  static void check_input(const settings& o, const M& model, const prompt_batch& in, const std::string& key) {
    check_prompt_lengths(o.track.sampling, model, in, key + "track.sampling.");
  }

  template <ExecutionPolicy Exec, CausalLM M>
  static token_rollout sample(const settings& o, model_set<M>& models, const prompt_batch& input,
                              const step_info& info) {
    static_assert(CriticFactory<M>, "ppo on the token track needs a model with make_critic() (a TokenCritic)");
    token_rollout b = sample_for_update<Exec>(models, input, info, o.track.sampling, /*recompute_old_logp=*/true,
                                              o.track.layout);
    UNIRL_CHECK(models.critic.has_value(), "ppo: the trainer built no critic for this model");
    torch::NoGradGuard ng;
    b.values = detail::completion_values(*models.critic, b) * b.completion_mask;
    return b;
  }

  /// Token rewards (outcome on the last token, -kl_coef * KL per token when `kl_in_reward`), then
  /// GAE along each completion; fills `advantages` and `returns`. Returns per-sample advantages
  /// at the first token (B,).
  template <ExecutionPolicy Exec, CausalLM M>
  static torch::Tensor advantage(const settings& o, model_set<M>&, token_rollout& b, const torch::Tensor& rewards,
                                 const step_info& info) {
    const auto mask = b.completion_mask;
    torch::Tensor kl;
    if (o.kl_in_reward && o.kl_coef > 0.0 && b.ref_logp.defined()) {
      kl = kl_penalty<Exec>(b.old_logp, b.ref_logp, o.kl);
      info.report("kl_reward", (kl * mask).sum(1).mean());
    }
    // The free functions of advantage.hpp: token rewards, then GAE along each completion.
    const auto dtype = b.values.is_floating_point() ? b.values.scalar_type() : torch::kFloat;
    const auto tok = token_level_rewards(rewards.to(mask.device(), dtype), mask, kl, o.kl_coef);
    auto g = token_gae<Exec>(tok, b.values, mask, o.gamma, o.lambda);
    b.advantages = std::move(g.advantages);
    b.returns = std::move(g.returns);
    return b.advantages.select(1, 0);
  }

  template <ExecutionPolicy Exec, CausalLM M>
  static ppo_eval evaluate(const settings& o, model_set<M>& models, const token_rollout& minibatch,
                           const step_info&) {
    const token_rollout mb = minibatch.trimmed();  // dynamic padding
    UNIRL_CHECK(mb.advantages.defined() && mb.returns.defined(), "ppo: the minibatch has no advantages/returns");
    ppo_eval ev;
    std::tie(ev.logp, ev.entropy) =
        rollout::update_logprob<Exec>(models.policy, mb, o.track.sampling.temperature, true, o.track.layout);
    ev.old_logp = mb.old_logp;
    ev.advantages = mb.advantages;
    ev.mask = mb.completion_mask;
    ev.values = detail::update_values(*models.critic, mb, o.track.layout == rollout::update_layout::packed);
    ev.old_values = mb.values;
    ev.returns = mb.returns;
    ev.ref_logp = mb.ref_logp;
    ev.max_len = o.track.sampling.max_new_tokens;
    return ev;
  }
};

static_assert(Algorithm<ppo<>::for_track<token_track>>);
static_assert(ppo<>::for_track<token_track>::supports_track<token_track>);

}  // namespace unirl::algo
