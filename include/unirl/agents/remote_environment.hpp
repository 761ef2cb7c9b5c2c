#pragma once
/// \file remote_environment.hpp
/// `remote_environment`: a `TextEnvironment` whose episodes run in an environment service
/// (environment_server.hpp; the protocol of environment_protocol.hpp), in another process or on
/// another machine. `run_episodes` and `episode_grpo` take it as they take a local environment.
///
/// ```cpp
/// unirl::agents::remote_environment env{{.url = "http://10.0.0.7:8100/", .timeout_s = 10}};
/// auto out = unirl::agents::run_episodes(model, env, seeds, /*group=*/8, text, {.max_turns = 7});
/// ```
/// With the reward client's guarantees (rewards/remote.hpp): every request has a timeout and is
/// retried as configured after a transient failure (no connection, a timeout, 502 / 503 / 504,
/// 408, 429; after the backoff or the server's `Retry-After`), all within `deadline_s`; then, as for
/// any other failure (another 4xx, a 500 — the environment threw —, a reply that breaks the
/// schema), it throws `unirl::runtime_failure` naming the URL, the attempts and the cause, never
/// waits longer. A step is sent with its turn number, so a retry after a lost reply is answered
/// from the server's copy instead of stepping twice.
///
/// A copy has the options and no session (the rollout copies the environment it is given once
/// per episode, then resets each copy: each opens its own session); the session is closed when
/// the object goes (or by `close()`). An action is the policy's text: one longer than
/// `max_action_bytes` is cut to it at a UTF-8 boundary (counted in `actions_cut()`) and bytes that
/// are not UTF-8 travel as U+FFFD — never an exception for what a model wrote.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>

#include <unirl/agents/environment_protocol.hpp>
#include <unirl/concepts/text_agent.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/http_client.hpp>

namespace unirl::agents {

/// Options of `remote_environment`.
struct remote_environment_options {
  std::string url = "http://127.0.0.1:8100/";  // the service: http://host[:port][/prefix/]
  double timeout_s = 30.0;           // per attempt: connect + send + complete reply
  std::int64_t retries = 3;          // further attempts after the first fails (transient failures only)
  double backoff_s = 0.2;            // wait before the first retry ...
  double backoff_multiplier = 2.0;   // ... each further one this much longer ...
  double backoff_max_s = 5.0;        // ... up to this
  double deadline_s = 120.0;         // one request with all its retries and waits
  std::int64_t max_action_bytes = 64 << 10;  // longer actions are cut (the server's limit must be at least this)
  double close_timeout_s = 2.0;      // closing a session when the object goes (best effort)

  void validate(const std::string& p) const {
    options::require(url.rfind("http://", 0) == 0, p + "url", url, "an http:// URL (https is not supported)");
    options::require(timeout_s > 0, p + "timeout_s", timeout_s, "> 0");
    options::require(retries >= 0, p + "retries", retries, ">= 0");
    options::require(backoff_s >= 0, p + "backoff_s", backoff_s, ">= 0");
    options::require(backoff_multiplier >= 1, p + "backoff_multiplier", backoff_multiplier, ">= 1");
    options::require(backoff_max_s >= 0, p + "backoff_max_s", backoff_max_s, ">= 0");
    options::require(deadline_s > 0, p + "deadline_s", deadline_s, "> 0");
    options::require(max_action_bytes >= 1, p + "max_action_bytes", max_action_bytes, ">= 1");
    options::require(close_timeout_s > 0, p + "close_timeout_s", close_timeout_s, "> 0");
  }
};
}  // namespace unirl::agents
BOOST_HANA_ADAPT_STRUCT(unirl::agents::remote_environment_options, url, timeout_s, retries, backoff_s,
                        backoff_multiplier, backoff_max_s, deadline_s, max_action_bytes, close_timeout_s);
namespace unirl::agents {

namespace detail {
/// `text` cut to at most `n` bytes, not inside a UTF-8 sequence.
inline std::string cut_utf8(const std::string& text, std::size_t n) {
  if (text.size() <= n) return text;
  std::size_t end = n;
  // Back over continuation bytes (10xxxxxx) to the start of the sequence that would be split.
  std::size_t k = end;
  while (k > 0 && k + 4 > end && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
  if ((static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) k = end;  // not UTF-8 here: cut at n
  return text.substr(0, k);
}
}  // namespace detail

/// A `TextEnvironment` served by an environment service (see the file comment).
class remote_environment {
 public:
  using options = remote_environment_options;

  remote_environment() : remote_environment(options{}) {}
  explicit remote_environment(options o) : o_(std::move(o)), counters_(std::make_shared<counters>()) {
    unirl::options::validate(o_);
    base_ = rewards::parse_url(o_.url);
    if (base_.target.empty() || base_.target.back() != '/') base_.target += '/';
  }
  /// The options (and shared counters), not the session: the copy opens its own at `reset`.
  remote_environment(const remote_environment& other) : o_(other.o_), base_(other.base_), counters_(other.counters_) {}
  remote_environment& operator=(const remote_environment& other) {
    if (this != &other) {
      close();
      o_ = other.o_;
      base_ = other.base_;
      counters_ = other.counters_;
    }
    return *this;
  }
  remote_environment(remote_environment&& other) noexcept
      : o_(std::move(other.o_)), base_(std::move(other.base_)), counters_(std::move(other.counters_)),
        session_(std::exchange(other.session_, {})), turn_(other.turn_) {}
  remote_environment& operator=(remote_environment&& other) noexcept {
    if (this != &other) {
      close();
      o_ = std::move(other.o_);
      base_ = std::move(other.base_);
      counters_ = std::move(other.counters_);
      session_ = std::exchange(other.session_, {});
      turn_ = other.turn_;
    }
    return *this;
  }
  ~remote_environment() { close(); }

  /// A new episode from `seed`: in this object's session (opened on the first call, and again if
  /// the server has let it expire).
  text_observation reset(std::uint64_t seed) {
    nlohmann::json body{{"seed", seed}};
    if (!session_.empty()) {
      body["session"] = session_;
      const auto res = send("reset", detail::dump_json(body), /*unknown_session_ok=*/true);
      if (res) return take_reset(*res);
      session_.clear();  // expired on the server: open a new one
      body.erase("session");
    }
    return take_reset(*send("reset", detail::dump_json(body), false));
  }

  /// One turn: the policy's text (cut to `max_action_bytes`), the server's observation, reward
  /// and whether the episode ended. Throws `runtime_failure` before a reset and when the service fails.
  text_step step(const std::string& action) {
    if (session_.empty()) throw runtime_failure("unirl: remote environment " + o_.url + ": step before reset");
    std::string text = detail::cut_utf8(action, static_cast<std::size_t>(o_.max_action_bytes));
    if (text.size() < action.size()) ++counters_->actions_cut;
    const auto body = detail::dump_json({{"session", session_}, {"action", std::move(text)}, {"turn", turn_}});
    const auto reply = *send("step", body, false);
    std::int64_t turn = 0;
    text_step s;
    try {
      s = parse_step_reply(reply, &turn);
    } catch (const std::exception& e) {
      throw failure("step", 1, ", the reply breaks the protocol", e.what());
    }
    if (turn != turn_ + 1)
      throw failure("step", 1, ", the reply breaks the protocol",
                    unirl::detail::concat("the reply counts ", turn, " steps; expected ", turn_ + 1));
    turn_ = turn;
    return s;
  }

  /// Closes the session on the server (best effort, within `close_timeout_s`; never throws).
  void close() noexcept {
    if (session_.empty()) return;
    try {
      auto u = base_;
      u.target += "close";
      (void)rewards::http_post(u, detail::dump_json({{"session", session_}}), o_.close_timeout_s);
    } catch (...) {
    }
    session_.clear();
  }

  /// The session's id ("" before the first reset).
  const std::string& session() const { return session_; }
  const options& opts() const { return o_; }
  /// HTTP attempts, all copies together, failed ones included.
  std::int64_t attempts() const { return counters_->attempts; }
  /// Actions cut to `max_action_bytes`, all copies together.
  std::int64_t actions_cut() const { return counters_->actions_cut; }

 private:
  struct counters {
    std::atomic<std::int64_t> attempts{0}, actions_cut{0};
  };

  runtime_failure failure(const std::string& endpoint, std::int64_t attempts, const std::string& how,
                          const std::string& cause) const {
    return runtime_failure(unirl::detail::concat("unirl: remote environment ", o_.url, " (", endpoint, ") failed after ",
                                                 attempts, " attempt(s)", how, ": ", cause));
  }

  text_observation take_reset(const std::string& reply) {
    try {
      auto [id, first] = parse_reset_reply(reply);
      session_ = std::move(id);
      turn_ = 0;
      return first;
    } catch (const std::exception& e) {
      throw failure("reset", 1, ", the reply breaks the protocol", e.what());
    }
  }

  // POSTs `body` to `endpoint` with the retries; the 200 reply's body, or nullopt for a 404
  // when `unknown_session_ok`.
  std::optional<std::string> send(const std::string& endpoint, const std::string& body, bool unknown_session_ok) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(o_.deadline_s));
    auto remaining = [&] { return std::chrono::duration<double>(deadline - clock::now()).count(); };
    auto u = base_;
    u.target += endpoint;
    double backoff = o_.backoff_s;
    for (std::int64_t attempt = 1;; ++attempt) {
      std::string cause;
      std::optional<double> retry_after;
      ++counters_->attempts;
      try {
        const auto res = rewards::http_post(u, body, std::min(o_.timeout_s, std::max(remaining(), 1e-3)), "application/json",
                                            std::uint64_t{16} << 20);
        if (res.status == 200) return res.body;
        if (res.status == 404 && unknown_session_ok) return std::nullopt;
        std::string why;
        try {
          const auto j = nlohmann::json::parse(res.body);
          if (j.is_object() && j.contains("error") && j["error"].is_string())
            why = rewards::detail::excerpt(j["error"].get<std::string>(), 300);
        } catch (...) {
        }
        if (why.empty()) why = rewards::detail::excerpt(res.body);
        cause = unirl::detail::concat("HTTP ", res.status, ": ", why);
        const bool transient = res.status == 502 || res.status == 503 || res.status == 504 || res.status == 408 ||
                               res.status == 429;
        if (!transient) throw failure(endpoint, attempt, ", not retried (the same request would fail again)", cause);
        if (!res.retry_after.empty()) {
          retry_after = rewards::detail::parse_retry_after(res.retry_after);
          cause += " (Retry-After: " + rewards::detail::excerpt(res.retry_after, 40) + ")";
        }
      } catch (const runtime_failure&) {
        throw;
      } catch (const std::exception& e) {
        cause = e.what();  // no connection, a timeout, a connection closed early
      }
      if (attempt > o_.retries) throw failure(endpoint, attempt, "", cause);
      const double pause = retry_after ? *retry_after : backoff;
      if (!retry_after) backoff = std::min(backoff * o_.backoff_multiplier, o_.backoff_max_s);
      if (pause >= remaining())
        throw failure(endpoint, attempt,
                      unirl::detail::concat(", giving up: the next try (after ", pause, " s) would start past deadline_s = ",
                                            o_.deadline_s, " s"),
                      cause);
      std::this_thread::sleep_for(std::chrono::duration<double>(pause));
    }
  }

  options o_;
  rewards::parsed_url base_;
  std::shared_ptr<counters> counters_;
  std::string session_;
  std::int64_t turn_ = 0;
};
static_assert(TextEnvironment<remote_environment>);

}  // namespace unirl::agents
