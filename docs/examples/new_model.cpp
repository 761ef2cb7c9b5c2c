// docs/extending.md, "A new model adapter": a bigram language model (the next token depends on
// the current one only) as a CausalLM of the token track, trained for one GRPO step.
#include <cstdint>
#include <iostream>

#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/models/module_adapter.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/trainer.hpp>

// The network: one row of next-token logits per token.
struct bigram_netImpl : torch::nn::Cloneable<bigram_netImpl> {
  explicit bigram_netImpl(std::int64_t vocab = 8) : vocab(vocab) { reset(); }
  void reset() override { table = register_module("table", torch::nn::Embedding(vocab, vocab)); }
  std::int64_t vocab;
  torch::nn::Embedding table{nullptr};
};
TORCH_MODULE(bigram_net);

// The adapter. module_adapter supplies parameters, named_parameters / _buffers, clone, train and
// to (TrainableModule); the adapter names its track and adds what CausalLM asks for.
struct bigram_lm : unirl::models::module_adapter<bigram_lm, bigram_net> {
  using track = unirl::token_track;  // its rollouts are unirl::token_rollout
  struct cache_type {};              // a bigram needs nothing of the past: an empty KV cache
  using module_adapter::module_adapter;

  // ids (B, L) int64, mask (B, L) float -> (B, L, V): the logits at position i predict token i+1.
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& /*mask*/) const {
    return bigram_net(net())->table->forward(ids);  // a copy of the holder shares the module
  }
  cache_type make_cache(std::int64_t /*batch*/, std::int64_t /*capacity*/) const { return {}; }
  // The next n tokens after those the cache holds: the rows `logits` gives over the whole sequence.
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, cache_type&) const {
    return logits(ids, mask);
  }
  std::int64_t vocab_size() const { return net()->vocab; }
};
static_assert(unirl::CausalLM<bigram_lm>);

// A reward for the step: how many of the generated tokens are token 1.
struct count_ones {
  torch::Tensor operator()(const unirl::token_rollout& b) const {
    return ((b.completion_ids == 1).to(torch::kFloat) * b.completion_mask).sum(1);
  }
};

int main() {
  torch::manual_seed(0);
  unirl::trainer<bigram_lm, unirl::algo::grpo<>, count_ones> t{
      bigram_lm(bigram_net(8)), count_ones{},
      {.algorithm = {.sampling = {.max_new_tokens = 4}}, .group_size = 4, .progress = false}};
  const unirl::prompt_batch prompts{.tokens = {{2, 3}, {4}}};
  const auto stats = t.step(prompts);  // 2 prompts x 4 completions
  std::cout << "bigram: " << stats.samples << " completions, reward " << stats.reward_mean << "\n";
  return stats.samples == 8 ? 0 : 1;
}
