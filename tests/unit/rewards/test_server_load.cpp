// The reward server under hostile load, from another process: the server runs in a forked child,
// this process opens real sockets to it on 127.0.0.1 — idle and slow (one byte a second)
// connections by the hundred while ordinary requests are timed, a burst of 1,000 concurrent
// requests, deadlines on a head and on a slow body, SIGTERM while requests are held — and reads
// the child's threads, resident memory and open files from /proc/<pid>/status and /proc/<pid>/fd
// before, during and after. In process: the request reader's deadlines and limits, the queue
// bound (503 only past it), the body budget, pipelining. docs/reliability.md quotes the figures.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <arpa/inet.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include <unirl/rewards/http_reader.hpp>
#include <unirl/rewards/http_server.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/server.hpp>

#include "forked_server.hpp"

namespace server_load {
using namespace unirl::rewards;
using steady = std::chrono::steady_clock;

double since(steady::time_point t0) { return std::chrono::duration<double>(steady::now() - t0).count(); }

// 1 where the completion equals the reference, else 0: checkable by hand.
struct equal_scorer {
  double delay_s = 0;
  torch::Tensor operator()(const json_batch& b) const {
    if (delay_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
    auto r = torch::zeros({b.size()});
    for (std::size_t i = 0; i < b.completions.size(); ++i)
      if (b.completions[i] == b.references.at(i)) r[static_cast<std::int64_t>(i)] = 1.0f;
    return r;
  }
};

const std::string body = R"({"size": 2, "completions": ["42", "41"], "references": ["42", "42"]})";

std::string post_request(const std::string& b = body) {
  return "POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
         "Content-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
}

// A reward server in a forked child; killed with the object. With `until_signal` it serves
// until SIGINT / SIGTERM (serve_until_signal) and exits 0 for SIGTERM.
struct child_server : rewards_test::forked_server {
  child_server(server_options o, equal_scorer scorer = {}, bool until_signal = false)
      : forked_server([o, scorer, until_signal](int fd) mutable {
          o.log_errors = false;
          reward_server server{scorer, o};
          server.start();
          rewards_test::write_value(fd, server.port());
          if (!until_signal)
            for (;;) ::pause();
          if (serve_until_signal(server) != SIGTERM) throw std::runtime_error("stopped, but not by SIGTERM");
        }) {}
  // From /proc/<pid>/status: "Threads" or "VmRSS" (kB).
  std::int64_t status_field(const std::string& key) const {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
    return -1;
  }
  std::int64_t threads() const { return status_field("Threads"); }
  std::int64_t rss_kb() const { return status_field("VmRSS"); }
  std::int64_t open_files() const {
    std::int64_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) ++n;
    return n;
  }
  // The child's open files once the count has held still for 200 ms (at most 5 s): the sockets of
  // requests just answered are closed on the server's side a moment after the client has read
  // the response, later still on a loaded machine, and a baseline counting them is never reached again.
  std::int64_t settled_open_files() const {
    const auto t0 = steady::now();
    auto last = open_files();
    auto since_change = steady::now();
    while (since(t0) < 5.0 && since(since_change) < 0.2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const auto f = open_files();
      if (f != last) {
        last = f;
        since_change = steady::now();
      }
    }
    return last;
  }
  // Waits until the child has `n` files open or fewer (`at_least`: n or more); whether it did.
  bool wait_open_files(std::int64_t n, bool at_least, double timeout_s) const {
    const auto t0 = steady::now();
    while (since(t0) < timeout_s) {
      const auto f = open_files();
      if (at_least ? f >= n : f <= n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
};

// This process may open `n` files (the soft limit raised up to the hard one).
void allow_files(rlim_t n) {
  rlimit r{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &r) == 0);
  if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < n) {
    r.rlim_cur = r.rlim_max == RLIM_INFINITY ? n : std::min(n, r.rlim_max);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &r) == 0);
  }
  REQUIRE((r.rlim_cur == RLIM_INFINITY || r.rlim_cur >= n));
}

// A non-blocking TCP socket connecting to 127.0.0.1:port (the connect may still be in progress).
int open_socket(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  REQUIRE((rc == 0 || errno == EINPROGRESS));
  return fd;
}

// Whether the peer has closed `fd` (end of stream or reset) by now, without waiting.
bool peer_closed(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  char c;
  const auto n = ::recv(fd, &c, 1, MSG_PEEK);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

// Many connections, each sending `out` and reading until the server closes: one poll loop.
struct exchange {
  int fd = -1;
  std::string out, in;
  std::size_t sent = 0;
  double started = 0, finished = -1;  // seconds from the run's start
  unsigned status() const { return in.size() >= 12 && in.rfind("HTTP/1.", 0) == 0 ? std::stoul(in.substr(9, 3)) : 0; }
};

void run_exchanges(std::vector<exchange>& xs, std::uint16_t port, double timeout_s) {
  const auto t0 = steady::now();
  for (auto& x : xs) {
    x.fd = open_socket(port);
    x.started = since(t0);
  }
  std::size_t open = xs.size();
  std::vector<pollfd> ps;
  std::vector<std::size_t> idx;
  while (open > 0 && since(t0) < timeout_s) {
    ps.clear();
    idx.clear();
    for (std::size_t i = 0; i < xs.size(); ++i) {
      if (xs[i].finished >= 0) continue;
      ps.push_back({xs[i].fd, static_cast<short>(xs[i].sent < xs[i].out.size() ? POLLOUT : POLLIN), 0});
      idx.push_back(i);
    }
    if (::poll(ps.data(), ps.size(), 100) <= 0) continue;
    for (std::size_t k = 0; k < ps.size(); ++k) {
      if (!ps[k].revents) continue;
      auto& x = xs[idx[k]];
      if (x.sent < x.out.size()) {
        const auto n = ::send(x.fd, x.out.data() + x.sent, x.out.size() - x.sent, MSG_NOSIGNAL);
        if (n > 0) x.sent += static_cast<std::size_t>(n);
        else if (errno != EAGAIN && errno != EINPROGRESS) x.finished = since(t0), --open;
        continue;
      }
      char buf[4096];
      const auto n = ::recv(x.fd, buf, sizeof buf, 0);
      if (n > 0) {
        x.in.append(buf, static_cast<std::size_t>(n));
      } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
        x.finished = since(t0);
        --open;
      }
    }
  }
  for (auto& x : xs) ::close(x.fd);
}

// A count or duration from the environment (scripts/load-soak.sh sets larger ones), else `dflt`.
double env_or(const char* name, double dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::stod(v) : dflt;
}

// `n` scoring requests at once, each on its own connection, run to the end.
std::vector<exchange> concurrent_requests(std::uint16_t port, int n, double timeout_s) {
  std::vector<exchange> xs(static_cast<std::size_t>(n));
  for (auto& x : xs) x.out = post_request();
  run_exchanges(xs, port, timeout_s);
  return xs;
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

// `n` ordinary requests one after another (each a new connection, as remote_scorer makes them):
// their latencies in seconds; every reply must be 200 with the right rewards.
std::vector<double> ordinary_requests(const std::string& url, int n) {
  std::vector<double> lat;
  const auto u = parse_url(url);
  const auto expected = torch::tensor({1.0f, 0.0f});
  for (int i = 0; i < n; ++i) {
    const auto t0 = steady::now();
    const auto r = http_post(u, body, 5.0);
    lat.push_back(since(t0));
    REQUIRE(r.status == 200);
    REQUIRE(torch::equal(parse_rewards(r.body, 2), expected));
  }
  return lat;
}
}  // namespace server_load

TEST_CASE("idle and slow connections by the hundred deny no one: requests are answered at full rate", "[cpu][rewards][server]") {
  using namespace server_load;
  const int held = static_cast<int>(env_or("UNIRL_LOAD_CONNECTIONS", 1000)), idle = held / 2, slow = held - idle;
  const double hold_s = env_or("UNIRL_LOAD_HOLD_S", 0);  // 0: for 200 requests
  allow_files(static_cast<rlim_t>(2 * held + 256));
  server_options o;  // the defaults: 4096 connections, a 10 s head deadline
  if (hold_s > 0) o.read_timeout_s = hold_s + 10;  // the soak holds them longer
  child_server server{o};
  const auto warm = ordinary_requests(server.url(), 50);
  const auto threads0 = server.threads(), rss0 = server.rss_kb(), files0 = server.settled_open_files();
  const auto before = ordinary_requests(server.url(), 100);

  std::vector<int> hostile;
  for (int i = 0; i < idle + slow; ++i) hostile.push_back(open_socket(server.port));
  REQUIRE(server.wait_open_files(files0 + idle + slow, true, 10.0));  // all accepted and held
  // The slow ones send a request head one byte a second, from another thread, all along.
  std::atomic<bool> stop_slow{false};
  std::thread trickle([&] {
    const std::string head = "POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n";
    for (std::size_t at = 0; !stop_slow && at < head.size(); ++at) {
      for (int i = idle; i < idle + slow; ++i) (void)!::send(hostile[static_cast<std::size_t>(i)], &head[at], 1, MSG_NOSIGNAL);
      for (int t = 0; t < 100 && !stop_slow; ++t) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto threads1 = server.threads(), rss1 = server.rss_kb(), files1 = server.open_files();
  std::vector<double> during = ordinary_requests(server.url(), 200);
  for (const auto t1 = steady::now(); since(t1) < hold_s;) {
    const auto more = ordinary_requests(server.url(), 100);
    during.insert(during.end(), more.begin(), more.end());
  }
  int still_open = 0;
  for (int fd : hostile) still_open += peer_closed(fd) ? 0 : 1;
  stop_slow = true;
  trickle.join();
  for (int fd : hostile) ::close(fd);
  REQUIRE(server.wait_open_files(files0, false, 5.0));  // every hostile connection is gone
  const auto threads2 = server.threads(), rss2 = server.rss_kb();
  (void)warm;

  const double p50 = percentile(before, 0.5), p99 = percentile(during, 0.99);
  WARN("idle + slow connections held: " << still_open << " of " << idle + slow << "; requests: 100 before, "
       << during.size() << " during, all 200; latency p50 before " << p50 * 1e3 << " ms, during p50 " << percentile(during, 0.5) * 1e3 << " ms, p99 "
       << p99 * 1e3 << " ms, max " << percentile(during, 1.0) * 1e3 << " ms; server threads " << threads0 << " / "
       << threads1 << " / " << threads2 << ", RSS " << rss0 / 1024 << " / " << rss1 / 1024 << " / " << rss2 / 1024
       << " MiB (before / during / after), files " << files0 << " / " << files1);
  CHECK(still_open == idle + slow);          // held, not dropped: no deadline passed (10 s)
  CHECK(p99 < 0.5);                          // a slot never waits for an idle peer
  CHECK(threads1 == threads0);               // a fixed pool: no thread per connection
  CHECK(threads2 == threads0);
  CHECK(rss1 - rss0 < held * 16);            // under 16 KiB per held connection
  CHECK(rss2 - rss0 < 8 * 1024);             // and back (allocator slack aside)
}

TEST_CASE("a burst of 1,000 concurrent requests is queued and answered, none refused", "[cpu][rewards][server]") {
  using namespace server_load;
  const int burst = static_cast<int>(env_or("UNIRL_LOAD_BURST", 1000));
  allow_files(static_cast<rlim_t>(2 * burst + 256));
  server_options o;  // queue_depth 1024, 4 handler threads
  o.queue_depth = std::max<std::int64_t>(o.queue_depth, burst);  // the soak's larger bursts
  child_server server{o};
  (void)ordinary_requests(server.url(), 20);
  const auto threads0 = server.threads(), files0 = server.settled_open_files();
  const auto t0 = steady::now();
  const auto xs = concurrent_requests(server.port, burst, 30.0);
  const double wall = since(t0);
  const auto threads1 = server.threads();
  int ok = 0, busy = 0, other = 0;
  std::vector<double> lat;
  for (const auto& x : xs) {
    const auto s = x.status();
    if (s == 200 && x.in.find(R"({"rewards":[1.0,0.0]})") != std::string::npos) ++ok;
    else if (s == 503) ++busy;
    else ++other;
    if (x.finished >= 0) lat.push_back(x.finished - x.started);
  }
  WARN("burst of " << burst << ": " << ok << " answered 200, " << busy << " 503, " << other << " other, in " << wall
       << " s; latency p50 " << percentile(lat, 0.5) * 1e3 << " ms, p99 " << percentile(lat, 0.99) * 1e3 << " ms, max "
       << percentile(lat, 1.0) * 1e3 << " ms; server threads " << threads0 << " / " << threads1);
  CHECK(ok == burst);
  CHECK(busy == 0);
  CHECK(threads1 == threads0);
  CHECK(server.wait_open_files(files0, false, 5.0));
}

TEST_CASE("deadlines: a head within read_timeout_s whatever trickles in, a body at min_body_rate", "[cpu][rewards][server]") {
  using namespace server_load;
  server_options o;
  o.read_timeout_s = 1.0;
  o.min_body_rate = 200;
  child_server server{o};
  const std::string padded = R"({"size": 2, "completions": ["42", "41"], "references": ["42", "42"])" + std::string(1400, ' ') + "}";
  const std::string full = post_request(padded);
  const std::size_t head_end = full.find("\r\n\r\n") + 4;
  struct peer {
    int fd;
    std::string plan;     // bytes to send, `rate` per second from the start (all at once: 0)
    double rate;
    std::size_t sent = 0;
    double closed_at = -1;
    std::string in;
  };
  std::vector<peer> ps;
  ps.push_back({open_socket(server.port), "", 0});                                       // idle
  ps.push_back({open_socket(server.port), full.substr(0, head_end), 5});                 // head, 5 bytes/s
  ps.push_back({open_socket(server.port), full, 20});                                    // body at 20 B/s < 200
  ps.push_back({open_socket(server.port), full, 1000});                                  // 1.5 s at 1000 B/s > 200
  const auto t0 = steady::now();
  while (since(t0) < 4.0) {
    const double t = since(t0);
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto& p = ps[i];
      if (p.closed_at >= 0) continue;
      // peer 2 and 3 send their head at once, then the body at their rate
      const std::size_t due = p.rate == 0 ? 0
                              : i == 1      ? std::min(p.plan.size(), static_cast<std::size_t>(t * p.rate) + 1)
                                            : std::min(p.plan.size(), head_end + static_cast<std::size_t>(t * p.rate));
      if (p.sent < due) {
        const auto n = ::send(p.fd, p.plan.data() + p.sent, due - p.sent, MSG_NOSIGNAL);
        if (n > 0) p.sent += static_cast<std::size_t>(n);
      }
      char buf[4096];
      const auto n = ::recv(p.fd, buf, sizeof buf, 0);
      if (n > 0) p.in.append(buf, static_cast<std::size_t>(n));
      else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) p.closed_at = t;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& p : ps) ::close(p.fd);
  WARN("closed at (s): idle " << ps[0].closed_at << ", head at 5 B/s " << ps[1].closed_at << " (" << ps[1].sent
       << " bytes sent), body at 20 B/s " << ps[2].closed_at << ", body at 1000 B/s " << ps[3].closed_at << " (answered "
       << ps[3].in.substr(0, 12) << ")");
  // By hand: the head deadline is 1 s from the connection, bytes do not extend it; the slow body's
  // deadline is head + 1 s + received / 200 B/s: at 20 B/s, 1 + 0.1 t = t, t = 1.11 s.
  CHECK((ps[0].closed_at > 0.9 && ps[0].closed_at < 1.6));
  CHECK((ps[1].closed_at > 0.9 && ps[1].closed_at < 1.6));
  CHECK(ps[1].in.empty());
  CHECK((ps[2].closed_at > 1.0 && ps[2].closed_at < 1.8));
  CHECK(ps[2].in.empty());
  // Above the minimum rate a body may take longer than read_timeout_s: answered.
  CHECK_THAT(ps[3].in, Catch::StartsWith("HTTP/1.1 200") && Catch::Contains(R"({"rewards":[1.0,0.0]})"));
  CHECK(ps[3].closed_at > 1.3);
}

TEST_CASE("SIGTERM: the server stops accepting, answers what it holds and exits 0; a second signal exits at once",
          "[cpu][rewards][server]") {
  using namespace server_load;
  SECTION("one signal") {
    server_options o;
    o.threads = 1;
    child_server server{o, equal_scorer{.delay_s = 0.3}, true};
    std::vector<exchange> xs(3);
    for (auto& x : xs) x.out = post_request();
    std::thread killer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(150));  // all three are held: one scored, two queued
      ::kill(server.pid, SIGTERM);
    });
    const auto t0 = steady::now();
    run_exchanges(xs, server.port, 10.0);
    killer.join();
    for (const auto& x : xs) CHECK_THAT(x.in, Catch::StartsWith("HTTP/1.1 200") && Catch::Contains(R"({"rewards":[1.0,0.0]})"));
    const int st = server.wait_exit(5.0);
    INFO("wait status " << st << " after " << since(t0) << " s");
    CHECK((st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0));
    CHECK(since(t0) < 3.0);  // three requests of 0.3 s, then out
  }
  SECTION("a second signal while it drains") {
    server_options o;
    o.threads = 1;
    child_server server{o, equal_scorer{.delay_s = 5.0}, true};
    std::vector<exchange> xs(1);
    xs[0].out = post_request();
    std::thread client([&] { run_exchanges(xs, server.port, 10.0); });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the request is being scored (5 s)
    const auto t0 = steady::now();
    ::kill(server.pid, SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::kill(server.pid, SIGTERM);
    const int st = server.wait_exit(3.0);
    client.join();
    INFO("wait status " << st << " after " << since(t0) << " s");
    CHECK((st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGTERM));
    CHECK(since(t0) < 2.0);  // long before the 5 s request would end
  }
}

TEST_CASE("503 only past queue_depth, with Retry-After; the body budget and head limit hold", "[cpu][rewards][server]") {
  using namespace server_load;
  SECTION("queue bound") {
    // One handler thread, each request 0.3 s, a queue of 4: of 10 at once, one runs and 4 wait
    // (give or take the one the handler takes while they arrive), the rest are told to retry.
    server_options o;
    o.threads = 1;
    o.queue_depth = 4;
    reward_server server{equal_scorer{.delay_s = 0.3}, o};
    server.start();
    int ok = 0, busy = 0;
    for (const auto& x : concurrent_requests(server.port(), 10, 10.0)) {
      if (x.status() == 200) ++ok;
      if (x.status() == 503) {
        ++busy;
        CHECK_THAT(x.in, Catch::Contains("Retry-After: 1") && Catch::Contains("queue_depth"));
      }
    }
    CHECK(ok + busy == 10);
    CHECK((ok >= 4 && ok <= 6));
    // A queue deep enough for the burst: all answered.
    o.queue_depth = 16;
    reward_server deep{equal_scorer{.delay_s = 0.05}, o};
    deep.start();
    for (const auto& y : concurrent_requests(deep.port(), 10, 10.0)) CHECK(y.status() == 200);
  }
  SECTION("body budget") {
    server_options o;
    o.max_body_bytes = 600;
    o.max_body_bytes_total = 1000;
    reward_server server{equal_scorer{}, o};
    server.start();
    const std::string head = "POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 600\r\n\r\n";
    const int first = open_socket(server.port());
    pollfd p{first, POLLOUT, 0};
    ::poll(&p, 1, 1000);
    REQUIRE(::send(first, head.data(), head.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(head.size()));
    const auto t0 = steady::now();
    while (server.http().body_bytes_held() < 600 && since(t0) < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(server.http().body_bytes_held() == 600);
    std::vector<exchange> xs(1);
    xs[0].out = head + std::string(600, ' ');
    run_exchanges(xs, server.port(), 5.0);
    CHECK_THAT(xs[0].in, Catch::StartsWith("HTTP/1.1 503") && Catch::Contains("max_body_bytes_total") &&
                             Catch::Contains("Retry-After: 1"));
    ::close(first);
    const auto t1 = steady::now();
    while (server.http().body_bytes_held() > 0 && since(t1) < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(server.http().body_bytes_held() == 0);  // given back with the connection
  }
  SECTION("head limit and pipelining") {
    reward_server server{equal_scorer{}, server_options{.max_header_bytes = 1024}};
    server.start();
    std::vector<exchange> xs(2);
    xs[0].out = "GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(2000, 'a') + "\r\n\r\n";
    // three requests in one write on one connection: three answers, in order
    const std::string keep = "POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    xs[1].out = keep + "GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post_request();
    run_exchanges(xs, server.port(), 5.0);
    CHECK_THAT(xs[0].in, Catch::StartsWith("HTTP/1.1 431") && Catch::Contains("max_header_bytes = 1024"));
    const auto first = xs[1].in.find(R"({"rewards":[1.0,0.0]})"), health = xs[1].in.find(R"({"status": "ok"})"),
               last = xs[1].in.rfind(R"({"rewards":[1.0,0.0]})");
    CHECK((first != std::string::npos && health != std::string::npos && first < health && health < last));
  }
  SECTION("Expect: 100-continue is answered before the body is sent") {
    reward_server server{equal_scorer{}};
    server.start();
    const int fd = open_socket(server.port());
    pollfd p{fd, POLLOUT, 0};
    ::poll(&p, 1, 1000);
    const std::string head = "POST /score HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: " +
                             std::to_string(body.size()) + "\r\n\r\n";
    REQUIRE(::send(fd, head.data(), head.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(head.size()));
    std::string in;
    auto receive_until = [&](const std::string& what) {
      const auto t0 = steady::now();
      while (in.find(what) == std::string::npos && since(t0) < 2) {
        pollfd q{fd, POLLIN, 0};
        char buf[256];
        if (::poll(&q, 1, 50) <= 0) continue;
        const auto n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        in.append(buf, static_cast<std::size_t>(n));
      }
      return since(t0);
    };
    CHECK(receive_until("\r\n\r\n") < 0.5);  // not a client's 1 s wait
    CHECK(in == "HTTP/1.1 100 Continue\r\n\r\n");
    REQUIRE(::send(fd, body.data(), body.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(body.size()));
    receive_until(R"({"rewards":[1.0,0.0]})");
    CHECK_THAT(in, Catch::Contains("HTTP/1.1 200") && Catch::EndsWith(R"({"rewards":[1.0,0.0]})"));
    ::close(fd);
  }
}

TEST_CASE("the request reader: deadlines by hand, limits, and the same request however the bytes are split", "[cpu][rewards][server]") {
  using namespace unirl::rewards;
  using namespace std::chrono_literals;
  const auto t0 = std::chrono::steady_clock::time_point{} + 100s;
  const http_read_limits lim{.max_header_bytes = 512, .max_body_bytes = 1000, .header_timeout = 2s, .min_body_rate = 100};
  SECTION("the head deadline does not move with bytes") {
    http_request_reader r{lim};
    r.start(t0);
    CHECK(r.deadline() == t0 + 2s);
    r.feed("POST /score HTTP/1.1\r\n", t0 + 1s);
    CHECK(r.deadline() == t0 + 2s);
    CHECK(!r.expire(t0 + 1999ms));
    CHECK(r.expire(t0 + 2s));
    CHECK(r.state() == http_read_state::timed_out);
  }
  SECTION("the body deadline: head + grace + bytes / rate, and no silence longer than the grace") {
    http_request_reader r{lim};
    r.start(t0);
    r.feed("POST /score HTTP/1.1\r\nContent-Length: 900\r\n\r\n", t0 + 1s);
    REQUIRE(r.state() == http_read_state::body);
    CHECK(r.content_length() == 900u);
    CHECK(r.deadline() == t0 + 3s);                   // 1 s + 2 s of grace
    r.feed(std::string(50, 'x'), t0 + 2s);             // 50 bytes: 0.5 s more at 100 B/s
    CHECK(r.deadline() == t0 + 3500ms);
    r.feed(std::string(400, 'x'), t0 + 2500ms);        // 450 in all: 1 + 2 + 4.5 = 7.5 s, but silence: 2.5 + 2
    CHECK(r.deadline() == t0 + 4500ms);
    r.feed(std::string(450, 'x'), t0 + 4s);
    CHECK(r.state() == http_read_state::complete);
    CHECK(r.take().body().size() == 900);
  }
  SECTION("limits") {
    http_request_reader big{lim};
    big.start(t0);
    big.feed("POST /score HTTP/1.1\r\nContent-Length: 1001\r\n\r\n", t0);
    CHECK(big.state() == http_read_state::refused);
    CHECK(big.status() == 413);
    http_request_reader head{lim};
    head.start(t0);
    head.feed("GET / HTTP/1.1\r\n", t0);
    for (int i = 0; i < 40 && head.reading(); ++i) head.feed("X-Header-Field: abcdefgh\r\n", t0);  // 26 bytes each
    CHECK(head.state() == http_read_state::refused);
    CHECK(head.status() == 431);
    CHECK(head.buffered() == 0);
    http_request_reader bad{lim};
    bad.start(t0);
    bad.feed("GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n", t0);
    CHECK(bad.status() == 400);
    CHECK_THAT(bad.reason(), Catch::Contains("malformed HTTP request"));
  }
  SECTION("one byte at a time parses as all at once, and a pipelined request follows") {
    const std::string two = "POST /a?x=1 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\n ok\r\n0\r\n\r\n"
                            "GET /health HTTP/1.0\r\n\r\n";
    http_request_reader r{lim};
    r.start(t0);
    std::size_t fed = 0;
    while (r.reading() && fed < two.size()) r.feed(two.substr(fed++, 1), t0);
    REQUIRE(r.state() == http_read_state::complete);
    const auto a = r.take();
    CHECK(a.target() == "/a?x=1");
    CHECK(a.body() == "hello ok");
    r.start(t0);
    r.feed(two.substr(fed), t0);
    REQUIRE(r.state() == http_read_state::complete);
    const auto b = r.take();
    CHECK(b.target() == "/health");
    CHECK(b.version() == 10);
  }
  SECTION("the peer closing") {
    http_request_reader r{lim};
    r.start(t0);
    r.end_of_input();
    CHECK(r.state() == http_read_state::closed);
    http_request_reader half{lim};
    half.start(t0);
    half.feed("POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", t0);
    half.end_of_input();
    CHECK(half.state() == http_read_state::closed);
  }
}
