// docs/extending.md, "A new reward": two scorers — one generic over any batch with completion
// texts, one reading a token-track tensor — composed with a built-in one into a weighted reward,
// scored on a batch and then used by a trainer for one step.
#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/concepts/reward.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/scorer.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/trainer.hpp>

// Generic over the batch: any batch with `completions` (HasCompletions) — token rollouts, a
// reward service's batches, a test's plain struct.
struct mentions {
  static constexpr std::string_view name = "mentions";  // the component's name in the statistics
  std::string word = "please";

  template <unirl::HasCompletions B>
  torch::Tensor operator()(const B& b) const {
    const auto& texts = unirl::rewards::completions_of(b, "mentions");  // one text per sample, checked
    std::vector<float> r;
    for (const auto& t : texts) r.push_back(t.find(word) != std::string::npos ? 1.0f : 0.0f);
    return unirl::rewards::to_scores(r);  // (B,) float
  }
};
static_assert(unirl::ScorerFor<mentions, unirl::token_rollout>);

// Reads a tensor of the token track: 1 for an empty completion, 0 for one of full length.
struct brevity {
  static constexpr std::string_view name = "brevity";
  torch::Tensor operator()(const unirl::token_rollout& b) const {
    return 1.0 - b.lengths().to(torch::kFloat) / static_cast<double>(b.completion_mask.size(1));
  }
};
static_assert(unirl::ScorerFor<brevity, unirl::token_rollout>);

using reward_t = unirl::rewards::weighted<unirl::rewards::exact_answer, mentions, brevity>;

reward_t make_reward() {
  return reward_t{{.weights = {1.0, 0.5, 0.1}},
                  unirl::rewards::exact_answer({.extract = R"((\d+))"}), mentions{}, brevity{}};
}

int main() {
  // A batch as the sampler leaves it: token ids and masks, decoded completions, references.
  unirl::token_rollout b;
  b.completion_ids = torch::tensor({5, 6, 0, 0, 7, 0, 0, 0}, torch::kInt64).view({2, 4});
  b.completion_mask = torch::tensor({1.f, 1.f, 0.f, 0.f, 1.f, 0.f, 0.f, 0.f}).view({2, 4});
  b.completions = {"42, please", "41"};
  b.references = {"42", "42"};
  auto reward = make_reward();
  const torch::Tensor r = reward(b);  // (2,): 1 * exact + 0.5 * mentions + 0.1 * brevity
  // Sample 0: 1 + 0.5 * 1 + 0.1 * (1 - 2/4) = 1.55; sample 1: 0 + 0 + 0.1 * (1 - 1/4) = 0.075.
  if (std::abs(r[0].item<double>() - 1.55) > 1e-6 || std::abs(r[1].item<double>() - 0.075) > 1e-6) return 1;
  for (const auto& [k, v] : reward.last_components()) std::cout << k << " = " << v << "\n";

  // In a trainer: the sampler decodes completions with the prompt batch's decoder.
  torch::manual_seed(0);
  unirl::models::gpt model({.vocab_size = 10, .max_len = 16, .n_layer = 1, .n_head = 2, .d_model = 16});
  unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, reward_t> t{
      model, make_reward(), {.algorithm = {.sampling = {.max_new_tokens = 3}}, .group_size = 4, .progress = false}};
  const unirl::prompt_batch prompts{
      .tokens = {{4, 2}, {1}},
      .references = {"42", "1"},
      .decode = [](const std::vector<std::int64_t>& ids) {
        std::string s;
        for (auto id : ids) s += static_cast<char>('0' + id);  // token i is the digit i
        return s;
      }};
  const auto stats = t.step(prompts);
  std::cout << "weighted reward: mean " << stats.reward_mean << " over " << stats.samples << " samples\n";
  return stats.samples == 8 ? 0 : 1;
}
