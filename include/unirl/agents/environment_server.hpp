#pragma once
/// \file environment_server.hpp
/// `environment_server<E>` hosts any `TextEnvironment` over HTTP (the protocol of
/// environment_protocol.hpp) on the event-driven server of rewards/http_server.hpp, so an
/// environment can run in another process or on another machine; `remote_environment`
/// (remote_environment.hpp) is its client and itself a `TextEnvironment`.
///
/// ```cpp
/// unirl::agents::environment_server server{unirl::envs::guess_number{}, {.http = {.host = "0.0.0.0", .port = 8100}}};
/// server.start();                                        // serves on background threads
/// return unirl::rewards::serve_until_signal(server) ? 0 : 1;   // SIGINT / SIGTERM: finish, then exit
/// ```
/// Each session is a copy of the environment given, reset with the request's seed; sessions are
/// bounded (`max_sessions`: beyond, 503 with `Retry-After`) and expire after `session_ttl_s`
/// without a request. Steps of different sessions run at once on the handler threads; one
/// session's requests run one at a time. What the HTTP layer guarantees holds here too: an idle
/// or slow connection holds no thread and times out, parsed requests wait in a bounded queue
/// (503 past it), bodies are bounded (`http.max_body_bytes`), and `stop()` (or SIGINT / SIGTERM
/// through `serve_until_signal`) answers what it holds before it returns.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>

#include <boost/hana.hpp>

#include <unirl/agents/environment_protocol.hpp>
#include <unirl/concepts/text_agent.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/http_server.hpp>

namespace unirl::agents {

/// Options of `environment_server`. (`http.path` is not used: `prefix` says where the endpoints are.)
struct environment_server_options {
  rewards::server_options http{.max_body_bytes = 1 << 20};  // host, port, threads, limits, timeouts
  std::string prefix = "/";               // the endpoints' prefix ("/": /reset, /step, /close, /health; "/env/": /env/reset, ...)
  std::int64_t max_sessions = 1024;       // sessions open at once; beyond: 503 + Retry-After
  double session_ttl_s = 600.0;           // a session without a request this long is closed
  std::int64_t max_action_bytes = 64 << 10;  // a longer action: 413

  void validate(const std::string& p) const {
    options::require(!prefix.empty() && prefix.front() == '/' && prefix.back() == '/', p + "prefix", prefix,
                     "a path that starts and ends with '/'");
    options::require(max_sessions >= 1 && max_sessions <= (1 << 24), p + "max_sessions", max_sessions, "in [1, 2^24]");
    options::require(session_ttl_s > 0, p + "session_ttl_s", session_ttl_s, "> 0");
    options::require(max_action_bytes >= 1 && max_action_bytes <= http.max_body_bytes, p + "max_action_bytes",
                     max_action_bytes, "in [1, http.max_body_bytes]");
  }
};
}  // namespace unirl::agents
BOOST_HANA_ADAPT_STRUCT(unirl::agents::environment_server_options, http, prefix, max_sessions, session_ttl_s, max_action_bytes);
namespace unirl::agents {

/// Hosts copies of a `TextEnvironment` as sessions (see the file comment).
template <TextEnvironment E>
class environment_server {
 public:
  environment_server(E prototype, environment_server_options o = {})
      : prototype_(std::move(prototype)), opts_((unirl::options::validate(o), std::move(o))),
        server_([this](const rewards::http_request_view& r) { return handle(r); }, with_path(opts_), "environment server") {}

  void start() { server_.start(); }
  void stop() { server_.stop(); }
  void wait() { server_.wait(); }
  std::uint16_t port() const { return server_.port(); }
  /// `http://host:port<prefix>`: what `remote_environment_options::url` takes.
  std::string url() const { return server_.url(); }
  const environment_server_options& opts() const { return opts_; }
  /// The HTTP server underneath (connections, queue, limits).
  const rewards::json_http_server& http() const { return server_; }
  /// Sessions open now (expired ones included until the next sweep).
  std::int64_t sessions() const {
    std::lock_guard lock(mutex_);
    return static_cast<std::int64_t>(sessions_.size());
  }
  /// Steps answered so far (replays of a lost reply not counted).
  std::int64_t steps() const { return steps_; }

  /// Answers one request (the HTTP layer aside): routing, parsing, the session, the environment.
  /// Never throws; the statuses are those of environment_protocol.hpp.
  rewards::http_reply handle(const rewards::http_request_view& req) {
    try {
      return route(req);
    } catch (const env_request_error& e) {
      return rewards::detail::failure(e.status, e.what(), false);
    } catch (const std::exception& e) {
      return rewards::detail::failure(500, std::string("the environment failed: ") + e.what(), opts_.http.log_errors);
    } catch (...) {
      return rewards::detail::failure(500, "the environment threw an exception that is not a std::exception",
                                      opts_.http.log_errors);
    }
  }

 private:
  using clock = std::chrono::steady_clock;
  static rewards::server_options with_path(const environment_server_options& o) {
    auto h = o.http;
    h.path = o.prefix;  // url() names the prefix
    return h;
  }
  struct session {
    std::mutex mutex;
    std::optional<E> env;
    std::int64_t turn = 0;  // steps answered
    bool done = false;
    std::string last_action, last_reply;
    clock::time_point used;  // under the server's mutex
  };

  rewards::http_reply route(const rewards::http_request_view& req) {
    const auto& prefix = opts_.prefix;
    std::string_view target = req.target;
    target = target.substr(0, target.find('?'));
    std::optional<env_endpoint> ep;
    if (target.size() > prefix.size() && target.compare(0, prefix.size(), prefix) == 0) {
      const auto name = target.substr(prefix.size());
      if (name == "reset") ep = env_endpoint::reset;
      else if (name == "step") ep = env_endpoint::step;
      else if (name == "close") ep = env_endpoint::close;
      else if (name == "health") ep = env_endpoint::health;
    }
    if (!ep)
      throw env_request_error(404, "no endpoint " + detail::quoted(target) + "; the environment service has POST " + prefix +
                                       "reset, POST " + prefix + "step, POST " + prefix + "close and GET " + prefix + "health");
    const char* method = *ep == env_endpoint::health ? "GET" : "POST";
    if (req.method != method) {
      auto r = rewards::detail::failure(405, "method " + detail::quoted(req.method, 20) + " on " + std::string(target) +
                                                 "; expected " + method, false);
      r.headers.emplace_back("Allow", method);
      return r;
    }
    const auto r = parse_env_request(*ep, req.body,
                                     {.max_action_bytes = static_cast<std::size_t>(opts_.max_action_bytes)});
    switch (*ep) {
      case env_endpoint::health: {
        std::lock_guard lock(mutex_);
        return {200, detail::dump_json({{"status", "ok"},
                                        {"sessions", sessions_.size()},
                                        {"max_sessions", opts_.max_sessions}})};
      }
      case env_endpoint::reset: return reset(r);
      case env_endpoint::step: return step(r);
      case env_endpoint::close: {
        std::lock_guard lock(mutex_);
        sweep(clock::now(), false);
        if (sessions_.erase(r.session) == 0) throw unknown(r.session);
        return {200, R"({"closed": true})"};
      }
    }
    return {500, R"({"error": "unreachable"})"};
  }

  rewards::http_reply reset(const env_request& r) {
    std::shared_ptr<session> s;
    std::string id = r.session;
    if (id.empty()) {
      s = std::make_shared<session>();
      std::lock_guard lock(mutex_);
      const auto now = clock::now();
      sweep(now, static_cast<std::int64_t>(sessions_.size()) >= opts_.max_sessions);
      if (static_cast<std::int64_t>(sessions_.size()) >= opts_.max_sessions) {
        auto busy = rewards::detail::busy("the environment server has " + std::to_string(sessions_.size()) +
                                          " sessions open (max_sessions = " + std::to_string(opts_.max_sessions) +
                                          "); close finished ones, or retry later");
        return busy;
      }
      do id = new_id();
      while (sessions_.count(id) != 0);
      s->used = now;
      sessions_.emplace(id, s);
    } else {
      s = find(id);
    }
    std::lock_guard lock(s->mutex);
    s->env.reset();
    s->turn = 0;
    s->done = false;
    s->last_action.clear();
    s->last_reply.clear();
    std::optional<text_observation> first;
    try {
      s->env.emplace(prototype_);
      first = s->env->reset(r.seed);
    } catch (...) {
      if (r.session.empty()) {  // a session that never opened
        std::lock_guard lock2(mutex_);
        sessions_.erase(id);
      }
      throw;
    }
    return {200, reset_reply(id, *first)};
  }

  rewards::http_reply step(const env_request& r) {
    const auto s = find(r.session);
    std::lock_guard lock(s->mutex);
    if (r.turn && *r.turn + 1 == s->turn && r.action == s->last_action) return {200, s->last_reply};  // a retry
    if (r.turn && *r.turn != s->turn)
      throw env_request_error(409, "step of session " + r.session + " at turn " + std::to_string(*r.turn) +
                                       "; the session has answered " + std::to_string(s->turn) + " steps (expected turn " +
                                       std::to_string(s->turn) + ")");
    if (s->done)
      throw env_request_error(409, "session " + r.session + "'s episode ended after " + std::to_string(s->turn) +
                                       " steps; reset it before stepping again");
    UNIRL_CHECK(s->env.has_value(), "session ", r.session, " has no environment (its last reset failed)");
    const text_step out = s->env->step(r.action);
    s->last_reply = step_reply(out, s->turn + 1);
    s->last_action = r.action;
    ++s->turn;
    s->done = out.done;
    ++steps_;
    return {200, s->last_reply};
  }

  std::shared_ptr<session> find(const std::string& id) {
    std::lock_guard lock(mutex_);
    const auto now = clock::now();
    sweep(now, false);
    const auto it = sessions_.find(id);
    if (it == sessions_.end()) throw unknown(id);
    if (now - it->second->used >= ttl()) {
      sessions_.erase(it);
      throw unknown(id);
    }
    it->second->used = now;
    return it->second;
  }

  env_request_error unknown(const std::string& id) const {
    return env_request_error(404, "unknown session " + detail::quoted(id) + ": closed, expired (no request for session_ttl_s = " +
                                      unirl::detail::concat(opts_.session_ttl_s) + " s) or never opened; reset without a session to open one");
  }

  // Drops the sessions idle for session_ttl_s: at most once a second, or now when `force`.
  // Under mutex_.
  void sweep(clock::time_point now, bool force) {
    if (!force && now - last_sweep_ < std::chrono::seconds(1)) return;
    last_sweep_ = now;
    for (auto it = sessions_.begin(); it != sessions_.end();)
      it = now - it->second->used >= ttl() ? sessions_.erase(it) : std::next(it);
  }

  clock::duration ttl() const {
    return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(opts_.session_ttl_s));
  }

  // 128 bits from the system's random source, as 32 hexadecimal digits: not guessable.
  std::string new_id() {
    static constexpr char hex[] = "0123456789abcdef";
    std::string id;
    for (int k = 0; k < 4; ++k) {
      const auto v = random_();
      for (int b = 0; b < 8; ++b) id += hex[(v >> (4 * b)) & 15];
    }
    return id;
  }

  E prototype_;
  environment_server_options opts_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<session>> sessions_;
  clock::time_point last_sweep_{};
  std::random_device random_;
  std::atomic<std::int64_t> steps_{0};
  rewards::json_http_server server_;  // last: it stops (and calls no handler) before the rest goes
};

}  // namespace unirl::agents
