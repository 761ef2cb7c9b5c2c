#pragma once
// A complete user-defined track, written only against unirl's public concepts: a contextual
// bandit in which a policy looks at a real 8x8 digit and answers with a label. The reward is 1
// for the right label. It is the smallest thing that exercises the whole loop — sample, reward,
// group advantage, clipped policy update, sync — and it is what docs/design.md walks through
// under "Adding a track". The foundation example and the trainer tests compose it.
#include <cstdint>
#include <string>

#include <torch/torch.h>

#include <unirl/algorithms/estimators.hpp>
#include <unirl/concepts/algorithm.hpp>
#include <unirl/concepts/model.hpp>
#include <unirl/concepts/reward.hpp>
#include <unirl/concepts/rollout.hpp>
#include <unirl/core/context.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/stats.hpp>
#include <unirl/models/module_adapter.hpp>

namespace bandit {

/// What the sample stage produces: one answer per (context, group member).
struct rollout {
  torch::Tensor contexts;    // (B*G, 64) float
  torch::Tensor labels;      // (B*G,)    int64, the right answers
  torch::Tensor actions;     // (B*G,)    int64, the sampled answers
  torch::Tensor old_logp;    // (B*G,)    float, log pi_old(action | context)
  torch::Tensor advantages;  // (B*G,)    float, filled by the advantage stage

  std::int64_t size() const { return actions.size(0); }
  rollout select(const torch::Tensor& i) const {
    auto pick = [&](const torch::Tensor& t) { return t.defined() ? t.index_select(0, i) : t; };
    return {pick(contexts), pick(labels), pick(actions), pick(old_logp), pick(advantages)};
  }
};
static_assert(unirl::RolloutBatch<rollout>);

/// The track tag: names the rollout batch of every model of this track.
struct track {
  using rollout_type = rollout;
};

/// The input of one step: a batch of contexts with their labels.
struct prompts {
  torch::Tensor contexts;  // (B, 64)
  torch::Tensor labels;    // (B,)
};

struct policy_netImpl : torch::nn::Cloneable<policy_netImpl> {
  explicit policy_netImpl(std::int64_t hidden = 64) : hidden_(hidden) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(64, hidden_));
    fc2 = register_module("fc2", torch::nn::Linear(hidden_, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  std::int64_t hidden_;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(policy_net);

/// The model adapter: `module_adapter` supplies parameters, clone, train, to.
struct model : unirl::models::module_adapter<model, policy_net> {
  using track = bandit::track;
  using module_adapter::module_adapter;
  torch::Tensor log_probs(const torch::Tensor& contexts) { return torch::log_softmax(net()->forward(contexts), -1); }
};
static_assert(unirl::ModelAdapter<model>);

/// Clipped policy gradient with group-normalised advantages (a one-token GRPO).
struct policy_gradient {
  struct options {
    double clip = 0.2;
    double adv_eps = 1e-6;
    void validate(const std::string& p) const {
      unirl::options::require(clip > 0, p + "clip", clip, "> 0");
    }
  };
  static constexpr bool requires_reference = false;
  static constexpr bool requires_critic = false;
  static constexpr bool requires_ema_rollout = false;
  static constexpr bool requires_group = true;
  static constexpr bool supports_multi_update = true;
  template <class Track>
  static constexpr bool supports_track = std::is_same_v<Track, bandit::track>;

  explicit policy_gradient(const options& o) : opts_(o) {}

  template <class M>
  rollout sample(unirl::model_set<M>& ms, const prompts& in, const unirl::step_info& info) {
    const torch::Tensor ctx = in.contexts.repeat_interleave(info.group_size, 0).to(info.device);
    const torch::Tensor lab = in.labels.repeat_interleave(info.group_size, 0).to(info.device);
    const torch::Tensor logp = ms.policy.log_probs(ctx);
    const torch::Tensor act = torch::multinomial(logp.exp(), 1).squeeze(1);
    return {ctx, lab, act, logp.gather(1, act.unsqueeze(1)).squeeze(1), {}};
  }

  template <class M>
  torch::Tensor advantage(unirl::model_set<M>&, rollout& b, const torch::Tensor& r, const unirl::step_info& info) {
    b.advantages = unirl::algo::group_normalized{{.eps = opts_.adv_eps}}(r, info.group_size);
    return b.advantages;
  }

  template <class M>
  unirl::loss_terms loss(unirl::model_set<M>& ms, const rollout& b, const unirl::step_info&) {
    const torch::Tensor logp = ms.policy.log_probs(b.contexts);
    const torch::Tensor lp = logp.gather(1, b.actions.unsqueeze(1)).squeeze(1);
    const torch::Tensor ratio = (lp - b.old_logp).exp();
    const torch::Tensor clipped = ratio.clamp(1 - opts_.clip, 1 + opts_.clip);
    const torch::Tensor loss = torch::max(-b.advantages * ratio, -b.advantages * clipped).mean();
    const torch::Tensor entropy = -(logp.exp() * logp).sum(-1).mean();
    unirl::loss_terms t;
    t.total = loss;
    t.policy = loss.item<double>();
    t.entropy = entropy.item<double>();
    t.ratio_mean = ratio.mean().item<double>();
    t.clip_fraction = ((ratio - 1).abs() > opts_.clip).to(torch::kFloat64).mean().item<double>();
    return t;
  }

 private:
  options opts_;
};

/// 1 for the right label, 0 otherwise.
struct correct_label {
  torch::Tensor operator()(const rollout& b) const { return (b.actions == b.labels).to(torch::kFloat32); }
};
static_assert(unirl::RewardFor<correct_label, rollout>);

}  // namespace bandit

BOOST_HANA_ADAPT_STRUCT(bandit::policy_gradient::options, clip, adv_eps);
static_assert(unirl::AlgorithmFor<bandit::policy_gradient, bandit::model>);
static_assert(unirl::SamplesFrom<bandit::policy_gradient, bandit::model, const bandit::prompts>);
