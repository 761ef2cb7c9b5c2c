#pragma once
/// \file token.hpp
/// Everything the token track (causal LMs) needs, with the trainer: GRPO and its family, PPO on
/// the token track, the outcome advantage estimators, the built-in GPT and the TorchScript
/// adapter, the KV-cache sampler, the rollout batch and its log-prob / packing helpers.
///
/// ```cpp
/// #include <unirl/token.hpp>
/// #include <unirl/rewards.hpp>
/// unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, my_reward> t{model, reward,
///     {.algorithm = {.sampling = {.max_new_tokens = 16}}, .group_size = 8}};
/// auto stats = t.step(unirl::prompt_batch{.tokens = {{1, 2, 3}}});
/// ```
#include <unirl/trainer.hpp>

#include <unirl/algorithms/estimators.hpp>
#include <unirl/algorithms/grpo.hpp>
#include <unirl/algorithms/ppo_token.hpp>
#include <unirl/algorithms/token_common.hpp>
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/models/char_tokenizer.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/models/torchscript_lm.hpp>
#include <unirl/rollout/packing.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_logprob.hpp>
#include <unirl/rollout/token_sampler.hpp>
