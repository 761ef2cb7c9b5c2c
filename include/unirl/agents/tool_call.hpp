#pragma once
/// \file tool_call.hpp
/// Tool calls in the text a model wrote, in the Qwen2.5 / Hermes form
/// `<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>`
/// (Llama 3.1's `"parameters"` is read as `"arguments"`), and the check of their arguments
/// against a tool's JSON schema. Torch-free (the fuzz target tests/fuzz/fuzz_tool_call.cpp builds
/// it with libFuzzer); agents/toolbox.hpp runs the calls.
///
/// ```cpp
/// auto calls = unirl::agents::find_tool_calls(text);
/// for (const auto& c : calls)
///   if (c.ok()) run(c.call->name, c.call->arguments);   // parsed
///   else reply(c.error);                                  // "malformed JSON at byte 12 of the call: ..."
/// auto why = unirl::agents::check_arguments(schema, args);  // "" when they fit, else the reason
/// ```
///
/// The text is untrusted: a call longer than `max_call_bytes`, JSON nested deeper than
/// `max_depth`, malformed JSON, a call without a string `"name"` or an object `"arguments"`, an
/// unterminated `<tool_call>` and more than `max_calls` calls are each a fault with its reason —
/// never an exception, a crash or unbounded work (time linear in the text; the depth is checked
/// before the JSON parser, which recurses, sees it).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace unirl::agents {

/// What went wrong with one tool call (or `none`). The statistics count each kind.
enum class tool_fault { none, malformed, too_large, unknown_tool, bad_arguments, threw, timed_out };

/// The fault's name in the statistics (`tool/malformed`, ...).
inline const char* fault_name(tool_fault f) {
  switch (f) {
    case tool_fault::none: return "ok";
    case tool_fault::malformed: return "malformed";
    case tool_fault::too_large: return "too_large";
    case tool_fault::unknown_tool: return "unknown_tool";
    case tool_fault::bad_arguments: return "bad_arguments";
    case tool_fault::threw: return "threw";
    case tool_fault::timed_out: return "timed_out";
  }
  return "?";
}

/// One parsed call.
struct tool_call {
  std::string name;
  nlohmann::json arguments = nlohmann::json::object();
};

/// A call found in the text: parsed, or the fault and its reason.
struct tool_call_parse {
  std::optional<agents::tool_call> call;
  tool_fault fault = tool_fault::none;
  std::string error;          // empty when parsed
  std::size_t position = 0;   // byte offset of the call's `<tool_call>` in the text

  bool ok() const { return call.has_value(); }
  explicit operator bool() const { return ok(); }
};

/// What the parser accepts.
struct tool_call_limits {
  std::size_t max_call_bytes = 4096;  // bytes between <tool_call> and </tool_call>
  std::size_t max_depth = 16;         // nesting of JSON arrays and objects
  std::size_t max_calls = 4;          // calls in one turn; further ones are one `too_large` fault
};

inline constexpr std::string_view tool_call_open = "<tool_call>";
inline constexpr std::string_view tool_call_close = "</tool_call>";

namespace detail {
// The deepest nesting of arrays / objects in `s`, outside strings; stops counting past `limit`.
inline std::size_t json_depth(std::string_view s, std::size_t limit) {
  std::size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : s) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
      if (deepest > limit) return deepest;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}
inline std::string shorten(std::string_view s, std::size_t n = 40) {
  std::string out;
  for (const char c : s.substr(0, n)) out += (static_cast<unsigned char>(c) < 0x20 || c == '\x7f') ? ' ' : c;
  return s.size() > n ? out + "..." : out;
}
}  // namespace detail

/// Parses the body of one call (the text between `<tool_call>` and `</tool_call>`).
inline tool_call_parse parse_tool_call(std::string_view body, const tool_call_limits& lim = {}) {
  tool_call_parse r;
  auto fail = [&](tool_fault f, std::string why) {
    r.fault = f;
    r.error = std::move(why);
    return r;
  };
  if (body.size() > lim.max_call_bytes)
    return fail(tool_fault::too_large, "the tool call has " + std::to_string(body.size()) + " bytes; at most " +
                                           std::to_string(lim.max_call_bytes) + " are accepted");
  if (detail::json_depth(body, lim.max_depth) > lim.max_depth)
    return fail(tool_fault::too_large,
                "the tool call's JSON is nested deeper than " + std::to_string(lim.max_depth) + " levels");
  const auto j = nlohmann::json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return fail(tool_fault::malformed, "the tool call is not valid JSON: \"" + detail::shorten(body) +
                                           "\"; expected {\"name\": ..., \"arguments\": {...}}");
  if (!j.is_object()) return fail(tool_fault::malformed, "the tool call is JSON but not an object; expected "
                                                         "{\"name\": ..., \"arguments\": {...}}");
  const auto name = j.find("name");
  if (name == j.end() || !name->is_string())
    return fail(tool_fault::malformed, "the tool call has no string \"name\"; expected {\"name\": ..., \"arguments\": {...}}");
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");  // Llama 3.1's spelling
  tool_call c;
  c.name = name->get<std::string>();
  if (args != j.end()) {
    if (!args->is_object())
      return fail(tool_fault::bad_arguments, "the arguments of '" + detail::shorten(c.name) + "' are " +
                                                 std::string(args->type_name()) + "; expected an object");
    c.arguments = *args;
  }
  r.call = std::move(c);
  return r;
}

/// Every `<tool_call>...</tool_call>` in `text`, in order; an unterminated one is a `malformed`
/// fault, and the calls past `max_calls` are one `too_large` fault.
inline std::vector<tool_call_parse> find_tool_calls(std::string_view text, const tool_call_limits& lim = {}) {
  std::vector<tool_call_parse> out;
  std::size_t at = 0;
  while ((at = text.find(tool_call_open, at)) != std::string_view::npos) {
    if (out.size() == lim.max_calls) {
      tool_call_parse r;
      r.fault = tool_fault::too_large;
      r.error = "more than " + std::to_string(lim.max_calls) + " tool calls in one turn; the rest are ignored";
      r.position = at;
      out.push_back(std::move(r));
      break;
    }
    const auto body = at + tool_call_open.size();
    const auto end = text.find(tool_call_close, body);
    tool_call_parse r;
    if (end == std::string_view::npos) {
      r.fault = tool_fault::malformed;
      r.error = "a <tool_call> at byte " + std::to_string(at) + " has no </tool_call>";
      r.position = at;
      out.push_back(std::move(r));
      break;
    }
    r = parse_tool_call(text.substr(body, end - body), lim);
    r.position = at;
    out.push_back(std::move(r));
    at = end + tool_call_close.size();
  }
  return out;
}

namespace detail {
inline bool is_type(const nlohmann::json& v, const std::string& t) {
  if (t == "string") return v.is_string();
  if (t == "integer") {  // JSON Schema: any whole number, 3.0 included
    if (v.is_number_integer()) return true;
    if (!v.is_number_float()) return false;
    const double x = v.get<double>();
    return std::isfinite(x) && std::floor(x) == x;
  }
  if (t == "number") return v.is_number();
  if (t == "boolean") return v.is_boolean();
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  if (t == "null") return v.is_null();
  return false;
}
inline std::string value_text(const nlohmann::json& v) {
  return shorten(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}
inline std::string check_value(const nlohmann::json& schema, const nlohmann::json& v, const std::string& path,
                               std::size_t depth) {
  if (depth > 32) return path + ": the schema is nested deeper than 32 levels";
  if (!schema.is_object()) return {};  // `true` / absent: anything
  if (const auto t = schema.find("type"); t != schema.end()) {
    bool fits = false;
    std::string want;
    if (t->is_string()) {
      want = t->get<std::string>();
      fits = is_type(v, want);
    } else if (t->is_array()) {
      for (const auto& x : *t)
        if (x.is_string()) {
          want += (want.empty() ? "" : " or ") + x.get<std::string>();
          fits = fits || is_type(v, x.get<std::string>());
        }
    } else {
      fits = true;
    }
    if (!fits) return path + " = " + value_text(v) + ": expected " + want;
  }
  if (const auto e = schema.find("enum"); e != schema.end() && e->is_array()) {
    bool found = false;
    for (const auto& x : *e) found = found || x == v;
    if (!found) return path + " = " + value_text(v) + ": expected one of " + value_text(*e);
  }
  if (v.is_string()) {
    const auto n = static_cast<std::int64_t>(v.get_ref<const std::string&>().size());
    if (const auto m = schema.find("maxLength"); m != schema.end() && m->is_number_integer() && n > m->get<std::int64_t>())
      return path + " has " + std::to_string(n) + " bytes: expected at most " + value_text(*m);
    if (const auto m = schema.find("minLength"); m != schema.end() && m->is_number_integer() && n < m->get<std::int64_t>())
      return path + " has " + std::to_string(n) + " bytes: expected at least " + value_text(*m);
  }
  if (v.is_number()) {
    const double x = v.get<double>();
    if (const auto m = schema.find("minimum"); m != schema.end() && m->is_number() && x < m->get<double>())
      return path + " = " + value_text(v) + ": expected >= " + value_text(*m);
    if (const auto m = schema.find("maximum"); m != schema.end() && m->is_number() && x > m->get<double>())
      return path + " = " + value_text(v) + ": expected <= " + value_text(*m);
  }
  if (v.is_object()) {
    const auto props = schema.find("properties");
    if (const auto req = schema.find("required"); req != schema.end() && req->is_array())
      for (const auto& k : *req)
        if (k.is_string() && !v.contains(k.get<std::string>()))
          return path + ": the required argument '" + k.get<std::string>() + "' is missing";
    const auto extra = schema.find("additionalProperties");
    for (const auto& [k, x] : v.items()) {
      const bool known = props != schema.end() && props->is_object() && props->contains(k);
      if (known) {
        auto why = check_value((*props)[k], x, path + "." + shorten(k), depth + 1);
        if (!why.empty()) return why;
      } else if (extra != schema.end() && extra->is_boolean() && !extra->get<bool>()) {
        return path + ": unknown argument '" + shorten(k) + "'";
      }
    }
  }
  if (v.is_array())
    if (const auto items = schema.find("items"); items != schema.end())
      for (std::size_t i = 0; i < v.size(); ++i) {
        auto why = check_value(*items, v[i], path + "[" + std::to_string(i) + "]", depth + 1);
        if (!why.empty()) return why;
      }
  return {};
}
}  // namespace detail

/// Checks `arguments` against `schema`, the subset of JSON Schema tools declare: `type` (a name
/// or a list of names; `integer` takes whole numbers), `properties`, `required`,
/// `additionalProperties: false`, `enum`, `items`, `minimum` / `maximum`, `minLength` /
/// `maxLength`. Returns "" when they fit, else the first mismatch with its path
/// (`arguments.expression = 12: expected string`).
inline std::string check_arguments(const nlohmann::json& schema, const nlohmann::json& arguments) {
  return detail::check_value(schema, arguments, "arguments", 0);
}

}  // namespace unirl::agents
