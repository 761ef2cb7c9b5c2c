// The remote reward service against real HTTP servers on 127.0.0.1 (ephemeral ports): the wire
// format, agreement with local scoring, chunking and bounded concurrency, asynchronous scoring,
// and every fault (slow response past the timeout, HTTP 500, malformed JSON, wrong length,
// connection refused, server killed mid-run) retried as configured, then reported with the URL
// and the cause — never a partial or invented reward.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/server.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"
#include "test_batches.hpp"

using namespace unirl::rewards;
using rewards_test::image_batch;
using rewards_test::text_batch;
using clock_type = std::chrono::steady_clock;

namespace {
double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

text_batch sums() {
  return {.completions = {"=42", "=41", "42", "=7", "=5"},
          .references = {"42", "42", "42", "7", "6"},
          .prompts = {"40+2", "40+2", "40+2", "3+4", "2+4"}};
}

using composed = weighted<exact_answer, regex_format>;
composed make_reward() {
  return composed{{.weights = {1.0, 0.25}}, exact_answer{{.extract = R"(=?(\d+))"}}, regex_format{{.pattern = R"(=\d+)"}}};
}

// A server whose every answer is produced by `reply(call_index, request)`.
struct fault_server {
  std::atomic<int> calls{0};
  json_http_server server;
  template <class F>
  explicit fault_server(F reply)
      : server([this, reply](const http_request_view& r) { return reply(calls++, r); }, server_options{}) {
    server.start();
  }
};

// The number of rewards a request asks for.
std::int64_t request_size(const http_request_view& r) { return nlohmann::json::parse(r.body)["size"].get<std::int64_t>(); }

http_reply ones(const http_request_view& r) {
  return {200, nlohmann::json{{"rewards", std::vector<double>(static_cast<std::size_t>(request_size(r)), 1.0)}}.dump()};
}

// A port on which nothing listens: bind an ephemeral one, then release it.
std::uint16_t closed_port() {
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::acceptor a(ioc, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}
}  // namespace

TEST_CASE("the wire format round-trips batches and tensors", "[cpu][rewards][remote]") {
  auto t = torch::arange(6, torch::kFloat32).view({2, 3}) / 7.0;
  CHECK(torch::equal(tensor_from_json(tensor_to_json(t), "t"), t));
  auto l = torch::tensor({3, -1}, torch::kInt64);
  CHECK(torch::equal(tensor_from_json(tensor_to_json(l), "l"), l));
  auto d = torch::rand({2, 2}, torch::kFloat64);
  CHECK(torch::equal(tensor_from_json(tensor_to_json(d), "d"), d));

  // base64 (RFC 4648 test vectors) and raw-byte tensors of every carried dtype.
  const std::string foobar = "foobar";
  for (std::size_t n = 0; n <= 6; ++n) {
    const auto enc = unirl::rewards::detail::base64_encode(foobar.data(), n);
    CHECK(enc == std::vector<std::string>{"", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"}[n]);
    const auto dec = unirl::rewards::detail::base64_decode(enc, "t");
    CHECK(std::string(dec.begin(), dec.end()) == foobar.substr(0, n));
  }
  CHECK_THROWS_WITH(unirl::rewards::detail::base64_decode("Zm9*", "pic"), Catch::Contains("'pic'") && Catch::Contains("'*'"));
  for (const auto& x : {t, l, d, torch::tensor({true, false, true}), torch::empty({0, 3})}) {
    const auto j = tensor_to_json(x, tensor_encoding::base64);
    CHECK(j.contains("base64"));
    CHECK(torch::equal(tensor_from_json(j, "x"), x));
  }
  auto short_bytes = tensor_to_json(t, tensor_encoding::base64);
  short_bytes["shape"] = {2, 4};
  CHECK_THROWS_WITH(tensor_from_json(short_bytes, "t"), Catch::Contains("24 bytes for shape [2,4] of float32; expected 32"));

  auto b = sums();
  auto j = encode_batch(b);
  CHECK(j["size"] == 5);
  CHECK(j["completions"][1] == "=41");
  auto back = decode_batch(j);
  CHECK(back.size() == 5);
  CHECK(back.completions == b.completions);
  CHECK(back.references == b.references);
  CHECK(back.prompts == b.prompts);
  CHECK(!back.images.defined());
  auto sub = back.select(torch::tensor({4, 0}, torch::kInt64));
  CHECK(sub.completions == std::vector<std::string>{"=5", "=42"});

  image_batch ib{torch::rand({3, 1, 4, 4})};
  auto ij = decode_batch(encode_batch(ib));
  REQUIRE(ij.images.defined());
  CHECK(torch::equal(ij.images, ib.images));
  CHECK(torch::equal(decode_batch(encode_batch(ib, tensor_encoding::base64)).images, ib.images));
  CHECK(ij.select(torch::tensor({2}, torch::kInt64)).images.sizes() == torch::IntArrayRef{1, 1, 4, 4});

  nlohmann::json bad = j;
  bad["references"].erase(0);
  CHECK_THROWS_WITH(decode_batch(bad), Catch::Contains("'references' has 4 entries for size 5"));
  nlohmann::json bad_tensor{{"size", 2}, {"tensors", {{"images", {{"shape", {2, 2}}, {"data", {1, 2, 3}}}}}}};
  CHECK_THROWS_WITH(decode_batch(bad_tensor), Catch::Contains("3 values for shape [2,2]"));

  CHECK(parse_url("http://127.0.0.1:8123/score").port == "8123");
  CHECK(parse_url("http://example.org").target == "/");
  CHECK_THROWS_AS(parse_url("https://example.org/x"), unirl::config_error);
  CHECK_THROWS_AS(remote_scorer({.url = "http://host:port/x"}), unirl::config_error);
  CHECK_THROWS_WITH(remote_scorer({.url = "ftp://x"}), Catch::Contains("url") && Catch::Contains("ftp://x"));
  CHECK_THROWS_WITH(remote_scorer({.max_concurrency = 0}), Catch::Contains("max_concurrency"));
}

TEST_CASE("a hosted scorer gives exactly the local rewards", "[cpu][rewards][remote]") {
  auto local = make_reward();
  const auto b = sums();
  const auto expected = local(b);
  reward_server server{make_reward()};
  server.start();
  REQUIRE(server.port() != 0);

  remote_scorer remote{{.url = server.url(), .timeout_s = 5}};
  auto got = remote(b);
  CHECK(torch::equal(got, expected));
  // Components travel back for the step statistics.
  CHECK(remote.last_components().at("exact_answer") == Approx(local.last_components().at("exact_answer")));
  CHECK(remote.last_components().at("format") == Approx(local.last_components().at("format")));

  // Split into requests of 2 (3 requests), at most 2 in flight: same rewards, in order.
  remote_scorer chunked{{.url = server.url(), .timeout_s = 5, .max_concurrency = 2, .chunk_size = 2}};
  CHECK(torch::equal(chunked(b), expected));
  CHECK(chunked.attempts() == 3);
  CHECK(chunked.last_components().at("exact_answer") == Approx(local.last_components().at("exact_answer")));
  // A remote scorer composes like any other.
  weighted<remote_scorer, regex_format> mixed{{.weights = {1.0, 1.0}}, remote, regex_format{{.pattern = ".*"}}};
  CHECK(torch::allclose(mixed(b), expected + 1));

  // A malformed request is refused with 400 and the reason, not scored.
  const auto res = http_post(parse_url(server.url()), R"({"size": 2, "completions": ["a"]})", 5);
  CHECK(res.status == 400);
  CHECK_THAT(res.body, Catch::Contains("'completions' has 1 entries for size 2"));
  CHECK(http_post(parse_url(server.url()), "{", 5).status == 400);
  // The scorer's own errors come back as 500 with its message (here: references missing).
  remote_scorer no_refs{{.url = server.url(), .timeout_s = 5, .retries = 0}};
  text_batch nr{.completions = {"=1"}};
  CHECK_THROWS_WITH(no_refs(nr), Catch::Contains("HTTP 500") && Catch::Contains("0 references for 1 samples"));
  server.stop();
}

TEST_CASE("submit scores asynchronously so the next rollout can overlap it", "[cpu][rewards][remote]") {
  struct slow_exact {
    exact_answer inner;
    torch::Tensor operator()(const json_batch& b) {
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
      return inner(b);
    }
  };
  reward_server server{slow_exact{}};
  server.start();
  remote_scorer remote{{.url = server.url(), .timeout_s = 5}};
  const auto b = sums();
  const auto t0 = clock_type::now();
  auto pending = remote.submit(b);
  CHECK(seconds_since(t0) < 0.2);  // returned before the server answered
  CHECK(pending.wait_for(std::chrono::milliseconds(0)) == std::future_status::timeout);
  auto r = pending.get();
  CHECK(seconds_since(t0) >= 0.4);
  CHECK(torch::equal(r, exact_answer{}(b)));
}

TEST_CASE("bounded concurrency: never more requests in flight than allowed", "[cpu][rewards][remote]") {
  std::atomic<int> now{0}, peak{0};
  fault_server fs([&](int, const http_request_view& r) {
    const int n = ++now;
    int p = peak.load();
    while (n > p && !peak.compare_exchange_weak(p, n)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    --now;
    return ones(r);
  });
  remote_scorer remote{{.url = fs.server.url(), .timeout_s = 5, .max_concurrency = 2, .chunk_size = 1}};
  auto b = sums();
  const auto t0 = clock_type::now();
  // Two batches at once share the limit.
  auto f1 = remote.submit(b);
  auto f2 = remote.submit(b);
  CHECK(torch::equal(f1.get(), torch::ones({5})));
  CHECK(torch::equal(f2.get(), torch::ones({5})));
  CHECK(fs.calls == 10);
  CHECK(peak.load() <= 2);
  CHECK(peak.load() == 2);
  CHECK(seconds_since(t0) >= 5 * 0.06);  // 10 requests of 60 ms, 2 at a time
}

TEST_CASE("faults are retried, then reported with the URL and the cause", "[cpu][rewards][remote]") {
  const auto b = sums();
  SECTION("slow response past the timeout") {
    fault_server fs([](int, const http_request_view& r) {
      std::this_thread::sleep_for(std::chrono::milliseconds(700));
      return ones(r);
    });
    remote_scorer remote{{.url = fs.server.url(), .timeout_s = 0.15, .retries = 1, .backoff_s = 0.01}};
    const auto t0 = clock_type::now();
    CHECK_THROWS_AS(remote(b), unirl::runtime_failure);
    CHECK(seconds_since(t0) < 0.15 * 2 + 0.5);  // gives up on time: never hangs on a slow server
    CHECK(remote.attempts() == 2);
    try {
      remote(b);
      FAIL("expected a runtime_failure");
    } catch (const unirl::runtime_failure& e) {
      CHECK_THAT(e.what(), Catch::Contains(fs.server.url()) && Catch::Contains("timed out after 0.15 s") &&
                               Catch::Contains("2 attempt(s)"));
    }
  }
  SECTION("HTTP 500") {
    fault_server fs([](int, const http_request_view&) { return http_reply{500, R"({"error": "reward model crashed"})"}; });
    remote_scorer remote{{.url = fs.server.url(), .timeout_s = 2, .retries = 2, .backoff_s = 0.01}};
    CHECK_THROWS_WITH(remote(b), Catch::Contains(fs.server.url()) && Catch::Contains("HTTP 500") &&
                                     Catch::Contains("reward model crashed") && Catch::Contains("3 attempt(s)"));
    CHECK(fs.calls == 3);
  }
  SECTION("malformed JSON") {
    fault_server fs([](int, const http_request_view&) { return http_reply{200, R"({"rewards": [1, 0, )"}; });
    remote_scorer remote{{.url = fs.server.url(), .timeout_s = 2, .retries = 1, .backoff_s = 0.01}};
    CHECK_THROWS_WITH(remote(b), Catch::Contains(fs.server.url()) && Catch::Contains("malformed JSON response"));
    CHECK(fs.calls == 2);
  }
  SECTION("a response of the wrong length") {
    fault_server fs([](int, const http_request_view& r) {
      return http_reply{200, nlohmann::json{{"rewards", std::vector<double>(request_size(r) - 1, 1.0)}}.dump()};
    });
    remote_scorer remote{{.url = fs.server.url(), .timeout_s = 2, .retries = 1, .backoff_s = 0.01}};
    CHECK_THROWS_WITH(remote(b), Catch::Contains(fs.server.url()) && Catch::Contains("4 rewards for a batch of 5"));
    CHECK(fs.calls == 2);
  }
  SECTION("a reward that is not a number") {
    fault_server fs([](int, const http_request_view&) { return http_reply{200, R"({"rewards": [1, 0, null, 1, 1]})"}; });
    remote_scorer remote{{.url = fs.server.url(), .timeout_s = 2, .retries = 0}};
    CHECK_THROWS_WITH(remote(b), Catch::Contains("reward 2 of the response is not a finite number: null"));
  }
  SECTION("one chunk failing fails the whole batch") {
    fault_server fs([](int, const http_request_view& r) {
      return request_size(r) == 1 ? http_reply{503, R"({"error": "busy"})"} : ones(r);
    });
    remote_scorer remote{{.url = fs.server.url(), .timeout_s = 2, .retries = 0, .chunk_size = 2}};
    CHECK_THROWS_WITH(remote(b), Catch::Contains("HTTP 503") && Catch::Contains("busy"));
  }
  SECTION("connection refused") {
    const auto url = "http://127.0.0.1:" + std::to_string(closed_port()) + "/score";
    remote_scorer remote{{.url = url, .timeout_s = 2, .retries = 2, .backoff_s = 0.05, .backoff_multiplier = 2}};
    const auto t0 = clock_type::now();
    CHECK_THROWS_WITH(remote(b), Catch::Contains(url) && Catch::Contains("connection refused") &&
                                     Catch::Contains("3 attempt(s)"));
    const auto dt = seconds_since(t0);
    CHECK(dt >= 0.05 + 0.1);  // exponential backoff: 0.05 s, then 0.1 s
    CHECK(dt < 2.0);
  }
  SECTION("transient failures are absorbed by the retries") {
    fault_server fs([](int call, const http_request_view& r) {
      return call < 2 ? http_reply{500, R"({"error": "warming up"})"} : ones(r);
    });
    remote_scorer remote{{.url = fs.server.url(), .timeout_s = 2, .retries = 3, .backoff_s = 0.02}};
    CHECK(torch::equal(remote(b), torch::ones({5})));
    CHECK(fs.calls == 3);
    CHECK(remote.attempts() == 3);
  }
}

TEST_CASE("a reward server killed mid-run is reported, not waited for", "[cpu][rewards][remote]") {
  // The server runs in a child process; the test kills it while a request is in flight.
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(fds[0]);
    struct sleepy_exact {
      exact_answer inner;
      torch::Tensor operator()(const json_batch& b) {
        if (!b.prompts.empty() && b.prompts.front() == "slow") std::this_thread::sleep_for(std::chrono::seconds(30));
        return inner(b);
      }
    };
    reward_server server{sleepy_exact{}};
    server.start();
    const std::uint16_t port = server.port();
    if (::write(fds[1], &port, sizeof port) != static_cast<ssize_t>(sizeof port)) ::_exit(1);
    ::close(fds[1]);
    std::this_thread::sleep_for(std::chrono::seconds(60));  // killed long before
    ::_exit(0);
  }
  struct reaper {
    pid_t pid;
    ~reaper() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  } guard{child};
  ::close(fds[1]);
  std::uint16_t port = 0;
  REQUIRE(::read(fds[0], &port, sizeof port) == static_cast<ssize_t>(sizeof port));
  ::close(fds[0]);
  const auto url = "http://127.0.0.1:" + std::to_string(port) + "/score";
  remote_scorer remote{{.url = url, .timeout_s = 10, .retries = 2, .backoff_s = 0.05}};

  text_batch fine{.completions = {"1", "2"}, .references = {"1", "1"}, .prompts = {"a", "b"}};
  CHECK(torch::equal(remote(fine), torch::tensor({1.f, 0.f})));

  text_batch slow{.completions = {"1"}, .references = {"1"}, .prompts = {"slow"}};
  const auto t0 = clock_type::now();
  auto pending = remote.submit(slow);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  REQUIRE(::kill(child, SIGKILL) == 0);
  ::waitpid(child, nullptr, 0);
  guard.pid = 0;
  try {
    pending.get();
    FAIL("expected a runtime_failure");
  } catch (const unirl::runtime_failure& e) {
    // The in-flight request sees the connection close; the retries find nothing listening.
    CHECK_THAT(e.what(), Catch::Contains(url) && Catch::Contains("connection refused") && Catch::Contains("3 attempt(s)"));
  }
  CHECK(seconds_since(t0) < 5.0);  // far below the 10 s timeout: the failure is noticed, not waited out
  CHECK_THROWS_AS(remote(fine), unirl::runtime_failure);
}

namespace {
// The bandit track's answers as text, scored by a remote service: any batch can be sent once it
// is put into the fields a hosted scorer reads.
struct remote_label_reward {
  remote_scorer remote;
  torch::Tensor operator()(const bandit::rollout& b) {
    text_batch t;
    for (std::int64_t i = 0; i < b.size(); ++i) {
      t.completions.push_back(std::to_string(b.actions[i].item<std::int64_t>()));
      t.references.push_back(std::to_string(b.labels[i].item<std::int64_t>()));
    }
    return remote(t);
  }
  std::map<std::string, double> last_components() const { return remote.last_components(); }
};
static_assert(unirl::RewardFor<remote_label_reward, bandit::rollout>);
}  // namespace

TEST_CASE("through the trainer: remote rewards train, and a dead service stops training", "[cpu][rewards][remote]") {
  torch::manual_seed(0);
  auto server = std::make_unique<reward_server<weighted<exact_answer>>>(weighted<exact_answer>{});
  server->start();
  using trainer_t = unirl::trainer<bandit::model, bandit::policy_gradient, remote_label_reward>;
  trainer_t t{bandit::model{bandit::policy_net{}},
              remote_label_reward{remote_scorer{{.url = server->url(), .timeout_s = 5, .retries = 1, .backoff_s = 0.01}}},
              {.optim = {.lr = 1e-2}, .group_size = 4, .progress = false}};
  bandit::prompts in{torch::randn({8, 64}), torch::randint(0, 10, {8}, torch::kInt64)};
  auto s = t.step(in);
  CHECK(s.samples == 32);
  CHECK(s.extra.at("reward/exact_answer") == Approx(s.reward_mean));
  CHECK(s.optimizer_steps == 1);

  // The service goes away: the step fails with the URL and the cause, and no update happens.
  const auto url = server->url();
  server.reset();
  std::vector<torch::Tensor> before;
  for (const auto& p : t.models().policy.parameters()) before.push_back(p.detach().clone());
  CHECK_THROWS_WITH(t.step(in), Catch::Contains(url) && Catch::Contains("connection refused"));
  const auto after = t.models().policy.parameters();
  for (std::size_t k = 0; k < before.size(); ++k) CHECK(torch::equal(before[k], after[k]));
}
