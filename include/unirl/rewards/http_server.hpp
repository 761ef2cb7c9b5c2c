#pragma once
/// \file http_server.hpp
/// The HTTP/1.1 JSON server under `reward_server` (server.hpp): an event loop reads every
/// connection with deadlines, a bounded queue of parsed requests feeds a fixed pool of handler
/// threads. No LibTorch here.
///
/// ```cpp
/// unirl::rewards::json_http_server server{
///     [](const unirl::rewards::http_request_view& r) { return unirl::rewards::http_reply{200, R"({"ok": true})"}; },
///     {.port = 8000}};
/// server.start();                                   // serves on background threads
/// return unirl::rewards::serve_until_signal(server) ? 0 : 1;   // SIGINT / SIGTERM: drain, then 0
/// ```
/// How it holds under hostile load (docs/rewards.md, "Server limits"; docs/reliability.md):
/// - an idle or slow connection holds no thread: it costs a socket and a small record on the
///   event loop, and is closed when its request head is not in within `read_timeout_s` (idle
///   keep-alive time included) or its body falls below `min_body_rate` bytes per second;
/// - a parsed request waits in a queue of at most `queue_depth` for one of `threads` handlers;
///   past that bound (and only then) it is answered 503 with `Retry-After: 1`;
/// - memory is bounded: per connection the head (`max_header_bytes`) and body (`max_body_bytes`),
///   in all the bodies being read, queued or handled (`max_body_bytes_total`), and the number of
///   connections (`max_connections`, checked against `RLIMIT_NOFILE` at start).
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <boost/hana.hpp>
#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/http_reader.hpp>

namespace unirl::rewards {

/// Options of the servers (see the file comment; docs/rewards.md has the memory arithmetic).
struct server_options {
  std::string host = "127.0.0.1";            // address to listen on ("0.0.0.0": every interface)
  std::int64_t port = 0;                     // 0: an ephemeral port, read it back with port()
  std::string path = "/score";               // the scoring endpoint
  std::int64_t max_body_bytes = 16ll << 20;  // larger requests are refused (413) from their headers; raise it for big image batches
  std::int64_t max_header_bytes = 16 << 10;  // request line + header fields; larger: 431
  std::int64_t max_body_bytes_total = 1ll << 30;  // bodies being read, queued or handled, all connections together (at least max_body_bytes); beyond: 503
  std::int64_t max_connections = 4096;       // open connections at once (capped by RLIMIT_NOFILE); beyond: 503 + Retry-After
  std::int64_t queue_depth = 1024;           // parsed requests waiting for a handler thread; beyond: 503 + Retry-After
  std::int64_t threads = 4;                  // handler threads (a fixed pool)
  std::int64_t io_threads = 1;               // event-loop threads: accept, read, parse, write
  double read_timeout_s = 10.0;              // a request's head within this (idle keep-alive time included), else the connection is closed
  double min_body_rate = 1024;               // body bytes per second on average after read_timeout_s of grace, else the connection is closed
  double write_timeout_s = 30.0;             // a whole response within this, else the connection is closed
  double drain_timeout_s = 30.0;             // stop(): how long the requests held may take to finish before they are dropped
  bool log_errors = true;                    // print a failed request's full error (stack trace too) to stderr

  void validate(const std::string& prefix) const {
    options::require(port >= 0 && port <= 65535, prefix + "port", port, "in [0, 65535]");
    options::require(!path.empty() && path.front() == '/', prefix + "path", path, "a path starting with '/'");
    options::require(max_body_bytes > 0, prefix + "max_body_bytes", max_body_bytes, "> 0");
    options::require(max_header_bytes >= 256 && max_header_bytes <= (1 << 30), prefix + "max_header_bytes",
                     max_header_bytes, "in [256, 2^30]");
    options::require(max_body_bytes_total > 0, prefix + "max_body_bytes_total", max_body_bytes_total, "> 0");
    options::require(max_connections >= 1 && max_connections <= (1 << 24), prefix + "max_connections",
                     max_connections, "in [1, 2^24]");
    options::require(queue_depth >= 1, prefix + "queue_depth", queue_depth, ">= 1");
    options::require(threads >= 1 && threads <= 1024, prefix + "threads", threads, "in [1, 1024]");
    options::require(io_threads >= 1 && io_threads <= 64, prefix + "io_threads", io_threads, "in [1, 64]");
    options::require(read_timeout_s > 0, prefix + "read_timeout_s", read_timeout_s, "> 0");
    options::require(min_body_rate > 0, prefix + "min_body_rate", min_body_rate, "> 0 (bytes per second)");
    options::require(write_timeout_s > 0, prefix + "write_timeout_s", write_timeout_s, "> 0");
    options::require(drain_timeout_s >= 0, prefix + "drain_timeout_s", drain_timeout_s, ">= 0");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::server_options, host, port, path, max_body_bytes, max_header_bytes,
                        max_body_bytes_total, max_connections, queue_depth, threads, io_threads, read_timeout_s,
                        min_body_rate, write_timeout_s, drain_timeout_s, log_errors);
namespace unirl::rewards {

/// What a handler answers: an HTTP status, a body (sent as application/json) and extra headers.
struct http_reply {
  unsigned status = 200;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers{};
};

/// A request as a handler sees it.
struct http_request_view {
  std::string method, target, body;
};

namespace detail {
/// The first line of an error message, at most `max_chars` bytes (a c10::Error's `what()` carries
/// a stack trace on the lines after it: that stays on the server).
inline std::string first_line(std::string_view what, std::size_t max_chars = 1000) {
  auto line = what.substr(0, what.find_first_of("\r\n"));
  if (line.size() > max_chars) return std::string(line.substr(0, max_chars)) + "...";
  return std::string(line);
}

/// `{"error": "<first line of what>"}`, as valid JSON whatever bytes `what` holds.
inline std::string error_body(std::string_view what) {
  return nlohmann::json{{"error", first_line(what)}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// A failed request's reply; its full error goes to stderr when `log` is set.
inline http_reply failure(unsigned status, std::string_view what, bool log) {
  if (log) {
    static std::mutex m;
    std::lock_guard lock(m);
    std::cerr << "unirl server: HTTP " << status << ": " << what << std::endl;
  }
  return {status, error_body(what)};
}

/// A 503 the client may retry after a second.
inline http_reply busy(std::string_view what) {
  http_reply r = failure(503, what, false);
  r.headers.emplace_back("Retry-After", "1");
  return r;
}

inline std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}
}  // namespace detail

/// An HTTP/1.1 server calling `handler` for every request (keep-alive and pipelining honoured),
/// with bounded resources (see the file comment and `server_options`). A handler that throws
/// gives `500` with the first line of its error. `start()` binds and returns; `stop()` (or the
/// destructor) stops accepting, closes the connections that hold no request, lets the requests
/// it holds finish (up to `drain_timeout_s`) and joins the threads.
class json_http_server {
 public:
  using handler = std::function<http_reply(const http_request_view&)>;

  /// `name` says which service speaks in its messages ("the <name> has 1024 requests queued").
  json_http_server(handler h, server_options o, std::string name = "reward server")
      : handler_(std::move(h)), opts_(std::move(o)), name_(std::move(name)) {
    unirl::options::validate(opts_);
  }
  json_http_server(const json_http_server&) = delete;
  json_http_server& operator=(const json_http_server&) = delete;
  ~json_http_server() { stop(); }

  /// Binds `host:port` and starts accepting; throws `runtime_failure` naming the address on
  /// failure. Raises this process's soft `RLIMIT_NOFILE` towards what `max_connections` needs
  /// (up to the hard limit); where that is not enough, serves fewer connections and says so on
  /// stderr (`max_open_connections()`).
  void start() {
    namespace net = boost::asio;
    using tcp = net::ip::tcp;
    std::lock_guard lock(mutex_);
    UNIRL_CHECK(!running_, "json_http_server::start: already running on port ", port_);
    boost::system::error_code ec;
    const auto address = net::ip::make_address(opts_.host, ec);
    if (ec) throw runtime_failure("unirl: " + name_ + ": '" + opts_.host + "' is not an IP address: " + ec.message());
    max_open_ = fit_file_limit();
    ioc_ = std::make_unique<net::io_context>(static_cast<int>(opts_.io_threads));
    acceptor_ = std::make_unique<tcp::acceptor>(net::make_strand(*ioc_));
    retry_timer_ = std::make_unique<net::steady_timer>(acceptor_->get_executor());
    const tcp::endpoint ep{address, static_cast<unsigned short>(opts_.port)};
    acceptor_->open(ep.protocol(), ec);
    if (!ec) acceptor_->set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_->bind(ep, ec);
    if (!ec) acceptor_->listen(net::socket_base::max_listen_connections, ec);
    if (ec) {
      retry_timer_.reset();
      acceptor_.reset();
      ioc_.reset();
      throw runtime_failure("unirl: " + name_ + " cannot listen on " + opts_.host + ":" + std::to_string(opts_.port) +
                            ": " + ec.message());
    }
    port_ = acceptor_->local_endpoint().port();
    stopping_ = false;
    workers_stop_ = false;
    running_ = true;
    for (std::int64_t i = 0; i < opts_.threads; ++i) workers_.emplace_back([this] { work(); });
    net::dispatch(acceptor_->get_executor(), [this] { accept(); });
    for (std::int64_t i = 0; i < opts_.io_threads; ++i) io_threads_.emplace_back([this] { ioc_->run(); });
  }

  /// Stops accepting, closes every connection that holds no request (idle, or still sending
  /// one), lets the requests it holds be handled and answered (their connections then close),
  /// for at most `drain_timeout_s`; then drops what is left and joins all threads. Idempotent;
  /// not from a handler.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      if (!running_) return;
      running_ = false;
      stopping_ = true;
    }
    stopped_.notify_all();
    boost::asio::post(acceptor_->get_executor(), [this] {
      boost::system::error_code ignored;
      acceptor_->close(ignored);
      retry_timer_->cancel();
    });
    std::vector<std::shared_ptr<session>> open;
    {
      std::lock_guard lock(sessions_mutex_);
      for (auto& [p, w] : sessions_)
        if (auto s = w.lock()) open.push_back(std::move(s));
    }
    for (auto& s : open) boost::asio::post(s->sock.get_executor(), [s] { s->on_stop(); });
    open.clear();  // (a last reference may end a session here: not under sessions_mutex_)
    const auto until = std::chrono::steady_clock::now() + detail::seconds(opts_.drain_timeout_s);
    while (active_ + refused_ > 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    ioc_->stop();
    for (auto& t : io_threads_) t.join();
    io_threads_.clear();
    {
      std::lock_guard lock(queue_mutex_);
      workers_stop_ = true;
    }
    queue_cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    std::deque<job> dropped;
    {
      std::lock_guard lock(queue_mutex_);
      dropped.swap(queue_);
    }
    dropped.clear();  // their sockets belong to ioc_: before it goes
    retry_timer_.reset();
    acceptor_.reset();
    ioc_.reset();  // the connections still in pending operations go with it
  }

  /// Blocks until `stop()` is called from another thread.
  void wait() {
    std::unique_lock lock(mutex_);
    stopped_.wait(lock, [&] { return !running_; });
  }

  /// The port it listens on (the ephemeral one when `port` was 0).
  std::uint16_t port() const { return port_; }
  bool running() const { return running_; }
  /// `http://host:port<path>`.
  std::string url() const { return "http://" + opts_.host + ":" + std::to_string(port_) + opts_.path; }
  const server_options& opts() const { return opts_; }
  /// Connections open now (those answered 503 not included).
  std::int64_t connections() const { return active_; }
  /// Parsed requests waiting for a handler thread now.
  std::int64_t queued() const {
    std::lock_guard lock(queue_mutex_);
    return static_cast<std::int64_t>(queue_.size());
  }
  /// Bytes of request bodies held now (being read, queued or handled).
  std::int64_t body_bytes_held() const { return body_held_; }
  /// The connections served at once: `max_connections`, or fewer where `RLIMIT_NOFILE` is short.
  std::int64_t max_open_connections() const { return max_open_; }

 private:
  using clock = std::chrono::steady_clock;
  using request = http_request_reader::request;
  struct session;
  struct job {
    std::shared_ptr<session> s;
    request req;
  };

  // One connection, on its strand: wait for bytes, feed them to its reader, queue the parsed
  // request, write the reply; again while keep-alive, else half-close and drain briefly (so the
  // client reads the last reply). One timer holds the current deadline.
  struct session : std::enable_shared_from_this<session> {
    enum class phase { reading, queued, writing, lingering, closed };

    session(json_http_server& s, boost::asio::ip::tcp::socket sock, bool regular)
        : srv(s), sock(std::move(sock)), timer(this->sock.get_executor()), reader(s.read_limits()), regular(regular) {}
    ~session() {
      release();
      srv.unregister(this);
      (regular ? srv.active_ : srv.refused_)--;
    }

    void start() {
      boost::system::error_code ignored;
      sock.non_blocking(true, ignored);
      if (srv.stopping_) return close();
      if (!regular)  // over the connection limit: say so at once
        return send(detail::busy("the " + srv.name_ + " has " + std::to_string(srv.max_open_) +
                                 " connections open (max_connections" +
                                 (srv.max_open_ < srv.opts_.max_connections ? ", limited by RLIMIT_NOFILE" : "") +
                                 "); retry later"),
                    11, false);
      sock.set_option(boost::asio::ip::tcp::no_delay(true), ignored);
      begin_request();
    }

    void begin_request() {
      ph = phase::reading;
      reader.start(clock::now());
      advance();
    }

    // What the reader's state asks for next.
    void advance() {
      if (ph != phase::reading) return;
      if (!body_admitted && (reader.state() == http_read_state::body || reader.state() == http_read_state::complete)) {
        body_admitted = true;
        const auto want = reader.content_length().value_or(static_cast<std::uint64_t>(srv.opts_.max_body_bytes));
        if (!srv.reserve_body(want))
          return send(detail::busy("the " + srv.name_ + " holds " + std::to_string(srv.body_held_.load()) +
                                   " bytes of request bodies (max_body_bytes_total = " +
                                   std::to_string(srv.body_limit_total()) + "); retry later"),
                      reader.version(), false);
        reserved = want;
        // Admitted: a client waiting for "100 Continue" gets it now (one small write, on an
        // idle socket buffer; should it not fit, the client sends after its own wait anyway).
        if (reader.expects_continue()) {
          static constexpr std::string_view cont = "HTTP/1.1 100 Continue\r\n\r\n";
          boost::system::error_code ignored;
          sock.write_some(boost::asio::buffer(cont.data(), cont.size()), ignored);
        }
      }
      switch (reader.state()) {
        case http_read_state::head:
        case http_read_state::body:
          arm(reader.deadline());
          return wait_readable();
        case http_read_state::complete:
          return submit();
        case http_read_state::refused:
          return send(detail::failure(reader.status(), reader.reason(), false), reader.version(), false);
        case http_read_state::timed_out:
        case http_read_state::closed:
          return close();
      }
    }

    void wait_readable() {
      sock.async_wait(boost::asio::ip::tcp::socket::wait_read,
                      [self = this->shared_from_this()](boost::system::error_code ec) { self->on_readable(ec); });
    }

    void on_readable(boost::system::error_code ec) {
      if (ph != phase::reading && ph != phase::lingering) return;
      if (ec) return close();
      // One buffer per event-loop thread: an idle connection holds none.
      thread_local std::array<char, http_request_reader::body_read_size> scratch;
      for (int round = 0; round < 16; ++round) {
        const std::size_t want = ph == phase::reading ? std::min(scratch.size(), reader.read_size()) : scratch.size();
        const std::size_t n = sock.read_some(boost::asio::buffer(scratch.data(), want), ec);
        if (ec == boost::asio::error::would_block || ec == boost::asio::error::try_again) break;
        if (ph == phase::lingering) {
          drained += n;
          if (ec || drained > (1u << 20)) return close();
          continue;
        }
        if (ec) {
          reader.end_of_input();
          return advance();
        }
        reader.feed(std::string_view(scratch.data(), n), clock::now());
        if (!reader.reading()) return advance();
        if (n < want) break;
      }
      if (ph == phase::lingering) return wait_readable();
      advance();
    }

    void submit() {
      ph = phase::queued;
      holds = true;
      ++srv.held_;
      request req = reader.take();
      version = req.version();
      keep_alive = req.keep_alive();
      if (!srv.enqueue(job{this->shared_from_this(), std::move(req)}))
        send(detail::busy("the " + srv.name_ + " has " + std::to_string(srv.opts_.queue_depth) +
                          " requests queued (queue_depth); retry later"),
             version, false);
    }

    void send(http_reply reply, unsigned v, bool keep) {
      namespace http = boost::beast::http;
      if (ph == phase::closed) return;
      ph = phase::writing;
      res = {};
      res.version(v);
      res.result(reply.status);
      res.set(http::field::server, srv.server_header_);
      res.set(http::field::content_type, "application/json");
      for (const auto& [k, val] : reply.headers) res.set(k, val);
      res.keep_alive(keep && !srv.stopping_);
      res.body() = std::move(reply.body);
      res.prepare_payload();
      write_deadline = clock::now() + detail::seconds(srv.opts_.write_timeout_s);
      arm(write_deadline);
      http::async_write(sock, res, [self = this->shared_from_this()](boost::beast::error_code ec, std::size_t) {
        self->on_written(ec);
      });
    }

    void on_written(boost::beast::error_code ec) {
      if (ph != phase::writing) return;
      release();
      if (ec) return close();
      if (res.keep_alive() && !srv.stopping_) {
        res = {};
        return begin_request();
      }
      linger();
    }

    // Half-close, then read and drop what the client still sends (at most 1 MiB, for at most a
    // second): closing with unread bytes would reset the connection and could lose the reply.
    void linger() {
      boost::system::error_code ignored;
      sock.shutdown(boost::asio::ip::tcp::socket::shutdown_send, ignored);
      ph = phase::lingering;
      linger_deadline = clock::now() + detail::seconds(std::min(1.0, srv.opts_.read_timeout_s));
      arm(linger_deadline);
      wait_readable();
    }

    // The server stops: a connection that holds no request closes now.
    void on_stop() {
      if (ph == phase::reading || ph == phase::lingering) close();
    }

    clock::time_point deadline() const {
      switch (ph) {
        case phase::reading: return reader.deadline();
        case phase::writing: return write_deadline;
        case phase::lingering: return linger_deadline;
        default: return clock::time_point::max();
      }
    }

    // One pending timer wait at a time, at or before the current deadline: later deadlines
    // (a body's, as its bytes come) re-arm when it fires.
    void arm(clock::time_point d) {
      if (d == clock::time_point::max() || (timer_pending && armed <= d)) return;
      armed = d;
      timer_pending = true;
      timer.expires_at(d);
      timer.async_wait([self = this->shared_from_this()](boost::system::error_code ec) { self->on_timer(ec); });
    }

    void on_timer(boost::system::error_code ec) {
      if (ec == boost::asio::error::operation_aborted || ph == phase::closed) return;
      timer_pending = false;
      const auto now = clock::now();
      if (ph == phase::reading ? reader.expire(now) : now >= deadline()) return close();
      arm(deadline());
    }

    // Gives back what the request held: its place among those held, its body budget.
    void release() {
      if (holds) {
        holds = false;
        --srv.held_;
      }
      if (reserved) {
        srv.body_held_ -= static_cast<std::int64_t>(reserved);
        reserved = 0;
      }
      body_admitted = false;
    }

    void close() {
      if (ph == phase::closed) return;
      ph = phase::closed;
      release();
      boost::system::error_code ignored;
      timer.cancel();
      sock.shutdown(boost::asio::ip::tcp::socket::shutdown_both, ignored);
      sock.close(ignored);
    }

    json_http_server& srv;
    boost::asio::ip::tcp::socket sock;
    boost::asio::steady_timer timer;
    http_request_reader reader;
    boost::beast::http::response<boost::beast::http::string_body> res;
    phase ph = phase::reading;
    clock::time_point write_deadline{}, linger_deadline{}, armed{};
    std::uint64_t reserved = 0;
    std::size_t drained = 0;
    unsigned version = 11;
    bool keep_alive = false, holds = false, body_admitted = false, timer_pending = false;
    bool regular;
  };

  static std::string replace_spaces(std::string s) {
    std::replace(s.begin(), s.end(), ' ', '-');
    return s;
  }

  http_read_limits read_limits() const {
    return {.max_header_bytes = static_cast<std::size_t>(opts_.max_header_bytes),
            .max_body_bytes = static_cast<std::uint64_t>(opts_.max_body_bytes),
            .header_timeout = detail::seconds(opts_.read_timeout_s),
            .min_body_rate = opts_.min_body_rate};
  }
  std::int64_t body_limit_total() const { return std::max(opts_.max_body_bytes_total, opts_.max_body_bytes); }
  std::int64_t refused_cap() const { return std::min<std::int64_t>(max_open_, 64); }

  // The connections it can serve with this process's file limit, raising the soft limit first.
  std::int64_t fit_file_limit() const {
    constexpr std::int64_t reserve = 64;  // the listener, the scorer's files, logs
    const std::int64_t spare = std::min<std::int64_t>(opts_.max_connections, 64);  // for 503 replies
    std::int64_t open_now = 0;
    std::error_code ec;
    for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec); !ec && it != std::filesystem::directory_iterator();
         it.increment(ec))
      ++open_now;
    const auto needed = static_cast<rlim_t>(open_now + opts_.max_connections + spare + reserve);
    rlimit r{};
    if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return opts_.max_connections;
    if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < needed) {
      rlimit raised = r;
      raised.rlim_cur = r.rlim_max == RLIM_INFINITY ? needed : std::min(needed, r.rlim_max);
      if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
    }
    if (r.rlim_cur == RLIM_INFINITY || r.rlim_cur >= needed) return opts_.max_connections;
    const std::int64_t fits = static_cast<std::int64_t>(r.rlim_cur) - open_now - spare - reserve;
    UNIRL_CHECK(fits >= 1, "unirl ", name_, ": RLIMIT_NOFILE = ", r.rlim_cur, " (hard ", r.rlim_max, ") with ",
                open_now, " files open leaves no room for connections; raise it (ulimit -n)");
    std::cerr << "unirl " << name_ << ": max_connections = " << opts_.max_connections << " needs " << needed
              << " file descriptors, RLIMIT_NOFILE is " << r.rlim_cur << " (hard " << r.rlim_max
              << "): serving at most " << fits << " connections (raise the limit with ulimit -n, or lower max_connections)"
              << std::endl;
    return fits;
  }

  void accept() {
    namespace net = boost::asio;
    acceptor_->async_accept(net::make_strand(*ioc_), [this](boost::beast::error_code ec, net::ip::tcp::socket socket) {
      if (ec == net::error::operation_aborted || !running_) return;
      if (ec) {
        // Out of file descriptors or the like: wait a little instead of spinning.
        retry_timer_->expires_after(std::chrono::milliseconds(50));
        retry_timer_->async_wait([this](boost::beast::error_code e) {
          if (!e && running_) accept();
        });
        return;
      }
      bool regular = true;
      if (active_ < max_open_) {
        ++active_;
      } else if (refused_ < refused_cap()) {
        ++refused_;
        regular = false;
      } else {
        accept();  // dropped at once (the socket closes here)
        return;
      }
      auto s = std::make_shared<session>(*this, std::move(socket), regular);
      {
        std::lock_guard lock(sessions_mutex_);
        sessions_.emplace(s.get(), s);
      }
      net::post(s->sock.get_executor(), [s] { s->start(); });
      accept();
    });
  }

  void unregister(session* s) {
    std::lock_guard lock(sessions_mutex_);
    sessions_.erase(s);
  }

  bool reserve_body(std::uint64_t bytes) {
    const auto want = static_cast<std::int64_t>(std::min<std::uint64_t>(bytes, INT64_MAX / 2));
    std::int64_t held = body_held_.load();
    do {
      if (held + want > body_limit_total()) return false;
    } while (!body_held_.compare_exchange_weak(held, held + want));
    return true;
  }

  bool enqueue(job j) {
    {
      std::lock_guard lock(queue_mutex_);
      if (static_cast<std::int64_t>(queue_.size()) >= opts_.queue_depth || workers_stop_) return false;
      queue_.push_back(std::move(j));
    }
    queue_cv_.notify_one();
    return true;
  }

  // A handler thread: takes queued requests in order, answers each on its connection's strand.
  void work() {
    for (;;) {
      job j;
      {
        std::unique_lock lock(queue_mutex_);
        queue_cv_.wait(lock, [&] { return workers_stop_ || !queue_.empty(); });
        if (workers_stop_) return;
        j = std::move(queue_.front());
        queue_.pop_front();
      }
      http_request_view view{std::string(j.req.method_string()), std::string(j.req.target()), std::move(j.req.body())};
      j.req = {};
      http_reply reply = call(view);
      view = {};
      auto s = std::move(j.s);
      boost::asio::post(s->sock.get_executor(), [s, reply = std::move(reply)]() mutable {
        s->send(std::move(reply), s->version, s->keep_alive);
      });
    }
  }

  // The handler, whose failures become a 500 reply and never leave this function.
  http_reply call(const http_request_view& view) noexcept {
    try {
      try {
        return handler_(view);
      } catch (const std::exception& e) {
        return detail::failure(500, e.what(), opts_.log_errors);
      } catch (...) {
        return detail::failure(500, "the handler threw an exception that is not a std::exception", opts_.log_errors);
      }
    } catch (...) {  // even the error reply failed (out of memory)
      return {500, R"({"error": "internal error"})"};
    }
  }

  handler handler_;
  server_options opts_;
  std::string name_;
  std::string server_header_ = "unirl-" + replace_spaces(name_);
  std::unique_ptr<boost::asio::io_context> ioc_;
  std::unique_ptr<boost::asio::ip::tcp::acceptor> acceptor_;
  std::unique_ptr<boost::asio::steady_timer> retry_timer_;
  std::vector<std::thread> io_threads_, workers_;
  mutable std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<job> queue_;
  bool workers_stop_ = false;
  std::mutex sessions_mutex_;
  std::unordered_map<session*, std::weak_ptr<session>> sessions_;
  std::mutex mutex_;
  std::condition_variable stopped_;
  std::atomic<std::int64_t> active_{0}, refused_{0}, held_{0}, body_held_{0};
  std::atomic<bool> running_{false}, stopping_{false};
  std::int64_t max_open_ = 0;
  std::uint16_t port_ = 0;
};

/// Serves until SIGINT or SIGTERM, then stops `server` cleanly (`stop()`: no new connections,
/// the requests held are finished) and returns the signal's number; returns 0 if the server
/// was stopped otherwise (another thread's `stop()`). A second SIGINT / SIGTERM while it stops
/// ends the process at once (exit status 128 + the signal). The signals are caught with Asio's
/// `signal_set` while this runs (whichever thread receives them).
///
/// ```cpp
/// server.start();
/// const int sig = unirl::rewards::serve_until_signal(server);   // blocks
/// std::cout << "stopped on signal " << sig << "\n";             // then exit 0
/// ```
template <class Server>
int serve_until_signal(Server& server) {
  boost::asio::io_context ioc(1);
  boost::asio::signal_set signals(ioc, SIGINT, SIGTERM);
  std::atomic<int> first{0};
  std::thread stopper;
  signals.async_wait([&](boost::system::error_code ec, int sig) {
    if (ec) return;
    first = sig;
    signals.async_wait([](boost::system::error_code e, int again) {
      if (e) return;
      std::cerr << "unirl: second signal (" << again << ") while stopping: exiting at once" << std::endl;
      std::_Exit(128 + again);
    });
    stopper = std::thread([&] {
      server.stop();
      boost::asio::post(ioc, [&] { ioc.stop(); });
    });
  });
  // Stopped by anyone else: end the loop (on the loop's thread, so a signal handled first wins).
  std::thread waiter([&] {
    server.wait();
    boost::asio::post(ioc, [&] {
      if (first == 0) ioc.stop();
    });
  });
  ioc.run();
  waiter.join();
  if (stopper.joinable()) stopper.join();
  return first;
}

}  // namespace unirl::rewards
