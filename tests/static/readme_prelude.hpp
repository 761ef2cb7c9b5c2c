// The user types README.md's "A trainer is a type" snippet assumes: a model adapter and two
// scorers, written with the headers a user's own model and scorers need — none of them brings
// the trainer, GRPO or the reward composer, which the snippet's own includes must provide.
#pragma once
#include <vector>

#include <torch/torch.h>

#include <unirl/models/gpt.hpp>
#include <unirl/rollout/token.hpp>

using my_model = unirl::models::gpt;

struct exact_answer {
  torch::Tensor operator()(const unirl::token_rollout& b) const { return torch::zeros({b.size()}); }
};

struct format_ok {
  torch::Tensor operator()(const unirl::token_rollout& b) const { return torch::ones({b.size()}); }
};
