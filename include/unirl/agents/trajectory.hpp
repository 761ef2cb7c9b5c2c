#pragma once
/// \file trajectory.hpp
/// One multi-turn episode as one token sequence: the policy's tokens exactly as sampled (with
/// their behaviour log-probs), and everything else — the prompt, tool replies, the environment's
/// observations, the chat template's turn markers — tokenized once and appended. A mask says
/// which is which: policy tokens are trained, the others are attended and never trained.
/// Nothing is decoded and encoded again (a decode of the policy's turn is only read: by the
/// tool-call parser and the environment).
///
/// ```cpp
/// unirl::agents::trajectory t;
/// t.append_context(tok.encode(prompt_text));        // prompt: attended, not trained
/// t.append_policy(result.tokens, result.logp);       // a turn, as the engine sampled it
/// t.end_turn(0.0);
/// t.append_context(tok.encode(tool_reply_text));    // tokenized once
/// ```
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/error.hpp>

namespace unirl::agents {

/// Turns text into token ids (a tokenizer's encode), for the non-policy parts of a trajectory.
using token_encoder = std::function<std::vector<std::int64_t>(const std::string&)>;

/// Why an episode ended.
enum class episode_end { running, done, stop_token, max_turns, max_tokens };

inline const char* end_name(episode_end e) {
  switch (e) {
    case episode_end::running: return "running";
    case episode_end::done: return "done";
    case episode_end::stop_token: return "stop_token";
    case episode_end::max_turns: return "max_turns";
    case episode_end::max_tokens: return "max_tokens";
  }
  return "?";
}

/// One episode's token sequence with its policy mask (see the file comment).
struct trajectory {
  std::vector<std::int64_t> tokens;     // the whole sequence
  std::vector<std::uint8_t> policy;     // per token: 1 = sampled by the policy (trained)
  std::vector<double> logp;             // per token: behaviour log-prob of a policy token, 0 elsewhere
  std::vector<double> turn_rewards;     // one per policy turn
  std::vector<std::int64_t> turn_ends;  // per policy turn: one past its last token
  std::vector<std::string> turn_texts;  // per policy turn: its text as decoded (read, never re-encoded)
  std::vector<torch::Tensor> logits;    // per policy turn (tokens, V), when the rollout keeps logits
  std::int64_t prompt_tokens = 0;       // tokens of the first context segment
  std::int64_t tool_calls = 0;          // calls the policy wrote (faulty ones included)
  std::int64_t context_segments = 0;    // segments appended by `append_context` (each tokenized once)
  double reward = 0.0;                  // sum of the turn rewards
  episode_end end = episode_end::running;
  std::int64_t task = 0;                // index of its task in the rollout (a group shares it)

  std::int64_t size() const { return static_cast<std::int64_t>(tokens.size()); }
  std::int64_t turns() const { return static_cast<std::int64_t>(turn_ends.size()); }
  std::int64_t policy_tokens() const {
    std::int64_t n = 0;
    for (const auto p : policy) n += p;
    return n;
  }

  /// Appends tokens the policy sampled, with their behaviour log-probs (one each).
  void append_policy(const std::vector<std::int64_t>& ids, const std::vector<double>& lp) {
    UNIRL_CHECK(ids.size() == lp.size(), "trajectory::append_policy: ", ids.size(), " tokens and ", lp.size(),
                " log-probs; expected one log-prob per token");
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    policy.insert(policy.end(), ids.size(), std::uint8_t{1});
    logp.insert(logp.end(), lp.begin(), lp.end());
  }
  /// Appends tokens the policy did not sample (prompt, tool replies, observations, markers).
  void append_context(const std::vector<std::int64_t>& ids) {
    if (tokens.empty()) prompt_tokens = static_cast<std::int64_t>(ids.size());
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    policy.insert(policy.end(), ids.size(), std::uint8_t{0});
    logp.insert(logp.end(), ids.size(), 0.0);
    ++context_segments;
  }
  /// Closes a policy turn with its reward.
  void end_turn(double r, std::string text = {}) {
    turn_ends.push_back(size());
    turn_rewards.push_back(r);
    turn_texts.push_back(std::move(text));
    reward += r;
  }
};

}  // namespace unirl::agents
