// PPO trains exactly the tracks whose ppo_track specialisation is visible: naming ppo<> with a
// token model without <unirl/algorithms/ppo_token.hpp> (or <unirl/token.hpp>) is an error that
// says which specialisation is missing and which header provides it — never a silent "false".
#include <unirl/algorithms/ppo.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/trainer.hpp>
#if !defined(UNIRL_FAILTEST_KO)
#include <unirl/algorithms/ppo_token.hpp>
#endif

struct unit_reward {
  torch::Tensor operator()(const unirl::token_rollout& b) const { return torch::ones({b.size()}); }
};

template class unirl::trainer<unirl::models::gpt, unirl::algo::ppo<>, unit_reward>;
