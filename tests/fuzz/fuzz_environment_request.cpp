// libFuzzer target: the environment service's requests and replies (agents/environment_protocol.hpp,
// agents/environment_server.hpp): what a server reads from the network and what its client reads
// back, with the built-in guess-the-number game hosted. Torch-free.
//   bash scripts/fuzz.sh environment_request 60
// Input: lines, each one request "METHOD TARGET BODY" (the first two split at spaces) to a fresh
// server's handler (max_sessions 3, max_action_bytes 64), in order, with "$S" in a body replaced by
// the last session a reset returned and "$T" by its turn count, so the fuzzer reaches steps, replays
// and closes of live sessions. Every line is also read as a body of each endpoint by
// parse_env_request, and as a reply by parse_reset_reply / parse_step_reply.
// Findings: an exception other than the documented ones, a crash, undefined behaviour, a leak, or
// a broken invariant:
//  - every reply has a status of the protocol (200, 400, 404, 405, 409, 413, 500, 503) and a body
//    that is a JSON object; any but 200 says why in "error"; 405 carries Allow, 503 Retry-After;
//  - a 200 reset reply and a 200 step reply parse with the client's parsers, a step's turn
//    count is one more than before, a replayed step gets the same bytes; sessions <= max_sessions;
//  - a request body parse_env_request accepts is written again and parsed to the same request;
//    a refused one is refused with 400 or 413 (env_request_error), never another exception;
//  - a reply the client accepts, written again by the server's encoder, parses to the same value.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>
#include <unirl/agents/environment_protocol.hpp>
#include <unirl/agents/environment_server.hpp>
#include <unirl/envs/guess_number.hpp>

namespace {
namespace ua = unirl::agents;

#define check(ok)                                                                                      \
  do {                                                                                                 \
    if (!(ok)) {                                                                                       \
      std::fprintf(stderr, "fuzz_environment_request: invariant failed, line %d: %s\n", __LINE__, #ok); \
      std::abort();                                                                                    \
    }                                                                                                  \
  } while (0)

std::string replace_all(std::string s, std::string_view what, const std::string& with) {
  for (std::size_t at = 0; (at = s.find(what, at)) != std::string::npos; at += with.size()) s.replace(at, what.size(), with);
  return s;
}

bool has_header(const unirl::rewards::http_reply& r, std::string_view name) {
  for (const auto& [k, v] : r.headers)
    if (k == name && !v.empty()) return true;
  return false;
}

// The request `r` written as its endpoint's body.
std::string body_of(const ua::env_request& r) {
  nlohmann::json j = nlohmann::json::object();
  switch (r.endpoint) {
    case ua::env_endpoint::reset:
      j["seed"] = r.seed;
      if (!r.session.empty()) j["session"] = r.session;
      break;
    case ua::env_endpoint::step:
      j["session"] = r.session;
      j["action"] = r.action;
      if (r.turn) j["turn"] = *r.turn;
      break;
    case ua::env_endpoint::close: j["session"] = r.session; break;
    case ua::env_endpoint::health: break;
  }
  return j.dump();
}

void parse_as_body(std::string_view line) {
  const ua::env_request_limits lim{.max_action_bytes = 64};
  for (const auto ep : {ua::env_endpoint::reset, ua::env_endpoint::step, ua::env_endpoint::close}) {
    ua::env_request r;
    try {
      r = ua::parse_env_request(ep, line, lim);
    } catch (const ua::env_request_error& e) {
      check(e.status == 400 || e.status == 413);
      continue;
    }
    const auto again = ua::parse_env_request(ep, body_of(r), lim);
    check(again.endpoint == r.endpoint && again.seed == r.seed && again.session == r.session && again.action == r.action &&
          again.turn == r.turn);
  }
}

void parse_as_reply(std::string_view line) {
  try {
    const auto [id, first] = ua::parse_reset_reply(line);
    const auto [id2, first2] = ua::parse_reset_reply(ua::reset_reply(id, first));
    check(id2 == id && first2.text == first.text && first2.tokens == first.tokens);
  } catch (const unirl::error&) {
  }
  try {
    std::int64_t turn = 0;
    const auto s = ua::parse_step_reply(line, &turn);
    std::int64_t turn2 = 0;
    const auto s2 = ua::parse_step_reply(ua::step_reply(s, turn), &turn2);
    check(turn2 == turn && s2.reward == s.reward && s2.done == s.done && s2.observation.text == s.observation.text &&
          s2.observation.tokens == s.observation.tokens);
  } catch (const unirl::error&) {
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  ua::environment_server server{unirl::envs::guess_number{{.low = 1, .high = 20, .max_guesses = 4}},
                                {.max_sessions = 3, .session_ttl_s = 1000, .max_action_bytes = 64}};
  std::string session = "none";
  std::map<std::string, std::int64_t> turns;  // per session: steps answered
  std::map<std::string, std::pair<std::string, std::string>> last;  // per session: the last step's body and reply
  std::size_t lines = 0;
  for (std::size_t at = 0; at <= input.size() && lines < 64; ++lines) {
    const auto end = std::min(input.find('\n', at), input.size());
    const std::string_view line = input.substr(at, end - at);
    at = end + 1;
    parse_as_body(line);
    parse_as_reply(line);
    const auto sp1 = line.find(' ');
    const auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    unirl::rewards::http_request_view req;
    req.method = std::string(line.substr(0, sp1));
    req.target = sp1 == std::string_view::npos ? "/" : std::string(line.substr(sp1 + 1, sp2 - sp1 - 1));
    const std::string raw = sp2 == std::string_view::npos ? std::string() : std::string(line.substr(sp2 + 1));
    req.body = replace_all(replace_all(raw, "$S", session), "$T", std::to_string(turns[session]));
    const auto body = req.body;
    const auto reply = server.handle(req);
    const auto st = reply.status;
    check(st == 200 || st == 400 || st == 404 || st == 405 || st == 409 || st == 413 || st == 500 || st == 503);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(reply.body);
    } catch (const nlohmann::json::exception&) {
      check(false);
    }
    check(j.is_object());
    check((st == 200) != j.contains("error"));
    if (st != 200) check(j["error"].is_string() && !j["error"].get<std::string>().empty());
    if (st == 405) check(has_header(reply, "Allow"));
    if (st == 503) check(has_header(reply, "Retry-After"));
    check(server.sessions() <= 3);
    if (st != 200) continue;
    if (req.target == "/reset") {
      const auto [id, first] = ua::parse_reset_reply(reply.body);
      check(!first.text.empty());
      session = id;
      turns[id] = 0;
      last.erase(id);
    } else if (req.target == "/step") {
      const auto r = ua::parse_env_request(ua::env_endpoint::step, body);
      std::int64_t turn = 0;
      (void)ua::parse_step_reply(reply.body, &turn);
      const auto it = last.find(r.session);
      const bool replay = r.turn && it != last.end() && *r.turn + 1 == turns[r.session] &&
                          ua::parse_env_request(ua::env_endpoint::step, it->second.first).action == r.action;
      if (replay) {
        check(reply.body == it->second.second);
      } else {
        check(turn == turns[r.session] + 1);
        turns[r.session] = turn;
        last[r.session] = {body, reply.body};
      }
    }
  }
  return 0;
}
