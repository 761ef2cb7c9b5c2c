#pragma once
/// \file demonstration.hpp
/// A demonstration conversation as a `trajectory`, laid out exactly as `run_episodes` lays out
/// an episode of the same turns: the chat template's prompt up to the first assistant message
/// (with the tools' definitions for ChatML / Qwen2.5), then per assistant message its content and
/// the format's end-of-turn marker as the policy's tokens (trained), and the messages between two
/// assistant messages (tool replies, user turns, observations) as `render_continuation` renders
/// them (context, attended, never trained). The supervised stage of a multi-turn run trains on
/// these (`sft_batch_of`, `train::sft_loss`), so it imitates the very token layout RL samples.
///
/// ```cpp
/// auto t = unirl::agents::demonstration_trajectory(
///     unirl::tokenizers::chat_format::chatml,
///     {{"user", "What is 347*58?"}, {"assistant", "<tool_call>...</tool_call>"}, {"tool", "20126"},
///      {"assistant", "20126"}},
///     encode, tools.definitions());
/// ```
/// Messages after the last assistant message are not part of it (nothing would be trained on
/// them). Every segment is encoded once; nothing is decoded.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/agents/rollout.hpp>
#include <unirl/agents/trajectory.hpp>
#include <unirl/core/error.hpp>
#include <unirl/tokenizers/chat.hpp>

namespace unirl::agents {

/// The roles a demonstration may hold.
inline bool demonstration_role(const std::string& role) {
  return role == "system" || role == "user" || role == "assistant" || role == "tool" || role == "ipython";
}

/// The text of an assistant message as a policy turn: what the template renders for it after the
/// generation prompt, up to the end marker the model writes (`content<|im_end|>` in ChatML,
/// `" content\n\n"` in `plain`, whose template puts a space after "Assistant:").
inline std::string assistant_turn_text(tokenizers::chat_format f, const std::string& content) {
  const auto full = tokenizers::detail::render_messages(f, {{"assistant", content}}, 0);
  const auto prompt = tokenizers::detail::generation_prompt(f);
  const auto end = tokenizers::assistant_turn_end(f);
  UNIRL_CHECK(full.size() >= prompt.size() + end.size() && full.compare(0, prompt.size(), prompt) == 0 &&
                  full.compare(full.size() - end.size(), end.size(), end) == 0,
              "demonstration: the template's assistant message does not start with its generation prompt and end "
              "with its end marker");
  return full.substr(prompt.size(), full.size() - prompt.size() - end.size()) + detail::turn_stop(f);
}

/// `messages` as a trajectory (see the file comment). `system`, when not empty and the
/// conversation has no system message of its own, is put first (as `agent_options::system`).
/// Throws `std::invalid_argument` naming the message for an unknown role, a system message after
/// the first one, or a conversation without an assistant message or with nothing before it.
inline trajectory demonstration_trajectory(tokenizers::chat_format f,
                                           const std::vector<tokenizers::chat_message>& messages,
                                           const token_encoder& encode, const std::vector<nlohmann::json>& tools = {},
                                           const std::string& system = {}) {
  auto fail = [](const std::string& why) { throw std::invalid_argument("demonstration: " + why); };
  std::size_t first = messages.size();
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& role = messages[i].role;
    if (!demonstration_role(role))
      fail("message " + std::to_string(i) + " has role '" + role +
           "'; expected system, user, assistant, tool or ipython");
    if (role == "system" && i > 0) fail("message " + std::to_string(i) + " is a system message; expected it first only");
    if (role == "assistant" && first == messages.size()) first = i;
  }
  if (first == messages.size()) fail("no assistant message; expected at least one (the turns that are trained)");
  if (first == 0 || (first == 1 && messages[0].role == "system"))
    fail("the first assistant message (" + std::to_string(first) +
         ") has no user or tool message before it; expected the task first");
  std::vector<tokenizers::chat_message> prompt(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(first));
  if (!system.empty() && prompt.front().role != "system") prompt.insert(prompt.begin(), {"system", system});
  const auto stop_text = detail::turn_stop(f);
  trajectory t;
  t.append_context(encode(tokenizers::apply_chat_template(f, prompt, true, tools)));
  std::size_t i = first;
  while (i < messages.size()) {
    const auto said = assistant_turn_text(f, messages[i].content);
    const auto ids = encode(said);
    t.append_policy(ids, std::vector<double>(ids.size(), 0.0));
    t.end_turn(0.0, said);
    std::size_t j = i + 1;
    std::vector<tokenizers::chat_message> between;
    while (j < messages.size() && messages[j].role != "assistant") between.push_back(messages[j++]);
    if (j == messages.size()) break;  // nothing after the last assistant message is trained
    // What the rollout appends after a turn that wrote the end marker: the continuation less it.
    t.append_context(encode(tokenizers::render_continuation(f, between).substr(stop_text.size())));
    i = j;
  }
  return t;
}

}  // namespace unirl::agents
