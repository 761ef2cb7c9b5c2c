// libFuzzer target: tool calls in text a model wrote (agents/tool_call.hpp: find_tool_calls,
// parse_tool_call, check_arguments) and the chat template's rendering of a call
// (tokenizers/chat.hpp: tool_call_text, to_json_text). Torch-free.
//   bash scripts/fuzz.sh tool_call 60
// Input: the text. When it holds a byte 0x01, the part before it is also read as a JSON schema
// (when it parses) that every parsed call's arguments are checked against.
// Findings: an exception, a crash, undefined behaviour, a leak, or a broken invariant:
//  - every found call is parsed or carries a fault with its reason (never both), in text order,
//    at most max_calls + 1 of them;
//  - a parsed call keeps the limits (its arguments nest no deeper than max_depth);
//  - a parsed call rendered by the template (tool_call_text) is found and parsed back to the same
//    name and arguments;
//  - check_arguments answers for any schema and any arguments (a reason or "").
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>
#include <unirl/agents/tool_call.hpp>
#include <unirl/tokenizers/chat.hpp>

namespace {
namespace ua = unirl::agents;

#define check(ok)                                                                              \
  do {                                                                                         \
    if (!(ok)) {                                                                               \
      std::fprintf(stderr, "fuzz_tool_call: invariant failed, line %d: %s\n", __LINE__, #ok); \
      std::abort();                                                                            \
    }                                                                                          \
  } while (0)

std::size_t depth_of(const nlohmann::json& j) {
  std::size_t d = 0;
  if (j.is_structured())
    for (const auto& x : j) d = std::max(d, depth_of(x));
  return j.is_structured() ? d + 1 : 0;
}

const nlohmann::json fixed_schema = {
    {"type", "object"},
    {"properties",
     {{"expression", {{"type", "string"}, {"maxLength", 64}}},
      {"n", {{"type", "integer"}, {"minimum", 0}, {"maximum", 100}}},
      {"xs", {{"type", "array"}, {"items", {{"type", {"number", "null"}}}}}},
      {"mode", {{"enum", {"a", "b"}}}}}},
    {"required", {"expression"}},
    {"additionalProperties", false}};

void run(std::string_view text, const ua::tool_call_limits& lim, const nlohmann::json* schema) {
  const auto calls = ua::find_tool_calls(text, lim);
  check(calls.size() <= lim.max_calls + 1);
  std::size_t last = 0;
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const auto& c = calls[i];
    check(c.ok() == c.error.empty());
    check(c.ok() == (c.fault == ua::tool_fault::none));
    check(c.position < text.size() && (i == 0 || c.position > last));
    last = c.position;
    if (!c.ok()) continue;
    check(c.call->arguments.is_object());
    check(depth_of(c.call->arguments) <= lim.max_depth);
    (void)ua::check_arguments(fixed_schema, c.call->arguments);
    if (schema != nullptr) (void)ua::check_arguments(*schema, c.call->arguments);
    const auto again = ua::find_tool_calls(unirl::tokenizers::tool_call_text(c.call->name, c.call->arguments),
                                           {.max_call_bytes = 1 << 20, .max_depth = lim.max_depth + 2});
    check(again.size() == 1 && again[0].ok());
    check(again[0].call->name == c.call->name && again[0].call->arguments == c.call->arguments);
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  nlohmann::json schema;
  const nlohmann::json* sp = nullptr;
  if (const auto cut = text.find('\x01'); cut != std::string_view::npos) {
    const auto part = text.substr(0, cut);
    if (unirl::agents::detail::json_depth(part, 24) <= 24) {
      schema = nlohmann::json::parse(part.begin(), part.end(), nullptr, false);
      if (!schema.is_discarded()) sp = &schema;
    }
  }
  run(text, {}, sp);
  run(text, {.max_call_bytes = 48, .max_depth = 2, .max_calls = 1}, sp);
  return 0;
}
