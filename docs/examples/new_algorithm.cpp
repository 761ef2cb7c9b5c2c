// docs/extending.md, "A new algorithm": REINFORCE with a group-mean baseline on the token track,
// for any CausalLM, trained for one step with the built-in GPT.
#include <cstdint>
#include <iostream>
#include <string>
#include <type_traits>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_logprob.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/trainer.hpp>

// Run-time settings: a reflectable aggregate (printed, loaded from recipes, validated).
struct group_reinforce_options {
  double ent_coef = 0.0;              // entropy bonus
  unirl::sampling_options sampling{}; // how completions are drawn

  void validate(const std::string& prefix) const {
    unirl::options::require(ent_coef >= 0.0, prefix + "ent_coef", ent_coef, ">= 0");
  }
};
BOOST_HANA_ADAPT_STRUCT(group_reinforce_options, ent_coef, sampling);

class group_reinforce {
 public:
  using options = group_reinforce_options;
  // What the trainer must build or allow.
  static constexpr bool requires_reference = false;
  static constexpr bool requires_critic = false;
  static constexpr bool requires_ema_rollout = false;
  static constexpr bool requires_group = true;         // the baseline is the group's mean
  static constexpr bool supports_multi_update = false; // no importance ratio: strictly on-policy
  template <class Track>
  static constexpr bool supports_track = std::is_same_v<Track, unirl::token_track>;

  explicit group_reinforce(const options& o = {}) : o_(o) { unirl::options::validate(o_); }

  // sample: group_size completions per prompt, without gradients.
  template <unirl::CausalLM M>
  unirl::token_rollout sample(unirl::model_set<M>& models, const unirl::prompt_batch& prompts,
                              const unirl::step_info& info) {
    torch::NoGradGuard no_grad;
    return unirl::sample_tokens(models.policy, prompts, info.group_size, o_.sampling, info.device);
  }

  // advantage: each sample's reward minus its group's mean, on every token it generated.
  template <unirl::CausalLM M>
  torch::Tensor advantage(unirl::model_set<M>&, unirl::token_rollout& batch, const torch::Tensor& rewards,
                          const unirl::step_info& info) {
    const auto r = rewards.to(batch.completion_mask.device(), torch::kFloat).view({-1, info.group_size});
    const auto a = (r - r.mean(1, /*keepdim=*/true)).reshape({-1});  // (B,)
    batch.advantages = a.unsqueeze(1) * batch.completion_mask;        // (B, T)
    return a;
  }

  // loss: -A log pi over the generated tokens, minus the entropy bonus.
  template <unirl::CausalLM M>
  unirl::loss_terms loss(unirl::model_set<M>& models, const unirl::token_rollout& minibatch, const unirl::step_info&) {
    const auto mb = minibatch.trimmed();  // dynamic padding
    const auto [logp, entropy] = unirl::rollout::completion_logprob(models.policy, mb, o_.sampling.temperature);
    const auto mask = mb.completion_mask;
    const auto tokens = mask.sum().clamp_min(1.0);
    const auto policy = -(mb.advantages * logp * mask).sum() / tokens;
    const auto mean_entropy = (entropy * mask).sum() / tokens;
    unirl::loss_terms t;
    t.total = policy - o_.ent_coef * mean_entropy;  // carries the graph
    t.policy = policy.detach();                     // figures for the step statistics, read
    t.entropy = mean_entropy.detach();              // by the trainer once per step
    return t;
  }

 private:
  options o_;
};
static_assert(unirl::Algorithm<group_reinforce>);
static_assert(unirl::AlgorithmFor<group_reinforce, unirl::models::gpt>);

// A reward for the step: the share of generated tokens equal to 1.
struct share_of_ones {
  torch::Tensor operator()(const unirl::token_rollout& b) const {
    return ((b.completion_ids == 1).to(torch::kFloat) * b.completion_mask).sum(1) /
           b.completion_mask.sum(1).clamp_min(1.0);
  }
};

int main() {
  torch::manual_seed(0);
  unirl::models::gpt model({.vocab_size = 8, .max_len = 16, .n_layer = 1, .n_head = 2, .d_model = 16});
  unirl::trainer<unirl::models::gpt, group_reinforce, share_of_ones> t{
      model, share_of_ones{}, {.algorithm = {.sampling = {.max_new_tokens = 4}}, .group_size = 4, .progress = false}};
  const auto stats = t.step(unirl::prompt_batch{.tokens = {{2, 3}, {4}}});
  std::cout << "group_reinforce: " << stats.samples << " completions, policy loss " << stats.policy_loss << "\n";
  return stats.samples == 8 ? 0 : 1;
}
