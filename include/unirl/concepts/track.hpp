#pragma once
/// \file track.hpp
/// Track tags: what a model adapter declares as `using track = ...;`. A tag names the rollout
/// batch its samplers fill; the batches themselves are defined in `rollout/` (`token.hpp`,
/// `flow.hpp`, `env.hpp`). Only their names are needed here, so a concept or a model adapter
/// can name its track without including a sampler or a batch.
///
/// ```cpp
/// struct my_lm {
///   using track = unirl::token_track;   // rollouts are unirl::token_rollout
///   // ... the CausalLM members (concepts/causal_lm.hpp)
/// };
/// ```
/// A new track is a tag of the same shape, `struct my_track { using rollout_type = my_batch; };`,
/// with `my_batch` a `RolloutBatch` (concepts/rollout.hpp).

namespace unirl {

struct token_rollout;  // rollout/token.hpp
struct env_rollout;    // rollout/env.hpp

/// Track tag of causal language models (and VLMs): rollouts are `token_rollout`.
struct token_track {
  using rollout_type = token_rollout;
};

/// Track tag of agents stepping an environment; its batch is `env_rollout`.
struct env_track {
  using rollout_type = env_rollout;
};

struct flow_rollout;  // rollout/flow.hpp

/// Track tag of image / video diffusion and flow-matching models: rollouts are `flow_rollout`.
struct flow_track {
  using rollout_type = flow_rollout;
};

}  // namespace unirl
