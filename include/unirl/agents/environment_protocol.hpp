#pragma once
/// \file environment_protocol.hpp
/// The wire format of the environment service (environment_server.hpp hosts a
/// `TextEnvironment`, remote_environment.hpp is its client): JSON over HTTP/1.1, one session per
/// episode in flight. No I/O here, no LibTorch: the server's request parser and the client's
/// reply parser, both fed untrusted bytes (fuzzed: tests/fuzz/fuzz_environment_request.cpp).
///
/// ```text
/// POST <prefix>reset {"seed": 7}                        -> {"session": "<32 hex>", "observation": {"text": "..."}}
/// POST <prefix>reset {"seed": 8, "session": "<id>"}     -> the same session, a new episode
/// POST <prefix>step  {"session": "<id>", "action": "50", "turn": 0}
///                                                       -> {"observation": {"text": "Lower."}, "reward": 0.0, "done": false, "turn": 1}
/// POST <prefix>close {"session": "<id>"}                -> {"closed": true}
/// GET  <prefix>health                                   -> {"status": "ok", "sessions": 3, "max_sessions": 1024}
/// ```
/// An observation is `{"text": "..."}`, with `"tokens": [ids]` when the environment gives ids.
/// `turn` (optional) is the number of steps the client has seen answered: a step is applied
/// when it equals the session's count, and a repeat of the last step (the same turn and action,
/// a retry whose reply was lost) gets the same reply again without stepping twice.
/// Errors are `{"error": "<one line naming the bad value>"}` with status 400 (malformed JSON or
/// UTF-8, not an object, an unknown / missing / wrongly typed field, JSON nested deeper than
/// 8), 404 (unknown path; unknown, closed or expired session), 405 (wrong method, with `Allow`),
/// 409 (a step after the episode ended, or out of turn), 413 (an action over `max_action_bytes`,
/// a body over the HTTP limit), 500 (the environment threw), 503 with `Retry-After: 1` (sessions
/// at `max_sessions`, or the HTTP server's queue full).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include <unirl/agents/tool_call.hpp>
#include <unirl/concepts/text_agent.hpp>
#include <unirl/core/error.hpp>

namespace unirl::agents {

/// The endpoints of the environment service.
enum class env_endpoint { reset, step, close, health };

/// A parsed request body (the fields its endpoint takes).
struct env_request {
  env_endpoint endpoint = env_endpoint::reset;
  std::uint64_t seed = 0;
  std::string session{};  // empty: none given (reset: open a new session)
  std::string action{};
  std::optional<std::int64_t> turn{};
};

/// A request the service refuses: the HTTP status and the reason (`what()`).
struct env_request_error : error {
  env_request_error(unsigned s, const std::string& what) : error(what), status(s) {}
  unsigned status;
};

/// Limits on requests, from the server's options.
struct env_request_limits {
  std::size_t max_action_bytes = 64 << 10;
  std::size_t max_session_chars = 64;
  std::size_t max_depth = 8;
};

namespace detail {
/// `j` as JSON text, whatever bytes its strings hold (invalid UTF-8 becomes U+FFFD).
inline std::string dump_json(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

/// At most `n` bytes of `s` as JSON text (a quoted, escaped excerpt) for a message.
inline std::string quoted(std::string_view s, std::size_t n = 80) {
  auto q = dump_json(nlohmann::json(std::string(s.substr(0, n))));
  if (s.size() > n) q += "... (" + std::to_string(s.size()) + " bytes)";
  return q;
}

inline const char* endpoint_name(env_endpoint e) {
  switch (e) {
    case env_endpoint::reset: return "reset";
    case env_endpoint::step: return "step";
    case env_endpoint::close: return "close";
    case env_endpoint::health: return "health";
  }
  return "?";
}

inline std::string type_name(const nlohmann::json& v) {
  if (v.is_number_integer()) return v.is_number_unsigned() ? "a non-negative integer" : "a negative integer";
  if (v.is_number_float()) return "a number with a fraction or exponent";
  return std::string("a ") + v.type_name();
}

inline nlohmann::json observation_json(const text_observation& o) {
  nlohmann::json j{{"text", o.text}};
  if (!o.tokens.empty()) j["tokens"] = o.tokens;
  return j;
}
}  // namespace detail

/// Parses the body of a request to `endpoint` (`health` takes none). Throws `env_request_error`
/// with the status and a message naming the bad value (see the file comment).
inline env_request parse_env_request(env_endpoint endpoint, std::string_view body, const env_request_limits& lim = {}) {
  env_request r;
  r.endpoint = endpoint;
  if (endpoint == env_endpoint::health) return r;
  const std::string where = std::string("a ") + detail::endpoint_name(endpoint) + " request";
  auto bad = [&](const std::string& why) { return env_request_error(400, where + ": " + why); };
  if (const auto d = detail::json_depth(body, lim.max_depth); d > lim.max_depth)
    throw bad("JSON nested deeper than " + std::to_string(lim.max_depth) + " levels; expected a flat object");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("malformed JSON (") + e.what() + ")");
  }
  if (!j.is_object()) throw bad("the body is " + detail::type_name(j) + "; expected a JSON object");
  auto allowed = [&](std::initializer_list<const char*> keys) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      bool known = false;
      for (const char* k : keys) known = known || it.key() == k;
      if (known) continue;
      std::string list;
      for (const char* k : keys) list += std::string(list.empty() ? "" : ", ") + k;
      throw bad("unknown field " + detail::quoted(it.key()) + "; expected " + list);
    }
  };
  auto session = [&](bool required) {
    if (!j.contains("session")) {
      if (required) throw bad("no \"session\"; expected the id its reset returned");
      return;
    }
    const auto& v = j["session"];
    if (!v.is_string()) throw bad("\"session\" is " + detail::type_name(v) + "; expected a string");
    const auto& s = v.get_ref<const std::string&>();
    if (s.empty() || s.size() > lim.max_session_chars)
      throw bad("\"session\" " + detail::quoted(s) + " has " + std::to_string(s.size()) + " characters; expected 1 to " +
                std::to_string(lim.max_session_chars));
    r.session = s;
  };
  switch (endpoint) {
    case env_endpoint::reset: {
      allowed({"seed", "session"});
      if (!j.contains("seed")) throw bad("no \"seed\"; expected an integer in [0, 2^64)");
      const auto& v = j["seed"];
      if (!v.is_number_unsigned())
        throw bad("\"seed\" " + detail::quoted(detail::dump_json(v), 40) + " is " + detail::type_name(v) +
                  "; expected an integer in [0, 2^64)");
      r.seed = v.get<std::uint64_t>();
      session(false);
      break;
    }
    case env_endpoint::step: {
      allowed({"session", "action", "turn"});
      session(true);
      if (!j.contains("action")) throw bad("no \"action\"; expected the policy's text");
      const auto& a = j["action"];
      if (!a.is_string()) throw bad("\"action\" is " + detail::type_name(a) + "; expected a string");
      const auto& text = a.get_ref<const std::string&>();
      if (text.size() > lim.max_action_bytes)
        throw env_request_error(413, where + ": the action has " + std::to_string(text.size()) +
                                         " bytes, more than max_action_bytes = " + std::to_string(lim.max_action_bytes));
      r.action = text;
      if (j.contains("turn")) {
        const auto& t = j["turn"];
        if (!t.is_number_unsigned() || t.get<std::uint64_t>() > (std::uint64_t{1} << 53))
          throw bad("\"turn\" " + detail::quoted(detail::dump_json(t), 40) + " is " + detail::type_name(t) +
                    "; expected an integer in [0, 2^53]: the steps answered so far");
        r.turn = static_cast<std::int64_t>(t.get<std::uint64_t>());
      }
      break;
    }
    case env_endpoint::close:
      allowed({"session"});
      session(true);
      break;
    case env_endpoint::health: break;
  }
  return r;
}

/// The body of a reset's reply.
inline std::string reset_reply(const std::string& session, const text_observation& o) {
  return detail::dump_json({{"session", session}, {"observation", detail::observation_json(o)}});
}

/// The body of a step's reply (`turn`: the steps answered, this one included). Throws
/// `unirl::error` for a reward that is not finite (JSON has no NaN).
inline std::string step_reply(const text_step& s, std::int64_t turn) {
  UNIRL_CHECK(std::isfinite(s.reward), "the environment returned the reward ", s.reward, "; expected a finite number");
  return detail::dump_json({{"observation", detail::observation_json(s.observation)}, {"reward", s.reward},
                            {"done", s.done}, {"turn", turn}});
}

namespace detail {
inline text_observation parse_observation(const nlohmann::json& j, const std::string& where) {
  UNIRL_CHECK(j.contains("observation") && j["observation"].is_object(), where, ": no \"observation\" object");
  const auto& o = j["observation"];
  text_observation out;
  UNIRL_CHECK(o.contains("text") && o["text"].is_string(), where, ": the observation has no \"text\" string");
  out.text = o["text"].get<std::string>();
  if (o.contains("tokens")) {
    UNIRL_CHECK(o["tokens"].is_array(), where, ": the observation's \"tokens\" is ", type_name(o["tokens"]),
                "; expected an array of token ids");
    out.tokens.reserve(o["tokens"].size());
    for (const auto& t : o["tokens"]) {
      UNIRL_CHECK(t.is_number_integer() && t.get<std::int64_t>() >= 0 && (!t.is_number_unsigned() || t.get<std::uint64_t>() <= INT64_MAX),
                  where, ": token ", out.tokens.size(), " of the observation is ", quoted(dump_json(t), 40),
                  "; expected a non-negative int64 id");
      out.tokens.push_back(t.get<std::int64_t>());
    }
  }
  return out;
}

inline nlohmann::json parse_reply_object(std::string_view body, const std::string& where) {
  nlohmann::json j;
  try {
    if (json_depth(body, 8) > 8) throw error("nested deeper than 8 levels");
    j = nlohmann::json::parse(body);
  } catch (const std::exception& e) {
    throw error(where + ": malformed JSON reply (" + e.what() + "): " + quoted(body, 120));
  }
  UNIRL_CHECK(j.is_object(), where, ": the reply is ", type_name(j), "; expected a JSON object");
  return j;
}
}  // namespace detail

/// A reset's reply: the session id and the first observation. Throws `unirl::error` naming
/// what breaks the schema.
inline std::pair<std::string, text_observation> parse_reset_reply(std::string_view body) {
  const std::string where = "reset";
  const auto j = detail::parse_reply_object(body, where);
  UNIRL_CHECK(j.contains("session") && j["session"].is_string() && !j["session"].get_ref<const std::string&>().empty() &&
                  j["session"].get_ref<const std::string&>().size() <= 64,
              "reset: the reply has no \"session\" string of 1 to 64 characters: ", detail::quoted(body, 120));
  return {j["session"].get<std::string>(), detail::parse_observation(j, where)};
}

/// A step's reply (and the turn count it reports, when `turn` is given). Throws `unirl::error`
/// naming what breaks the schema (a reward that is not a finite number, `done` not a boolean, ...).
inline text_step parse_step_reply(std::string_view body, std::int64_t* turn = nullptr) {
  const std::string where = "step";
  const auto j = detail::parse_reply_object(body, where);
  text_step s;
  s.observation = detail::parse_observation(j, where);
  UNIRL_CHECK(j.contains("reward") && j["reward"].is_number() && std::isfinite(j["reward"].get<double>()),
              "step: the reply's \"reward\" is not a finite number: ", detail::quoted(body, 120));
  s.reward = j["reward"].get<double>();
  UNIRL_CHECK(j.contains("done") && j["done"].is_boolean(), "step: the reply's \"done\" is not a boolean: ",
              detail::quoted(body, 120));
  s.done = j["done"].get<bool>();
  if (turn) {
    UNIRL_CHECK(j.contains("turn") && j["turn"].is_number_unsigned(), "step: the reply has no \"turn\" count: ",
                detail::quoted(body, 120));
    *turn = static_cast<std::int64_t>(std::min<std::uint64_t>(j["turn"].get<std::uint64_t>(), INT64_MAX));
  }
  return s;
}

}  // namespace unirl::agents
