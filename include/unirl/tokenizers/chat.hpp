#pragma once
/// \file chat.hpp
/// Chat prompts in the formats instruction-tuned models were trained on, without a Jinja engine:
///
/// | format    | output                                                                                  |
/// |-----------|-----------------------------------------------------------------------------------------|
/// | `chatml`  | `<\|im_start\|>{role}\n{content}<\|im_end\|>\n` per message; prompt `<\|im_start\|>assistant\n`. No default system message: what Qwen3's template renders for system / user / earlier assistant turns |
/// | `qwen2_5` | `chatml`, preceded by Qwen2.5's default system message ("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.") when the first message is not a system one: what Qwen2.5's template renders without tools |
/// | `llama3`  | `<\|begin_of_text\|>` (when there are messages) then `<\|start_header_id\|>{role}<\|end_header_id\|>\n\n{content, trimmed}<\|eot_id\|>` per message; prompt `<\|start_header_id\|>assistant<\|end_header_id\|>\n\n` (Llama-3's template) |
/// | `plain`   | `{Role}: {content}\n\n` per message (role capitalised); prompt `Assistant:`                  |
///
/// Tool turns (multi-turn agents, agents/): a message of role `tool` is a tool's reply. In
/// `chatml` / `qwen2_5` it renders as Qwen2.5's (Hermes) template does — consecutive replies in
/// one user turn, each `\n<tool_response>\n{content}\n</tool_response>` —, in `llama3` as Llama
/// 3.1's `ipython` role (`<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>`; a
/// message of role `ipython` renders the same), in `plain` as `Tool: {content}\n\n`. An
/// assistant's tool call is its content as the model wrote it (`<tool_call>\n{"name": ...,
/// "arguments": {...}}\n</tool_call>`, `tool_call_text`). With `tools` (one JSON object each,
/// `{"type": "function", "function": {"name", "description", "parameters"}}`), `chatml` /
/// `qwen2_5` open with Qwen3's / Qwen2.5's system message listing them in `<tools></tools>` (Jinja's
/// `tojson`, `to_json_text`: Python's separators; object keys in nlohmann's sorted order, where
/// Jinja keeps the given order). `render_continuation` is the text between an assistant turn and
/// the next generation prompt, so a trajectory appends exactly what the whole conversation's
/// rendering holds there.
///
/// ```cpp
/// using namespace unirl::tokenizers;
/// auto text = apply_chat_template(chat_format::chatml, {{"user", "2+2?"}});
/// // "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
/// auto ids = tok.encode(text);   // <|im_start|> / <|im_end|> become their special ids
/// ```
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/tokenizers/unicode.hpp>

namespace unirl::tokenizers {

struct chat_message {
  std::string role, content;
};

enum class chat_format : std::uint8_t { chatml, qwen2_5, llama3, plain };

/// Qwen2.5's default system message.
inline constexpr std::string_view qwen2_5_default_system =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

namespace detail {
/// Jinja's `trim` (Python's str.strip()): leading and trailing white space removed.
inline std::string trim_space(std::string_view s) {
  auto is_space_at = [&](std::size_t i, std::size_t& len) {
    std::uint32_t cp = 0;
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    len = unicode::decode_utf8(p + i, p + s.size(), cp);
    return unicode::is_space(cp);
  };
  std::size_t b = 0, len = 0;
  while (b < s.size() && is_space_at(b, len)) b += len;
  std::size_t e = s.size();
  while (e > b) {
    std::size_t k = e - 1;
    while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    if (!is_space_at(k, len) || k + len != e) break;
    e = k;
  }
  return std::string(s.substr(b, e - b));
}
}  // namespace detail

/// Jinja's `tojson` of `j` (Python's `json.dumps(j, ensure_ascii=False)`): `", "` and `": "`
/// separators, non-ASCII text kept (invalid UTF-8 replaced by U+FFFD), object keys in `j`'s
/// order (sorted, for `nlohmann::json`).
inline std::string to_json_text(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : j.items()) {
        if (!first) out += ", ";
        first = false;
        out += nlohmann::json(k).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        out += ": " + to_json_text(v);
      }
      return out + "}";
    }
    case nlohmann::json::value_t::array: {
      std::string out = "[";
      for (std::size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + to_json_text(j[i]);
      return out + "]";
    }
    default: return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
}

/// A tool call as Qwen2.5's template renders it in an assistant turn (and as a policy is taught
/// to write it): `<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>`.
inline std::string tool_call_text(const std::string& name, const nlohmann::json& arguments) {
  return "<tool_call>\n{\"name\": " + to_json_text(nlohmann::json(name)) + ", \"arguments\": " +
         to_json_text(arguments) + "}\n</tool_call>";
}

namespace detail {
// Qwen's system block with tools: `system` then a blank line, or the tools alone when `system` is empty.
inline std::string qwen_tools_system(const std::string& system, const std::vector<nlohmann::json>& tools) {
  std::string out = "<|im_start|>system\n" + (system.empty() ? std::string() : system + "\n\n") +
                    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                    "provided with function signatures within <tools></tools> XML tags:\n<tools>";
  for (const auto& t : tools) out += "\n" + to_json_text(t);
  out += "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
         "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
         "<args-json-object>}\n</tool_call><|im_end|>\n";
  return out;
}
inline bool is_tool_role(const std::string& role) { return role == "tool" || role == "ipython"; }

// The messages [begin, end) of `m` without the format's opening (system block, <|begin_of_text|>).
inline std::string render_messages(chat_format f, const std::vector<chat_message>& m, std::size_t begin) {
  std::string out;
  for (std::size_t i = begin; i < m.size(); ++i) {
    const auto& msg = m[i];
    switch (f) {
      case chat_format::qwen2_5:
      case chat_format::chatml:
        if (is_tool_role(msg.role)) {
          if (i == begin || !is_tool_role(m[i - 1].role)) out += "<|im_start|>user";
          out += "\n<tool_response>\n" + msg.content + "\n</tool_response>";
          if (i + 1 == m.size() || !is_tool_role(m[i + 1].role)) out += "<|im_end|>\n";
        } else {
          out += "<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n";
        }
        break;
      case chat_format::llama3:
        out += "<|start_header_id|>" + (is_tool_role(msg.role) ? std::string("ipython") : msg.role) +
               "<|end_header_id|>\n\n" + detail::trim_space(msg.content) + "<|eot_id|>";
        break;
      case chat_format::plain: {
        std::string role = msg.role;
        if (!role.empty() && role[0] >= 'a' && role[0] <= 'z') role[0] = static_cast<char>(role[0] - 'a' + 'A');
        out += role + ": " + msg.content + "\n\n";
        break;
      }
    }
  }
  return out;
}
inline std::string generation_prompt(chat_format f) {
  switch (f) {
    case chat_format::qwen2_5:
    case chat_format::chatml: return "<|im_start|>assistant\n";
    case chat_format::llama3: return "<|start_header_id|>assistant<|end_header_id|>\n\n";
    case chat_format::plain: return "Assistant:";
  }
  return {};
}
}  // namespace detail

/// The prompt text of `messages` in format `f`; with `add_generation_prompt` it ends where the
/// assistant's reply starts. `tools` (JSON objects, see the file comment) are listed in the
/// system message of `chatml` / `qwen2_5` (the other formats take none: an error).
inline std::string apply_chat_template(chat_format f, const std::vector<chat_message>& messages,
                                       bool add_generation_prompt = true,
                                       const std::vector<nlohmann::json>& tools = {}) {
  std::string out;
  std::size_t begin = 0;
  switch (f) {
    case chat_format::qwen2_5:
    case chat_format::chatml:
      if (!tools.empty()) {
        const bool own = !messages.empty() && messages.front().role == "system";
        // Qwen2.5 falls back to its default system message; Qwen3's (chatml) lists the tools alone.
        const std::string fallback = f == chat_format::qwen2_5 ? std::string(qwen2_5_default_system) : std::string();
        out += detail::qwen_tools_system(own ? messages.front().content : fallback, tools);
        begin = own ? 1 : 0;
      } else if (f == chat_format::qwen2_5 && (messages.empty() || messages.front().role != "system")) {
        out += "<|im_start|>system\n" + std::string(qwen2_5_default_system) + "<|im_end|>\n";
      }
      break;
    case chat_format::llama3:
      if (!messages.empty()) out += "<|begin_of_text|>";
      break;
    case chat_format::plain: break;
  }
  if (!tools.empty() && f != chat_format::chatml && f != chat_format::qwen2_5)
    throw std::invalid_argument("apply_chat_template: tools are listed by the chatml and qwen2_5 formats only; "
                                "expected no tools for this format");
  out += detail::render_messages(f, messages, begin);
  if (add_generation_prompt) out += detail::generation_prompt(f);
  return out;
}

/// What ends an assistant turn in format `f` (`<|im_end|>`, `<|eot_id|>`, `"\n\n"`): the stop
/// string of a multi-turn rollout, and the text `render_continuation` starts with.
inline std::string assistant_turn_end(chat_format f) {
  switch (f) {
    case chat_format::qwen2_5:
    case chat_format::chatml: return "<|im_end|>\n";
    case chat_format::llama3: return "<|eot_id|>";
    case chat_format::plain: return "\n\n";
  }
  return {};
}

/// The text that follows an assistant turn's content up to the next generation prompt, with
/// `next` (tool replies, a user message) in between: what `apply_chat_template` renders there
/// for the whole conversation. A multi-turn rollout tokenizes it once and appends it.
/// ```cpp
/// render_continuation(chat_format::qwen2_5, {{"tool", "42"}});
/// // "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
/// ```
inline std::string render_continuation(chat_format f, const std::vector<chat_message>& next,
                                       bool add_generation_prompt = true) {
  std::string out = assistant_turn_end(f) + detail::render_messages(f, next, 0);
  if (add_generation_prompt) out += detail::generation_prompt(f);
  return out;
}

/// The format a Jinja chat template (tokenizer_config.json's `chat_template`) renders, judged by
/// its markers: Qwen2.5's default system message -> qwen2_5, `<|im_start|>` -> chatml,
/// `<|start_header_id|>` -> llama3; nullopt otherwise.
inline std::optional<chat_format> guess_chat_format(std::string_view jinja) {
  if (jinja.find("<|im_start|>") != std::string_view::npos)
    return jinja.find("You are Qwen, created by Alibaba Cloud") != std::string_view::npos ? chat_format::qwen2_5
                                                                                         : chat_format::chatml;
  if (jinja.find("<|start_header_id|>") != std::string_view::npos) return chat_format::llama3;
  return std::nullopt;
}

}  // namespace unirl::tokenizers
