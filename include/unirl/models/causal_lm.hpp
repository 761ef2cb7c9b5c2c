#pragma once
/// \file causal_lm.hpp
/// Forwarding header: what used to live here now sits in its layer.
/// - `CausalLM`, `PackedCausalLM`, `PrefixSharingCausalLM`, `TokenCritic`, `PackedTokenCritic`:
///   `concepts/causal_lm.hpp`;
/// - `token_logprob`, `completion_logprob`, `update_logprob`, `update_layout`, ...:
///   `rollout/token_logprob.hpp` (namespace `unirl::rollout`, also reachable as `unirl::models::`);
/// - `pack_rollout`, `packed_rollout`, `find_distinct_prompts`, `distinct_prompts`:
///   `rollout/packing.hpp` (likewise).
///
/// ```cpp
/// auto logits = model.logits(ids, mask);                          // (B, L, V)
/// auto [logp, ent] = unirl::models::token_logprob(logits, targets);  // (B, L) each
/// ```
/// New code includes the header it needs; a model adapter only `concepts/causal_lm.hpp`.
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/rollout/packing.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_logprob.hpp>
