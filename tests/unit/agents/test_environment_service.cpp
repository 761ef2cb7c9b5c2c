// The environment service (issue 25's remote environments): the guess-the-number game, the
// server hosting it in a forked child process (real sockets on loopback), its documented errors,
// remote episodes equal to the same episodes in process, and a server killed, stopped or signalled
// mid-episode seen by the client as a clear error naming the URL within its timeouts.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <unirl/agents/environment_server.hpp>
#include <unirl/agents/remote_environment.hpp>
#include <unirl/envs/guess_number.hpp>

#include "env_server_child.hpp"

using unirl::agents::environment_server;
using unirl::agents::remote_environment;
using unirl::envs::guess_number;

namespace env_service_test {
// Waits until the process is stopped (state 'T' in /proc/<pid>/stat): SIGSTOP is asynchronous.
inline bool wait_stopped(pid_t pid, double timeout_s) {
  const auto t0 = steady::now();
  while (since(t0) < timeout_s) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto close = stat.rfind(')');
    if (close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'T') return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// One raw exchange: status, body and the named header.
struct exchange {
  unsigned status;
  nlohmann::json body;
  std::string retry_after;
};
inline exchange call(const std::string& base, boost::beast::http::verb method, const std::string& path, const std::string& body) {
  auto u = unirl::rewards::parse_url(base);
  u.target = "/" + path;
  // Through http_exchange: the client's own HTTP code, so every byte sent is the test's.
  const auto r = unirl::rewards::http_exchange(method, u, body, 5.0);
  return {r.status, nlohmann::json::parse(r.body), r.retry_after};
}
inline exchange post(const std::string& base, const std::string& path, const std::string& body) {
  return call(base, boost::beast::http::verb::post, path, body);
}
inline std::string error_of(const exchange& x) { return x.body.value("error", std::string("(no error field)")); }

// Binary search over the replies: what a scripted player writes each turn.
struct bisect {
  std::int64_t lo, hi;
  std::string guess() const { return "My guess: " + std::to_string((lo + hi) / 2) + "."; }
  void hear(const std::string& reply) {
    const auto g = (lo + hi) / 2;
    if (reply.rfind("Higher", 0) == 0) lo = g + 1;
    if (reply.rfind("Lower", 0) == 0) hi = g - 1;
  }
};

// Plays one game with `env` from `seed`: the observations and rewards seen, in order.
template <class E>
std::vector<std::string> play(E& env, std::uint64_t seed, std::vector<double>& rewards, bool& won) {
  std::vector<std::string> seen{env.reset(seed).text};
  bisect b{1, 100};
  won = false;
  const bool skip = seed % 2 == 1;  // odd seeds: one turn without a number
  for (int turn = 0; turn < 7; ++turn) {
    const bool blank = skip && turn == 1;
    const auto s = env.step(blank ? "no idea" : b.guess());
    seen.push_back(s.observation.text);
    rewards.push_back(s.reward);
    if (!blank) b.hear(s.observation.text);
    if (s.done) {
      won = s.reward == 1.0;
      break;
    }
  }
  return seen;
}
}  // namespace env_service_test

TEST_CASE("guess_number: the number is the seed's, replies say higher or lower, bisection wins", "[agents][cpu][env_service]") {
  using namespace env_service_test;
  guess_number a, b;
  std::int64_t wins = 0;
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    a.reset(seed);
    b.reset(seed);
    REQUIRE(a.target() == b.target());
    REQUIRE((a.target() >= 1 && a.target() <= 100));
    bisect p{1, 100};
    for (int turn = 0; turn < 7; ++turn) {
      const auto s = a.step(p.guess());
      if (s.done) {
        wins += s.reward == 1.0;
        CHECK(s.observation.text == "Correct!");
        break;
      }
      CHECK(s.reward == 0.0);
      const auto g = (p.lo + p.hi) / 2;
      CHECK(s.observation.text.rfind(g < a.target() ? "Higher." : "Lower.", 0) == 0);
      p.hear(s.observation.text);
    }
  }
  CHECK(wins == 200);  // ceil(log2(101)) = 7 guesses always suffice
  guess_number c{{.low = 1, .high = 5, .max_guesses = 2}};
  c.reset(3);
  auto s = c.step("\xff\xfe not a number, 99999999999999999999");
  CHECK(!s.done);
  CHECK(s.observation.text.find("not a number from 1 to 5") != std::string::npos);
  s = c.step(std::to_string(c.target() == 1 ? 2 : 1));
  CHECK(s.done);
  CHECK(s.reward == 0.0);
  CHECK(s.observation.text.find("the number was " + std::to_string(c.target())) != std::string::npos);
  CHECK_THROWS_WITH(c.step("1"), Catch::Contains("after the game ended"));
  CHECK_THROWS_WITH((guess_number{{.low = 5, .high = 4}}), Catch::Contains("high") && Catch::Contains("4"));
}

TEST_CASE("remote environment: the same games over HTTP as in process, observation for observation",
          "[agents][cpu][env_service]") {
  using namespace env_service_test;
  child_env_server server{guess_number{}, {}};
  remote_environment proto{{.url = server.base(), .timeout_s = 5}};
  remote_environment remote = proto;  // a copy: its own session
  guess_number local;
  std::int64_t wins = 0;
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    std::vector<double> r_local, r_remote;
    bool won_local = false, won_remote = false;
    const auto seen_local = play(local, seed, r_local, won_local);
    const auto seen_remote = play(remote, seed, r_remote, won_remote);
    CHECK(seen_remote == seen_local);
    CHECK(r_remote == r_local);
    CHECK(won_remote == won_local);
    wins += won_remote;
  }
  CHECK(wins >= 10);  // bisection wins every even seed's game in 7 guesses; the odd seeds spend one
  CHECK(!remote.session().empty());
  CHECK(proto.session().empty());
  const auto id = remote.session();
  remote.close();
  CHECK(post(server.base(), "step", R"({"session": ")" + id + R"(", "action": "1"})").status == 404);
  CHECK(remote.attempts() >= 20 * 3);  // counted over the copies
}

TEST_CASE("environment service: bad requests get the documented statuses with errors naming the value",
          "[agents][cpu][env_service]") {
  using namespace env_service_test;
  using boost::beast::http::verb;
  // A small body limit: a body over it is refused from its head, and the bytes sent after it are
  // drained (under the server's 1 MiB) so that the 413 arrives.
  child_env_server server{guess_number{},
                          {.http = {.max_body_bytes = 4096}, .max_sessions = 3, .max_action_bytes = 100}};
  const auto base = server.base();
  const auto opened = post(base, "reset", R"({"seed": 5})");
  REQUIRE(opened.status == 200);
  const auto id = opened.body["session"].get<std::string>();
  CHECK(id.size() == 32);

  auto x = post(base, "reset", R"({"seed": 5,)");
  CHECK(x.status == 400);
  CHECK_THAT(error_of(x), Catch::Contains("malformed JSON"));
  x = post(base, "step", "{\"session\": \"" + id + "\", \"action\": \"\xff\"}");  // not UTF-8
  CHECK(x.status == 400);
  CHECK_THAT(error_of(x), Catch::Contains("malformed JSON"));
  x = post(base, "reset", R"({"seed": -3})");
  CHECK(x.status == 400);
  CHECK_THAT(error_of(x), Catch::Contains("\"seed\"") && Catch::Contains("-3") && Catch::Contains("[0, 2^64)"));
  x = post(base, "reset", R"({"seed": 1, "colour": "red"})");
  CHECK(x.status == 400);
  CHECK_THAT(error_of(x), Catch::Contains("unknown field \"colour\"") && Catch::Contains("seed, session"));
  x = post(base, "step", R"({"session": ")" + id + R"(", "action": 42})");
  CHECK(x.status == 400);
  CHECK_THAT(error_of(x), Catch::Contains("\"action\" is a non-negative integer; expected a string"));
  x = post(base, "step", std::string(100, '[') + std::string(100, ']'));
  CHECK(x.status == 400);
  CHECK_THAT(error_of(x), Catch::Contains("nested deeper than 8"));

  x = post(base, "step", R"({"session": "0123456789abcdef0123456789abcdef", "action": "1"})");
  CHECK(x.status == 404);
  CHECK_THAT(error_of(x), Catch::Contains("unknown session \"0123456789abcdef0123456789abcdef\""));
  x = post(base, "score", "{}");
  CHECK(x.status == 404);
  CHECK_THAT(error_of(x), Catch::Contains("no endpoint \"/score\"") && Catch::Contains("POST /step"));

  x = call(base, verb::get, "step", "");
  CHECK(x.status == 405);
  CHECK_THAT(error_of(x), Catch::Contains("method \"GET\"") && Catch::Contains("expected POST"));
  x = call(base, verb::post, "health", "");
  CHECK(x.status == 405);
  x = call(base, verb::get, "health", "");
  CHECK(x.status == 200);
  CHECK(x.body["sessions"] == 1);

  x = post(base, "step", R"({"session": ")" + id + R"(", "action": ")" + std::string(101, '7') + R"("})");
  CHECK(x.status == 413);
  CHECK_THAT(error_of(x), Catch::Contains("101 bytes") && Catch::Contains("max_action_bytes = 100"));
  x = post(base, "step", R"({"session": ")" + id + R"(", "action": ")" + std::string(8192, 'a') + R"("})");
  CHECK(x.status == 413);  // over the HTTP body limit, refused from Content-Length

  // Turns: a step out of turn is refused, a repeat of the last one answered again, not stepped.
  const std::string step0 = R"({"session": ")" + id + R"(", "action": "50", "turn": 0})";
  const auto first = post(base, "step", step0);
  REQUIRE(first.status == 200);
  CHECK(first.body["turn"] == 1);
  CHECK(post(base, "step", step0).body == first.body);
  x = post(base, "step", R"({"session": ")" + id + R"(", "action": "50", "turn": 5})");
  CHECK(x.status == 409);
  CHECK_THAT(error_of(x), Catch::Contains("turn 5") && Catch::Contains("answered 1 steps"));
  // A finished episode takes no step until it is reset.
  bool done = first.body["done"].get<bool>();
  for (std::int64_t turn = 1; !done && turn < 7; ++turn)
    done = post(base, "step", R"({"session": ")" + id + R"(", "action": "x", "turn": )" + std::to_string(turn) + "}")
               .body["done"].get<bool>();
  REQUIRE(done);
  x = post(base, "step", R"({"session": ")" + id + R"(", "action": "50"})");
  CHECK(x.status == 409);
  CHECK_THAT(error_of(x), Catch::Contains("episode ended") && Catch::Contains("reset it"));
  CHECK(post(base, "reset", R"({"seed": 6, "session": ")" + id + R"("})").body["session"] == id);

  // Sessions are bounded: 503 with Retry-After past max_sessions, until one closes.
  CHECK(post(base, "reset", R"({"seed": 1})").status == 200);
  CHECK(post(base, "reset", R"({"seed": 2})").status == 200);
  x = post(base, "reset", R"({"seed": 3})");
  CHECK(x.status == 503);
  CHECK(x.retry_after == "1");
  CHECK_THAT(error_of(x), Catch::Contains("3 sessions open (max_sessions = 3)"));
  CHECK(post(base, "close", R"({"session": ")" + id + R"("})").status == 200);
  CHECK(post(base, "reset", R"({"seed": 3})").status == 200);
  x = post(base, "close", R"({"session": ")" + id + R"("})");
  CHECK(x.status == 404);
}

TEST_CASE("environment service: sessions expire after session_ttl_s without a request", "[agents][cpu][env_service]") {
  using namespace env_service_test;
  child_env_server server{guess_number{}, {.max_sessions = 2, .session_ttl_s = 0.3}};
  remote_environment env{{.url = server.base(), .timeout_s = 5}};
  env.reset(1);
  const auto id = env.session();
  std::this_thread::sleep_for(std::chrono::milliseconds(450));
  const auto x = post(server.base(), "step", R"({"session": ")" + id + R"(", "action": "1"})");
  CHECK(x.status == 404);
  CHECK_THAT(error_of(x), Catch::Contains("expired") && Catch::Contains("session_ttl_s = 0.3"));
  CHECK_THROWS_WITH(env.step("1"), Catch::Contains(server.base()) && Catch::Contains("HTTP 404") &&
                                       Catch::Contains("not retried"));
  env.reset(2);  // its session gone, the reset opens a new one
  CHECK(env.session() != id);
  CHECK(env.step("50").observation.text.size() > 0);
  // The full server's expired sessions make room for new ones.
  post(server.base(), "reset", R"({"seed": 1})");
  std::this_thread::sleep_for(std::chrono::milliseconds(450));
  CHECK(post(server.base(), "reset", R"({"seed": 1})").status == 200);
  CHECK(post(server.base(), "reset", R"({"seed": 1})").status == 200);
}

TEST_CASE("remote environment: a server killed or stopped mid-episode is an error naming the URL, not a hang",
          "[agents][cpu][env_service]") {
  using namespace env_service_test;
  SECTION("killed: connection refused, after the retries") {
    child_env_server server{guess_number{}, {}};
    remote_environment env{{.url = server.base(), .timeout_s = 2, .retries = 2, .backoff_s = 0.05}};
    env.reset(3);
    env.step("50");
    ::kill(server.pid, SIGKILL);
    ::waitpid(server.pid, nullptr, 0);
    server.pid = -1;
    const auto t0 = steady::now();
    CHECK_THROWS_WITH(env.step("25"), Catch::Contains("remote environment " + server.base()) &&
                                          Catch::Contains("after 3 attempt(s)") && Catch::Contains("connection refused"));
    CHECK(since(t0) < 2.0);
  }
  SECTION("stopped (SIGSTOP): each attempt times out, then the error") {
    child_env_server server{guess_number{}, {}};
    remote_environment env{{.url = server.base(), .timeout_s = 0.3, .retries = 1, .backoff_s = 0.05, .close_timeout_s = 0.2}};
    env.reset(3);
    ::kill(server.pid, SIGSTOP);
    REQUIRE(wait_stopped(server.pid, 2.0));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // (the other threads stop with the first)
    const auto t0 = steady::now();
    CHECK_THROWS_WITH(env.step("50"), Catch::Contains(server.base()) && Catch::Contains("timed out after 0.3 s") &&
                                          Catch::Contains("after 2 attempt(s)"));
    const auto took = since(t0);
    CHECK(took > 0.6);
    CHECK(took < 2.0);
    ::kill(server.pid, SIGCONT);
  }
  SECTION("a retried step after a lost reply is not stepped twice") {
    // The reply to turn 0 was lost: the client sends turn 0 again and gets the same reply.
    child_env_server server{guess_number{}, {}};
    remote_environment env{{.url = server.base(), .timeout_s = 5}};
    guess_number local;
    CHECK(env.reset(9).text == local.reset(9).text);
    const auto body = R"({"session": ")" + env.session() + R"(", "action": "50", "turn": 0})";
    const auto lost = post(server.base(), "step", body);
    REQUIRE(lost.status == 200);
    const auto s = env.step("50");  // turn 0 again
    CHECK(s.observation.text == lost.body["observation"]["text"].get<std::string>());
    CHECK(s.observation.text == local.step("50").observation.text);
    CHECK(env.step("25").observation.text == local.step("25").observation.text);  // turn 1: one step each
  }
}

TEST_CASE("environment service: SIGTERM answers the steps in flight, then the server exits 0", "[agents][cpu][env_service]") {
  using namespace env_service_test;
  slow_guess slow;
  slow.delay_ms = 300;
  auto o = unirl::agents::environment_server_options{};
  o.http.threads = 1;
  child_env_server server{slow, o, true};
  std::vector<remote_environment> envs(3, remote_environment{{.url = server.base(), .timeout_s = 10, .retries = 0}});
  for (std::size_t i = 0; i < envs.size(); ++i) envs[i].reset(i);
  std::vector<std::string> replies(3);
  std::vector<std::thread> steps;
  for (std::size_t i = 0; i < envs.size(); ++i)
    steps.emplace_back([&, i] { replies[i] = envs[i].step("50").observation.text; });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // one stepping, two queued
  const auto t0 = steady::now();
  ::kill(server.pid, SIGTERM);
  for (auto& t : steps) t.join();
  for (const auto& r : replies) CHECK((r.rfind("Higher.", 0) == 0 || r.rfind("Lower.", 0) == 0 || r == "Correct!"));
  const int st = server.wait_exit(5.0);
  CHECK((st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0));
  CHECK(since(t0) < 3.0);
}
