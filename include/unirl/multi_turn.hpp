#pragma once
/// \file multi_turn.hpp
/// Multi-turn language agents (docs/agents.md): the text-environment and tool concepts, the
/// tool-call parser, toolboxes composed at compile time, trajectories with a policy mask,
/// multi-turn rollouts on the rollout engine (tools run while other sequences decode), GRPO
/// over episodes and PPO with GAE over the policy tokens. (The env track's PPO agent is `agent.hpp`.)
///
/// ```cpp
/// #include <unirl/multi_turn.hpp>
/// unirl::agents::toolbox<calculator> tools{{.timeout_seconds = 1.0}};
/// auto out = unirl::agents::run_episodes(model, env, seeds, /*group=*/8, tools, text, {.max_turns = 3});
/// unirl::agents::episode_grpo<unirl::models::gpt> learner{model, {.optim = {.lr = 1e-3}}};
/// auto stats = learner.step(out.episodes, 8, pad_id);
/// ```
#include <unirl/agents/builtin.hpp>
#include <unirl/agents/demonstration.hpp>
#include <unirl/agents/episode_grpo.hpp>
#include <unirl/agents/episode_ppo.hpp>
#include <unirl/agents/image_observation.hpp>
#include <unirl/agents/rollout.hpp>
#include <unirl/agents/tool_call.hpp>
#include <unirl/agents/toolbox.hpp>
#include <unirl/agents/trajectory.hpp>
#include <unirl/concepts/text_agent.hpp>
