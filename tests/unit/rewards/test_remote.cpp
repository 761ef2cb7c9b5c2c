// The remote reward service against real HTTP servers on 127.0.0.1 (ephemeral ports): the wire
// format, agreement with local scoring, chunking and bounded concurrency, asynchronous scoring,
// and every fault (slow response past the timeout, HTTP 500, malformed JSON, wrong length,
// connection refused, server killed mid-run) retried as configured, then reported with the URL
// and the cause — never a partial or invented reward.
#include <catch2/catch.hpp>

#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/buffers_iterator.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/server.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"
#include "forked_server.hpp"
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

  // The server reads request text straight into a batch (decode_request): the same batch and the
  // same errors as decode_batch on the parsed JSON.
  auto same = [](const json_batch& x, const json_batch& y) {
    CHECK(x.size() == y.size());
    CHECK(x.completions == y.completions);
    CHECK(x.references == y.references);
    CHECK(x.prompts == y.prompts);
    REQUIRE(x.tensors.size() == y.tensors.size());
    for (const auto& [k, t] : x.tensors) {
      CHECK(t.scalar_type() == y.tensors.at(k).scalar_type());
      CHECK(torch::equal(t, y.tensors.at(k)));
    }
  };
  same(decode_request(j.dump()), decode_batch(j));
  for (auto enc : {tensor_encoding::numbers, tensor_encoding::base64}) {
    json_batch mixed;
    mixed.count = 2;
    mixed.completions = {"a", "b"};
    mixed.tensors = {{"images", torch::rand({2, 3})}, {"ids", torch::tensor({7, -1}, torch::kInt64)},
                     {"mask", torch::tensor({true, false})}, {"d", torch::rand({2}, torch::kFloat64)}};
    const auto mj = encode_batch(mixed, enc);
    const auto got = decode_request(mj.dump());
    same(got, decode_batch(mj));
    same(got, mixed);
    CHECK(got.images.defined());
  }
  // Integers then reals in one float tensor; unknown fields (however nested) are skipped.
  same(decode_request(R"({"size": 2, "x": {"a": [1, {"b": [2]}], "c": null}, "completions": ["p", "q"],
                          "tensors": {"t": {"shape": [2], "data": [1, 2.5], "note": [1, 2]}}})"),
       decode_batch(nlohmann::json::parse(R"({"size": 2, "completions": ["p", "q"], "tensors": {"t": {"shape": [2], "data": [1, 2.5]}}})")));
  for (const auto& [text, message] : std::vector<std::pair<std::string, std::string>>{
           {"{", "malformed JSON"},
           {"[1]", "expected a JSON object"},
           {R"({"completions": ["a"]})", "non-negative integer 'size'"},
           {R"({"size": -1})", "non-negative integer 'size'"},
           {R"({"size": "2"})", "non-negative integer 'size'"},
           {R"({"size": 2, "completions": ["a"]})", "'completions' has 1 entries for size 2"},
           {R"({"size": 1, "completions": [3]})", "'completions' must be an array of strings, found 3"},
           {R"({"size": 1, "prompts": "a"})", "'prompts' must be an array of strings"},
           {R"({"size": 2, "tensors": {"images": {"shape": [2, 2], "data": [1, 2, 3]}}})", "3 values for shape [2,2]"},
           {R"({"size": 2, "tensors": {"images": {"shape": [2], "data": [[1], [2]]}}})", "nested array"},
           {R"({"size": 2, "tensors": {"ids": {"dtype": "int64", "shape": [2], "data": [1, 1.5]}}})", "not an integer"},
           {R"({"size": 2, "tensors": {"x": {"dtype": "int8", "shape": [2], "data": [1, 2]}}})", "dtype 'int8'"},
           {R"({"size": 2, "tensors": {"x": {"shape": [2]}}})", "tensor 'x': expected"},
           {R"({"size": 2, "tensors": {"x": {"shape": [4611686018427387904, 4], "data": []}}})", "more elements than an int64"},
           {R"({"size": 3, "tensors": {"x": {"shape": [2], "data": [1, 2]}}})", "expected a leading dimension of size 3"}}) {
    INFO(text);
    CHECK_THROWS_WITH(decode_request(text), Catch::Contains(message));
  }

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
    CHECK_THROWS_WITH(remote(b), Catch::Contains(fs.server.url()) && Catch::Contains("malformed JSON response") &&
                                     Catch::Contains("not retried"));
    CHECK(fs.calls == 1);  // a complete response that breaks the schema would break it again
  }
  SECTION("a response of the wrong length") {
    fault_server fs([](int, const http_request_view& r) {
      return http_reply{200, nlohmann::json{{"rewards", std::vector<double>(request_size(r) - 1, 1.0)}}.dump()};
    });
    remote_scorer remote{{.url = fs.server.url(), .timeout_s = 2, .retries = 1, .backoff_s = 0.01}};
    CHECK_THROWS_WITH(remote(b), Catch::Contains(fs.server.url()) && Catch::Contains("4 rewards for a batch of 5"));
    CHECK(fs.calls == 1);
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

// ---------------------------------------------------------------------------------------------
// Reliability: a misbehaving client must not take the server down or exhaust it, and a
// misbehaving server must not make the client invent rewards, leak its bytes, or retry what
// cannot succeed. Every server here listens on 127.0.0.1; every loop is bounded.

namespace {
// A misbehaving HTTP server of our own, below json_http_server: it reads each request (head and
// Content-Length body), answers with the raw bytes `reply(call_index, port)` gives and closes.
// At most `max_calls` connections are served.
struct raw_server {
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::acceptor acceptor{ioc, {boost::asio::ip::make_address("127.0.0.1"), 0}};
  std::atomic<int> calls{0};
  std::atomic<bool> stopping{false};
  std::thread thread;
  template <class F>
  explicit raw_server(F reply, int max_calls = 50) {
    thread = std::thread([this, reply, max_calls] {
      for (int i = 0; i < max_calls && !stopping; ++i) {
        boost::asio::ip::tcp::socket s(ioc);
        boost::system::error_code ec;
        acceptor.accept(s, ec);
        if (ec || stopping) return;
        boost::asio::streambuf buf;
        const auto head_end = boost::asio::read_until(s, buf, "\r\n\r\n", ec);
        if (ec) continue;
        std::string head(boost::asio::buffers_begin(buf.data()), boost::asio::buffers_begin(buf.data()) + head_end);
        std::size_t length = 0;
        for (auto& c : head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (const auto at = head.find("content-length:"); at != std::string::npos) length = std::stoul(head.substr(at + 15));
        if (buf.size() - head_end < length) boost::asio::read(s, buf, boost::asio::transfer_exactly(length - (buf.size() - head_end)), ec);
        const std::string out = reply(calls++, port());
        boost::asio::write(s, boost::asio::buffer(out), ec);
        s.shutdown(boost::asio::ip::tcp::socket::shutdown_both, ec);
      }
    });
  }
  ~raw_server() {
    stopping = true;
    boost::system::error_code ec;
    boost::asio::io_context poke_ctx;
    boost::asio::ip::tcp::socket poke(poke_ctx);
    poke.connect({boost::asio::ip::make_address("127.0.0.1"), port()}, ec);
    thread.join();
  }
  std::uint16_t port() const { return acceptor.local_endpoint().port(); }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port()) + "/score"; }
};

// A complete HTTP/1.1 response.
std::string response(unsigned status, const std::string& body, const std::string& extra_headers = "") {
  return "HTTP/1.1 " + std::to_string(status) + " X\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n" + extra_headers + "\r\n" + body;
}

std::string ones_body(std::size_t n) { return nlohmann::json{{"rewards", std::vector<double>(n, 1.0)}}.dump(); }

// True when every byte of `s` is printable ASCII.
bool printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

// The message of the runtime_failure `f()` throws ("" when it throws none).
template <class F>
std::string failure_of(F f) {
  try {
    f();
  } catch (const unirl::runtime_failure& e) {
    return e.what();
  }
  return "";
}

using rewards_test::forked_server;
using rewards_test::write_value;

// Threads of this process.
std::size_t thread_count() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Up to `max` bytes a socket receives within `timeout_s` (until the peer closes or the time is up).
std::string receive(boost::asio::ip::tcp::socket& s, double timeout_s, std::size_t max = 1 << 16) {
  std::string out;
  const auto t0 = clock_type::now();
  while (out.size() < max) {
    const double left = timeout_s - seconds_since(t0);
    if (left <= 0) break;
    pollfd p{s.native_handle(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) break;
    char buf[4096];
    const auto n = ::recv(s.native_handle(), buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

// Whether the server closed a connection: its socket reads end-of-stream within `timeout_s`.
bool closed_by_peer(boost::asio::ip::tcp::socket& s, double timeout_s) {
  pollfd p{s.native_handle(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout_s * 1000)) <= 0) return false;
  char c;
  return ::recv(s.native_handle(), &c, 1, 0) <= 0;
}

// Peak resident memory of this process so far, in bytes.
std::int64_t peak_rss() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<std::int64_t>(u.ru_maxrss) * 1024;
}

// The example's format rule (examples/30_reward_server).
const std::string sum_format = R"(\s*-?\d+\s*[-+*]\s*-?\d+\s*=\s*-?\d+\s*)";
}  // namespace

TEST_CASE("a 100 000-character completion neither crashes the reward server nor stops it", "[cpu][rewards][remote]") {
  // Before: std::regex_match recursed once per character on the connection thread and the
  // server died of a stack overflow (SIGSEGV) on one well-formed request.
  forked_server child([](int fd) {
    reward_server server{regex_format{{.pattern = sum_format}}};
    server.start();
    write_value(fd, server.port());
    std::this_thread::sleep_for(std::chrono::seconds(60));  // killed long before
  });
  remote_scorer remote{{.url = child.url(), .timeout_s = 20, .retries = 0}};
  text_batch b{.completions = {"12+30=42", "1+1=" + std::string(100000, '2'), std::string(30000, 'x'), "1+1=" + std::string(30000, ' ') + "x"}};
  torch::Tensor r;
  REQUIRE_NOTHROW(r = remote(b));
  CHECK(torch::equal(r, torch::tensor({1.f, 1.f, 0.f, 0.f})));  // by hand: the first two have the format
  CHECK(child.alive());
  text_batch again{.completions = {"3-5=-2"}};
  CHECK(torch::equal(remote(again), torch::tensor({1.f})));
}

TEST_CASE("a scorer that throws fails its request, never the server, and the client gets one line", "[cpu][rewards][remote]") {
  // Before: a scorer throwing something other than a std::exception ended the process
  // (std::terminate on the connection thread), and a c10::Error's stack trace went to the client.
  struct fragile {
    torch::Tensor operator()(const json_batch& b) {
      if (b.prompts.at(0) == "int") throw 42;
      TORCH_CHECK(b.prompts.at(0) != "c10", "the scorer refused this batch");
      return torch::ones({b.size()});
    }
  };
  forked_server child([](int fd) {
    server_options o;
    o.log_errors = false;
    reward_server server{fragile{}, o};
    server.start();
    write_value(fd, server.port());
    std::this_thread::sleep_for(std::chrono::seconds(60));
  });
  remote_scorer remote{{.url = child.url(), .timeout_s = 10, .retries = 0}};
  const auto with_prompt = [](const std::string& p) { return text_batch{.completions = {"x"}, .prompts = {p}}; };

  const auto c10_message = failure_of([&] { remote(with_prompt("c10")); });
  CHECK_THAT(c10_message, Catch::Contains("HTTP 500") && Catch::Contains("the scorer refused this batch"));
  CHECK_THAT(c10_message, !Catch::Contains("Exception raised from") && !Catch::Contains("frame #"));
  const auto raw = http_post(parse_url(child.url()), R"({"size": 1, "completions": ["x"], "prompts": ["c10"]})", 10);
  CHECK(raw.status == 500);
  CHECK(raw.body.find('\n') == std::string::npos);
  CHECK(nlohmann::json::parse(raw.body)["error"].get<std::string>().find("frame #") == std::string::npos);

  CHECK_THAT(failure_of([&] { remote(with_prompt("int")); }), Catch::Contains("HTTP 500") && Catch::Contains("not a std::exception"));
  REQUIRE(child.alive());
  CHECK(torch::equal(remote(with_prompt("fine")), torch::ones({1})));
}

TEST_CASE("a reward outside float32's range is refused, naming the sample and the URL", "[cpu][rewards][remote]") {
  // Before: isfinite was checked on the double, then it was stored as a float: 1e39 became inf.
  const auto b = sums();
  raw_server fs([](int, std::uint16_t) { return response(200, R"({"rewards": [1, 0.5, 1e39, 0, 1]})"); });
  remote_scorer remote{{.url = fs.url(), .timeout_s = 5, .retries = 2, .backoff_s = 0.01}};
  const auto m = failure_of([&] { remote(b); });
  CHECK_THAT(m, Catch::Contains(fs.url()) && Catch::Contains("reward 2 of the response is 1e+39") &&
                    Catch::Contains("outside the range of float32"));
  CHECK(fs.calls == 1);

  // Chunked: the index is the sample's in the whole batch (chunks of 2: the second holds 2 and 3).
  raw_server chunks([](int call, std::uint16_t) {
    return response(200, call == 1 ? R"({"rewards": [1, -4e38]})" : R"({"rewards": [1, 1]})");
  });
  remote_scorer chunked{{.url = chunks.url(), .timeout_s = 5, .retries = 0, .max_concurrency = 1, .chunk_size = 2}};
  CHECK_THAT(failure_of([&] { chunked(b); }), Catch::Contains("reward 1 of the response is -4e+38 (sample 3 of the batch)"));

  // The largest float32 itself is in range, and arrives exactly.
  raw_server edge([](int, std::uint16_t) { return response(200, R"({"rewards": [3.4028234663852886e38]})"); });
  remote_scorer at_edge{{.url = edge.url(), .timeout_s = 5, .retries = 0}};
  text_batch one{.completions = {"x"}};
  CHECK(at_edge(one).item<float>() == std::numeric_limits<float>::max());
}

TEST_CASE("silent connections hold no threads: the pool is fixed, idle ones time out, 503 beyond the cap",
          "[cpu][rewards][remote]") {
  // Before: a thread per connection and no read timeout: 120 silent connections held 120 threads
  // forever.
  server_options o;
  o.max_connections = 16;
  o.threads = 2;
  o.read_timeout_s = 0.5;
  reward_server server{make_reward(), o};
  server.start();
  const auto b = sums();
  const auto expected = make_reward()(b);
  remote_scorer remote{{.url = server.url(), .timeout_s = 5, .retries = 0}};
  REQUIRE(torch::equal(remote(b), expected));  // warm: every thread this test will see exists
  const auto threads_before = thread_count();

  boost::asio::io_context ioc;
  std::vector<boost::asio::ip::tcp::socket> silent;
  for (int i = 0; i < 120; ++i) {
    silent.emplace_back(ioc);
    silent.back().connect({boost::asio::ip::make_address("127.0.0.1"), server.port()});
    // Every other one sends half a request and stops (a slow or dead client).
    if (i % 2) boost::asio::write(silent.back(), boost::asio::buffer(std::string("POST /score HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"si")));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto threads_during = thread_count();
  CHECK(threads_during <= threads_before + 1);  // fixed pool: 1 I/O + 2 handler threads, started with the server

  // Beyond max_connections the server answers 503 with Retry-After at once (and beyond twice
  // that, while those replies are out, it drops connections at once).
  const auto busy = receive(silent[16], 2.0);
  CHECK_THAT(busy, Catch::StartsWith("HTTP/1.1 503") && Catch::Contains("Retry-After: 1") && Catch::Contains("max_connections"));
  CHECK(closed_by_peer(silent.back(), 2.0));

  // After the read timeout the silent connections are closed and a real request is served.
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  CHECK(closed_by_peer(silent.front(), 1.0));
  CHECK(closed_by_peer(silent[1], 1.0));  // the half-sent one too
  const auto t0 = clock_type::now();
  CHECK(torch::equal(remote(b), expected));
  CHECK(seconds_since(t0) < 1.0);
  CHECK(thread_count() <= threads_before + 1);
  server.stop();
}

TEST_CASE("a body over max_body_bytes gets 413 from its headers, before it is sent", "[cpu][rewards][remote]") {
  // Before: the default limit was 1 GiB, and a 20 MiB request was read (and held) in full.
  CHECK(server_options{}.max_body_bytes == 16 << 20);
  reward_server server{make_reward()};
  server.start();
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::socket s(ioc);
  s.connect({boost::asio::ip::make_address("127.0.0.1"), server.port()});
  const std::string head = "POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                           std::to_string(20 << 20) + "\r\n\r\n";
  boost::asio::write(s, boost::asio::buffer(head + std::string(64 << 10, ' ')));  // 64 KiB of the 20 MiB
  const auto t0 = clock_type::now();
  const auto reply = receive(s, 3.0);
  CHECK_THAT(reply, Catch::StartsWith("HTTP/1.1 413") && Catch::Contains("max_body_bytes"));
  CHECK(seconds_since(t0) < 2.0);

  // The client reports a 413 at once (retrying would send the same body again).
  server_options small;
  small.max_body_bytes = 50;
  reward_server tight{make_reward(), small};
  tight.start();
  remote_scorer remote{{.url = tight.url(), .timeout_s = 5, .retries = 3, .backoff_s = 0.01}};
  CHECK_THAT(failure_of([&] { remote(sums()); }), Catch::Contains("HTTP 413") && Catch::Contains("not retried") &&
                                                       Catch::Contains("chunk_size"));
  CHECK(remote.attempts() == 1);
}

namespace {
// Reads the fields a large request carries: each completion's length, plus the sum of each
// sample's image; so the rewards can be checked by hand.
struct size_scorer {
  torch::Tensor operator()(const json_batch& b) const {
    auto r = torch::zeros({b.size()});
    for (std::size_t i = 0; i < b.completions.size(); ++i) r[static_cast<std::int64_t>(i)] += static_cast<float>(b.completions[i].size());
    if (b.images.defined()) r += b.images.flatten(1).sum(1).to(torch::kFloat32);
    return r;
  }
};
}  // namespace

// Under a sanitizer (CI's TSan build of this file) every allocation carries shadow memory and
// quarantine, so the memory-to-body ratio measures the sanitizer, not the server.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

TEST_CASE("a large request costs the server a small multiple of its body", "[cpu][rewards][remote]") {
  if (kSanitized) {
    WARN("built with a sanitizer: the memory ratio is not measured (shadow memory), the request still is");
  }
  // Before: the body was parsed to a JSON tree (16+ bytes per number) and copied into the batch:
  // a 100 MB request took 2.17 GB. Measured here in a child process hosting the server: the rise
  // of its peak resident memory (getrusage maxrss) while it scores one request, against the body.
  auto measure = [](const text_batch& tb, const image_batch* ib, std::int64_t n, const torch::Tensor& expected) {
    forked_server child([](int fd) {
      server_options o;
      o.max_body_bytes = 256ll << 20;
      reward_server server{size_scorer{}, o};
      server.start();
      const auto before = peak_rss();
      write_value(fd, server.port());
      const auto t0 = clock_type::now();
      while (server.served() < 1 && seconds_since(t0) < 120) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      write_value(fd, peak_rss() - before);
      std::this_thread::sleep_for(std::chrono::seconds(60));
    });
    const std::string body = ib ? encode_batch(*ib).dump() : encode_batch(tb).dump();
    const auto res = http_post(parse_url(child.url()), body, 120);
    REQUIRE(res.status == 200);
    CHECK(torch::allclose(parse_rewards(res.body, n), expected));
    const auto rise = child.read_value<std::int64_t>();
    REQUIRE(rise > 0);
    return std::pair{static_cast<double>(rise), static_cast<double>(body.size())};
  };
  SECTION("text: 48 completions of 1 MiB") {
    text_batch tb;
    for (int i = 0; i < 48; ++i) tb.completions.push_back(std::string((1 << 20) + i, static_cast<char>('a' + i % 26)));
    auto expected = torch::arange(48, torch::kFloat32) + static_cast<float>(1 << 20);
    // The body itself, plus the completions moved out of it: about 2x, with a margin to 2.5x.
    const auto [rise, body] = measure(tb, nullptr, 48, expected);
    INFO("body " << body / 1e6 << " MB, server peak memory rise " << rise / 1e6 << " MB (" << rise / body << "x)");
    if (!kSanitized) CHECK(rise / body < 2.5);
  }
  SECTION("images as JSON numbers: 16 x 1 x 512 x 512 float32") {
    image_batch ib{torch::full({16, 1, 512, 512}, 0.25f) + torch::arange(16, torch::kFloat32).view({16, 1, 1, 1})};
    const auto expected = ib.images.flatten(1).sum(1);
    // 4M numbers of about 5 characters ("0.25,"): the body, 8 bytes of buffer and 4 of tensor per
    // number, about 3.4x; the margin goes to 5x (a JSON tree takes 16-32 bytes per number).
    text_batch none;
    const auto [rise, body] = measure(none, &ib, 16, expected);
    INFO("body " << body / 1e6 << " MB, server peak memory rise " << rise / 1e6 << " MB (" << rise / body << "x)");
    if (!kSanitized) CHECK(rise / body < 5.0);
  }
}

TEST_CASE("the client prints a short escaped excerpt of bytes a server sends, never the bytes", "[cpu][rewards][remote]") {
  const auto b = sums();
  SECTION("a gzip body the client did not ask for") {
    std::string gz("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", 10);  // a gzip header
    for (int i = 0; i < 3000; ++i) gz += static_cast<char>((i * 7919) & 255);
    raw_server fs([gz](int, std::uint16_t) { return response(200, gz, "Content-Encoding: gzip\r\n"); });
    remote_scorer remote{{.url = fs.url(), .timeout_s = 5, .retries = 0}};
    const auto m = failure_of([&] { remote(b); });
    CHECK_THAT(m, Catch::Contains("malformed JSON response") && Catch::Contains("\\x1f\\x8b\\x08"));
    CHECK_THAT(m, Catch::Contains("3010 bytes"));
    CHECK(printable(m));
    CHECK(m.size() < 800);
  }
  SECTION("an error page") {
    const std::string page = "<html>\n<body>" + std::string(5000, 'z') + "</body></html>";
    raw_server fs([page](int, std::uint16_t) { return response(502, page); });
    remote_scorer remote{{.url = fs.url(), .timeout_s = 5, .retries = 0}};
    const auto m = failure_of([&] { remote(b); });
    CHECK_THAT(m, Catch::Contains("HTTP 502") && Catch::Contains("<html>\\n<body>zzz") && Catch::Contains("bytes)"));
    CHECK(printable(m));
    CHECK(m.size() < 800);
  }
}

TEST_CASE("a redirect is reported with its Location, and followed only when asked", "[cpu][rewards][remote]") {
  const auto b = sums();
  raw_server target([](int, std::uint16_t) { return response(200, ones_body(5)); });
  const auto location = target.url();
  raw_server moved([location](int, std::uint16_t) { return response(302, "", "Location: " + location + "\r\n"); });
  remote_scorer remote{{.url = moved.url(), .timeout_s = 5, .retries = 3, .backoff_s = 0.01}};
  const auto m = failure_of([&] { remote(b); });
  CHECK_THAT(m, Catch::Contains("HTTP 302") && Catch::Contains("Location: " + location) && Catch::Contains("not retried") &&
                    Catch::Contains("follow_redirects"));
  CHECK(moved.calls == 1);
  CHECK(target.calls == 0);  // not followed silently

  remote_scorer follows{{.url = moved.url(), .timeout_s = 5, .retries = 0, .follow_redirects = true}};
  CHECK(torch::equal(follows(b), torch::ones({5})));
  CHECK(target.calls == 1);

  // A redirect loop ends after 5 hops.
  raw_server loop([](int, std::uint16_t port) {
    return response(307, "", "Location: http://127.0.0.1:" + std::to_string(port) + "/again\r\n");
  });
  remote_scorer looping{{.url = loop.url(), .timeout_s = 5, .retries = 0, .follow_redirects = true}};
  CHECK_THAT(failure_of([&] { looping(b); }), Catch::Contains("more than 5 redirects"));
  CHECK(loop.calls == 6);
}

TEST_CASE("Retry-After is honoured, within the client's deadline", "[cpu][rewards][remote]") {
  const auto b = sums();
  SECTION("503 with Retry-After: 1, then success") {
    raw_server fs([](int call, std::uint16_t) {
      return call == 0 ? response(503, R"({"error": "warming up"})", "Retry-After: 1\r\n") : response(200, ones_body(5));
    });
    remote_scorer remote{{.url = fs.url(), .timeout_s = 5, .retries = 2, .backoff_s = 0.01}};
    const auto t0 = clock_type::now();
    CHECK(torch::equal(remote(b), torch::ones({5})));
    const auto dt = seconds_since(t0);
    CHECK(dt >= 0.95);  // the server's 1 s, not the 0.01 s backoff
    CHECK(dt < 3.0);
    CHECK(fs.calls == 2);
  }
  SECTION("a Retry-After past the deadline fails at once") {
    raw_server fs([](int, std::uint16_t) { return response(429, R"({"error": "slow down"})", "Retry-After: 30\r\n"); });
    remote_scorer remote{{.url = fs.url(), .timeout_s = 5, .retries = 5, .backoff_s = 0.01, .deadline_s = 2}};
    const auto t0 = clock_type::now();
    CHECK_THAT(failure_of([&] { remote(b); }), Catch::Contains("HTTP 429") && Catch::Contains("slow down") &&
                                                    Catch::Contains("Retry-After 30 s") && Catch::Contains("deadline_s = 2"));
    CHECK(seconds_since(t0) < 1.0);
    CHECK(fs.calls == 1);
  }
  SECTION("retries end at the deadline, however many are allowed") {
    raw_server fs([](int, std::uint16_t) { return response(500, R"({"error": "down"})"); }, 1000);
    remote_scorer remote{{.url = fs.url(), .timeout_s = 5, .retries = 1000, .backoff_s = 0.05, .backoff_multiplier = 1,
                          .deadline_s = 0.5}};
    const auto t0 = clock_type::now();
    CHECK_THAT(failure_of([&] { remote(b); }), Catch::Contains("HTTP 500") && Catch::Contains("deadline_s = 0.5"));
    CHECK(seconds_since(t0) < 1.0);
    CHECK(fs.calls < 15);
  }
  SECTION("HTTP-date form") {
    CHECK(unirl::rewards::detail::parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0);  // in the past
    const auto in_2_min = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now() + std::chrono::seconds(120));
    char text[64];
    std::tm tm{};
    ::gmtime_r(&in_2_min, &tm);
    std::strftime(text, sizeof text, "%a, %d %b %Y %H:%M:%S GMT", &tm);
    CHECK(*unirl::rewards::detail::parse_retry_after(text) == Approx(120).margin(2));
    CHECK(unirl::rewards::detail::parse_retry_after(" 7 ") == 7.0);
    CHECK(!unirl::rewards::detail::parse_retry_after("soon"));
  }
}

TEST_CASE("deterministic failures fail at once, while 408, 429 and 5xx are retried", "[cpu][rewards][remote]") {
  const auto b = sums();
  auto calls_for = [&](unsigned status, const std::string& body) {
    raw_server fs([status, body](int, std::uint16_t) { return response(status, body); });
    remote_scorer remote{{.url = fs.url(), .timeout_s = 5, .retries = 2, .backoff_s = 0.01}};
    const auto m = failure_of([&] { remote(b); });
    CHECK_THAT(m, Catch::Contains(fs.url()));
    return std::pair{fs.calls.load(), m};
  };
  for (unsigned status : {400u, 401u, 404u, 405u, 422u}) {
    const auto [calls, m] = calls_for(status, R"({"error": "no"})");
    INFO("HTTP " << status);
    CHECK(calls == 1);
    CHECK_THAT(m, Catch::Contains("HTTP " + std::to_string(status)) && Catch::Contains("not retried"));
  }
  for (unsigned status : {408u, 429u, 500u, 503u}) {
    INFO("HTTP " << status);
    CHECK(calls_for(status, R"({"error": "later"})").first == 3);
  }
  // A renamed or missing field is the server speaking another schema: at once.
  const auto [renamed_calls, renamed] = calls_for(200, R"({"reward": [1, 1, 1, 1, 1]})");
  CHECK(renamed_calls == 1);
  CHECK_THAT(renamed, Catch::Contains("no \"rewards\" array") && Catch::Contains("not retried"));
}
