#pragma once
/// \file server.hpp
/// A small HTTP/1.1 JSON server (Boost.Beast) and `reward_server`, which hosts any local scorer
/// behind the schema of remote.hpp, so rewards can run on their own machines.
///
/// ```cpp
/// unirl::rewards::reward_server server{unirl::rewards::weighted<exact_answer, regex_format>{},
///                                      {.host = "0.0.0.0", .port = 8000}};
/// server.start();                      // serves on background threads
/// std::cout << server.url() << "\n";   // http://0.0.0.0:8000/score
/// server.wait();                       // until stop() (e.g. from a signal handler's thread)
/// ```
/// Endpoints: `POST /score` (the request / response schema of remote.hpp) and `GET /health`
/// (`{"status": "ok"}`). A malformed request gets status 400, a body over `max_body_bytes` 413, a
/// scorer that throws 500, a connection over `max_connections` 503 (with `Retry-After`), each with
/// `{"error": "<one line>"}`; a failing scorer fails its request, never the server.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/reward.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

/// Options of the servers. Resources are bounded: at most `max_connections` connections are open
/// (one more gets `503` with `Retry-After` and is closed), `threads + 1` threads run (one for all
/// the I/O, `threads` for the handlers), a request must arrive within `read_timeout_s` (else the
/// connection is closed, idle keep-alive ones too), a body over `max_body_bytes` is refused with
/// `413` from its headers, before it is read, and memory is a small multiple of the bodies being
/// read or scored (at most `max_connections` of them).
struct server_options {
  std::string host = "127.0.0.1";            // address to listen on ("0.0.0.0": every interface)
  std::int64_t port = 0;                     // 0: an ephemeral port, read it back with port()
  std::string path = "/score";               // the scoring endpoint
  std::int64_t max_body_bytes = 16ll << 20;  // larger requests are refused (413); raise it for big image batches
  std::int64_t max_connections = 64;         // open connections at once; beyond: 503 + Retry-After
  std::int64_t threads = 4;                  // handler threads (a fixed pool); the I/O has one more
  double read_timeout_s = 30.0;              // a whole request (head + body) within this, else the connection is closed
  double write_timeout_s = 30.0;             // a whole response within this, else the connection is closed
  bool log_errors = true;                    // print a failed request's full error (stack trace too) to stderr

  void validate(const std::string& prefix) const {
    options::require(port >= 0 && port <= 65535, prefix + "port", port, "in [0, 65535]");
    options::require(!path.empty() && path.front() == '/', prefix + "path", path, "a path starting with '/'");
    options::require(max_body_bytes > 0, prefix + "max_body_bytes", max_body_bytes, "> 0");
    options::require(max_connections >= 1, prefix + "max_connections", max_connections, ">= 1");
    options::require(threads >= 1 && threads <= 1024, prefix + "threads", threads, "in [1, 1024]");
    options::require(read_timeout_s > 0, prefix + "read_timeout_s", read_timeout_s, "> 0");
    options::require(write_timeout_s > 0, prefix + "write_timeout_s", write_timeout_s, "> 0");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::server_options, host, port, path, max_body_bytes, max_connections, threads,
                        read_timeout_s, write_timeout_s, log_errors);
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
    std::cerr << "unirl reward server: HTTP " << status << ": " << what << std::endl;
  }
  return {status, error_body(what)};
}
}  // namespace detail

/// An HTTP/1.1 server calling `handler` for every request (keep-alive honoured), with bounded
/// resources (see `server_options`): asynchronous I/O on one thread, handlers on a fixed pool of
/// `threads`. A handler that throws gives `500` with the first line of its error. `start()`
/// binds and returns; `stop()` (or the destructor) closes the listener and every connection,
/// waits for the handler calls in progress and joins the threads.
class json_http_server {
 public:
  using handler = std::function<http_reply(const http_request_view&)>;

  json_http_server(handler h, server_options o) : handler_(std::move(h)), opts_(std::move(o)) {
    unirl::options::validate(opts_);
  }
  json_http_server(const json_http_server&) = delete;
  json_http_server& operator=(const json_http_server&) = delete;
  ~json_http_server() { stop(); }

  /// Binds `host:port` and starts accepting; throws `runtime_failure` naming the address on failure.
  void start() {
    namespace net = boost::asio;
    using tcp = net::ip::tcp;
    std::lock_guard lock(mutex_);
    UNIRL_CHECK(!running_, "json_http_server::start: already running on port ", port_);
    boost::system::error_code ec;
    const auto address = net::ip::make_address(opts_.host, ec);
    if (ec) throw runtime_failure("unirl: reward server: '" + opts_.host + "' is not an IP address: " + ec.message());
    ioc_ = std::make_unique<net::io_context>(1);
    acceptor_ = std::make_unique<tcp::acceptor>(*ioc_);
    retry_timer_ = std::make_unique<net::steady_timer>(*ioc_);
    const tcp::endpoint ep{address, static_cast<unsigned short>(opts_.port)};
    acceptor_->open(ep.protocol(), ec);
    if (!ec) acceptor_->set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_->bind(ep, ec);
    if (!ec) acceptor_->listen(net::socket_base::max_listen_connections, ec);
    if (ec) {
      retry_timer_.reset();
      acceptor_.reset();
      ioc_.reset();
      throw runtime_failure("unirl: reward server cannot listen on " + opts_.host + ":" + std::to_string(opts_.port) +
                            ": " + ec.message());
    }
    port_ = acceptor_->local_endpoint().port();
    pool_ = std::make_unique<net::thread_pool>(static_cast<std::size_t>(opts_.threads));
    running_ = true;
    accept();
    io_thread_ = std::thread([this] { ioc_->run(); });
  }

  /// Closes the listener and every connection, waits for the handler calls in progress, joins
  /// all threads. Idempotent.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      if (!running_) return;
      running_ = false;
    }
    stopped_.notify_all();
    ioc_->stop();
    if (io_thread_.joinable()) io_thread_.join();
    pool_->stop();  // requests not started yet are dropped with their connections
    pool_->join();
    // Connections live in pending operations: the pool's first (their sockets belong to ioc_),
    // then the I/O context's.
    pool_.reset();
    retry_timer_.reset();
    acceptor_.reset();
    ioc_.reset();
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

 private:
  // One connection: read a request (with a deadline), hand it to the pool, write the reply, and
  // so on while keep-alive; then half-close and drain briefly, so the client reads the last reply.
  struct session : std::enable_shared_from_this<session> {
    session(json_http_server& s, boost::asio::ip::tcp::socket sock, bool regular)
        : srv(s), stream(std::move(sock)), regular(regular) {}
    ~session() { (regular ? srv.active_ : srv.refused_)--; }

    void start() {
      if (regular) return read();
      // Over the connection limit: say so at once (the client may retry after a second).
      http_reply busy = detail::failure(503, "the reward server has " + std::to_string(srv.opts_.max_connections) +
                                                 " connections open (max_connections); retry later", false);
      busy.headers.emplace_back("Retry-After", "1");
      send(std::move(busy), 11, false);
    }

    void read() {
      namespace http = boost::beast::http;
      parser.emplace();
      parser->body_limit(static_cast<std::uint64_t>(srv.opts_.max_body_bytes));
      stream.expires_after(seconds(srv.opts_.read_timeout_s));
      http::async_read(stream, buffer, *parser,
                       [self = shared_from_this()](boost::beast::error_code ec, std::size_t) { self->on_read(ec); });
    }

    void on_read(boost::beast::error_code ec) {
      namespace http = boost::beast::http;
      if (ec == http::error::body_limit)
        return send(detail::failure(413, "request body larger than max_body_bytes = " + std::to_string(srv.opts_.max_body_bytes) +
                                             " bytes; send smaller batches (the client's chunk_size) or raise the server's limit",
                                    false),
                    parser->get().version(), false);
      if (ec && ec.category() == http::make_error_code(http::error::bad_target).category() &&
          ec != http::error::end_of_stream && ec != http::error::partial_message)
        return send(detail::failure(400, "malformed HTTP request: " + ec.message(), false), 11, false);
      if (ec) return close();  // end of stream, read timeout, reset: nothing to answer
      auto req = parser->release();
      const unsigned version = req.version();
      const bool keep_alive = req.keep_alive();
      boost::asio::post(*srv.pool_, [self = shared_from_this(), req = std::move(req), version, keep_alive]() mutable {
        http_request_view view{std::string(req.method_string()), std::string(req.target()), std::move(req.body())};
        req = {};
        http_reply reply = self->srv.call(view);
        view = {};
        boost::asio::post(self->stream.get_executor(), [self, reply = std::move(reply), version, keep_alive]() mutable {
          self->send(std::move(reply), version, keep_alive);
        });
      });
    }

    void send(http_reply reply, unsigned version, bool keep_alive) {
      namespace http = boost::beast::http;
      res = {};
      res.version(version);
      res.result(reply.status);
      res.set(http::field::server, "unirl-reward-server");
      res.set(http::field::content_type, "application/json");
      for (const auto& [k, v] : reply.headers) res.set(k, v);
      res.keep_alive(keep_alive);
      res.body() = std::move(reply.body);
      res.prepare_payload();
      stream.expires_after(seconds(srv.opts_.write_timeout_s));
      http::async_write(stream, res, [self = shared_from_this()](boost::beast::error_code ec, std::size_t) {
        if (ec) return self->close();
        if (self->res.keep_alive()) return self->read();
        self->linger();
      });
    }

    // Half-close, then read and drop what the client still sends (at most 1 MiB, for at most a
    // second): closing with unread bytes would reset the connection and could lose the reply.
    void linger() {
      boost::system::error_code ignored;
      stream.socket().shutdown(boost::asio::ip::tcp::socket::shutdown_send, ignored);
      stream.expires_after(seconds(std::min(1.0, srv.opts_.read_timeout_s)));
      drain();
    }
    void drain() {
      stream.async_read_some(boost::asio::buffer(scratch), [self = shared_from_this()](boost::beast::error_code ec, std::size_t n) {
        self->drained += n;
        if (ec || self->drained > (1u << 20)) return self->close();
        self->drain();
      });
    }
    void close() {
      boost::system::error_code ignored;
      stream.socket().shutdown(boost::asio::ip::tcp::socket::shutdown_both, ignored);
      stream.close();
    }
    static std::chrono::steady_clock::duration seconds(double s) {
      return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
    }

    json_http_server& srv;
    boost::beast::tcp_stream stream;
    boost::beast::flat_buffer buffer;
    std::optional<boost::beast::http::request_parser<boost::beast::http::string_body>> parser;
    boost::beast::http::response<boost::beast::http::string_body> res;
    std::array<char, 16384> scratch{};
    std::size_t drained = 0;
    bool regular;
  };

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
      if (active_ < opts_.max_connections) {
        ++active_;
        std::make_shared<session>(*this, std::move(socket), true)->start();
      } else if (refused_ < opts_.max_connections) {
        ++refused_;
        std::make_shared<session>(*this, std::move(socket), false)->start();
      }  // else: dropped at once (the socket closes here)
      accept();
    });
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
  std::unique_ptr<boost::asio::io_context> ioc_;
  std::unique_ptr<boost::asio::ip::tcp::acceptor> acceptor_;
  std::unique_ptr<boost::asio::steady_timer> retry_timer_;
  std::unique_ptr<boost::asio::thread_pool> pool_;
  std::thread io_thread_;
  std::mutex mutex_;
  std::condition_variable stopped_;
  std::atomic<std::int64_t> active_{0}, refused_{0};
  std::atomic<bool> running_{false};
  std::uint16_t port_ = 0;
};

/// Hosts a scorer behind the reward service schema of remote.hpp.
///
/// Minimal requirement: `ScorerFor<Scorer, json_batch>` — the scorer must work on the batch the
/// server decodes (text fields `completions` / `references` / `prompts` and tensors such as
/// `images`). Calls to the scorer are serialised; its `last_components()` (if any) go back in
/// the response's "components".
template <class Scorer>
class reward_server {
  static_assert(ScorerFor<Scorer, json_batch>,
                "unirl::rewards::reward_server<Scorer>: Scorer does not model ScorerFor<Scorer, json_batch> "
                "(RewardFor): it needs `torch::Tensor operator()(const json_batch&)` (or a template) to score "
                "the batches the server decodes");

 public:
  reward_server(Scorer scorer, server_options o = {})
      : scorer_(std::move(scorer)), server_([this](const http_request_view& r) { return handle(r); }, std::move(o)) {}

  void start() { server_.start(); }
  void stop() { server_.stop(); }
  void wait() { server_.wait(); }
  std::uint16_t port() const { return server_.port(); }
  std::string url() const { return server_.url(); }
  /// Requests scored so far.
  std::int64_t served() const { return served_; }
  Scorer& scorer() { return scorer_; }

  /// Scores one request body (the HTTP layer aside): the response status and body. Never throws:
  /// a malformed request is a 400, a scorer that throws (anything) a 500 with the first line of its
  /// error (the whole of it, stack trace included, goes to stderr when `log_errors` is set).
  http_reply score_body(const std::string& body) {
    const bool log = server_.opts().log_errors;
    try {
      json_batch batch;
      try {
        batch = decode_request(body);
      } catch (const std::exception& e) {
        return detail::failure(400, e.what(), false);
      }
      nlohmann::json out;
      try {
        std::lock_guard lock(mutex_);
        // float32, as the client returns them: the shortest text that reads back exactly.
        const torch::Tensor r =
            check_scores(scorer_(batch), batch.size(), "hosted scorer").detach().to(torch::kCPU).to(torch::kFloat32).contiguous();
        UNIRL_CHECK(torch::isfinite(r).all().item<bool>(), "hosted scorer returned a non-finite reward: ", r);
        out["rewards"] = std::vector<float>(r.data_ptr<float>(), r.data_ptr<float>() + r.numel());
        if constexpr (ReportsComponents<Scorer>) out["components"] = scorer_.last_components();
        ++served_;
      } catch (const std::exception& e) {
        return detail::failure(500, e.what(), log);
      } catch (...) {
        return detail::failure(500, "the hosted scorer threw an exception that is not a std::exception", log);
      }
      return {200, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)};
    } catch (...) {  // even the error reply failed (out of memory)
      return {500, R"({"error": "internal error"})"};
    }
  }

 private:
  http_reply handle(const http_request_view& r) {
    const auto path = r.target.substr(0, r.target.find('?'));
    if (r.method == "GET" && path == "/health") return {200, R"({"status": "ok"})"};
    if (path != server_.opts().path)
      return {404, nlohmann::json{{"error", "no endpoint " + path + "; POST to " + server_.opts().path}}.dump()};
    if (r.method != "POST") return {405, nlohmann::json{{"error", "use POST for " + path}}.dump()};
    return score_body(r.body);
  }

  Scorer scorer_;
  std::mutex mutex_;
  std::atomic<std::int64_t> served_{0};
  json_http_server server_;
};

}  // namespace unirl::rewards
