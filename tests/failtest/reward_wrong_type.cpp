// A reward must return torch::Tensor (one score per sample); one returning a float is rejected
// at the trainer's declaration with a message naming RewardFor.
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"

struct float_reward {
#if defined(UNIRL_FAILTEST_KO)
  float operator()(const bandit::rollout&) const { return 1.0f; }
#else
  torch::Tensor operator()(const bandit::rollout& b) const { return torch::ones({b.size()}); }
#endif
};

using composed = unirl::trainer<bandit::model, bandit::policy_gradient, float_reward>;
template class unirl::trainer<bandit::model, bandit::policy_gradient, float_reward>;
