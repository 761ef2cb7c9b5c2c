// A token-track model must model CausalLM; one without the KV-cache member `make_cache` is told
// which member of which concept it lacks, at the trainer's declaration.
#include <unirl/algorithms/grpo.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/trainer.hpp>

struct cacheless_gpt : unirl::models::gpt {
  explicit cacheless_gpt(unirl::models::gpt g) : unirl::models::gpt(std::move(g)) {}
#if defined(UNIRL_FAILTEST_KO)
  void make_cache() const = delete;  // hides the KV-cache member
#endif
  cacheless_gpt clone() const { return cacheless_gpt(unirl::models::gpt::clone()); }
};

struct ones_reward {
  torch::Tensor operator()(const unirl::token_rollout& b) const { return torch::ones({b.size()}); }
};

template class unirl::trainer<cacheless_gpt, unirl::algo::grpo<>, ones_reward>;
