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
/// ```cpp
/// using namespace unirl::tokenizers;
/// auto text = apply_chat_template(chat_format::chatml, {{"user", "2+2?"}});
/// // "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
/// auto ids = tok.encode(text);   // <|im_start|> / <|im_end|> become their special ids
/// ```
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

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

/// The prompt text of `messages` in format `f`; with `add_generation_prompt` it ends where the
/// assistant's reply starts.
inline std::string apply_chat_template(chat_format f, const std::vector<chat_message>& messages,
                                       bool add_generation_prompt = true) {
  std::string out;
  switch (f) {
    case chat_format::qwen2_5:
      if (messages.empty() || messages.front().role != "system")
        out += "<|im_start|>system\n" + std::string(qwen2_5_default_system) + "<|im_end|>\n";
      [[fallthrough]];
    case chat_format::chatml:
      for (const auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case chat_format::llama3:
      if (!messages.empty()) out += "<|begin_of_text|>";
      for (const auto& m : messages)
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + detail::trim_space(m.content) + "<|eot_id|>";
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case chat_format::plain:
      for (const auto& m : messages) {
        std::string role = m.role;
        if (!role.empty() && role[0] >= 'a' && role[0] <= 'z') role[0] = static_cast<char>(role[0] - 'a' + 'A');
        out += role + ": " + m.content + "\n\n";
      }
      if (add_generation_prompt) out += "Assistant:";
      break;
  }
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
