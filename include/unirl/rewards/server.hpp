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
/// (`{"status": "ok"}`). A malformed request gets status 400, a scorer that throws 500, each with
/// `{"error": "..."}`.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
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

/// Options of the servers.
struct server_options {
  std::string host = "127.0.0.1";            // address to listen on ("0.0.0.0": every interface)
  std::int64_t port = 0;                     // 0: an ephemeral port, read it back with port()
  std::string path = "/score";               // the scoring endpoint
  std::int64_t max_body_bytes = 1ll << 30;   // larger requests are refused (413)

  void validate(const std::string& prefix) const {
    options::require(port >= 0 && port <= 65535, prefix + "port", port, "in [0, 65535]");
    options::require(!path.empty() && path.front() == '/', prefix + "path", path, "a path starting with '/'");
    options::require(max_body_bytes > 0, prefix + "max_body_bytes", max_body_bytes, "> 0");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::server_options, host, port, path, max_body_bytes);
namespace unirl::rewards {

/// What a handler answers: an HTTP status and a body (sent as application/json).
struct http_reply {
  unsigned status = 200;
  std::string body;
};

/// A request as a handler sees it.
struct http_request_view {
  std::string method, target, body;
};

/// An HTTP/1.1 server calling `handler` for every request, one thread per connection
/// (keep-alive honoured). `start()` binds and returns; `stop()` (or the destructor) closes the
/// listener and every open connection and joins the threads.
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
    UNIRL_CHECK(!running_, "json_http_server::start: already running on port ", port_);
    boost::system::error_code ec;
    const auto address = net::ip::make_address(opts_.host, ec);
    if (ec) throw runtime_failure("unirl: reward server: '" + opts_.host + "' is not an IP address: " + ec.message());
    acceptor_ = std::make_unique<tcp::acceptor>(ioc_);
    const tcp::endpoint ep{address, static_cast<unsigned short>(opts_.port)};
    acceptor_->open(ep.protocol(), ec);
    if (!ec) acceptor_->set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_->bind(ep, ec);
    if (!ec) acceptor_->listen(net::socket_base::max_listen_connections, ec);
    if (ec)
      throw runtime_failure("unirl: reward server cannot listen on " + opts_.host + ":" + std::to_string(opts_.port) +
                            ": " + ec.message());
    port_ = acceptor_->local_endpoint().port();
    running_ = true;
    accept_thread_ = std::thread([this] { accept_loop(); });
  }

  /// Closes the listener and every connection, joins all threads. Idempotent.
  void stop() {
    namespace net = boost::asio;
    using tcp = net::ip::tcp;
    {
      std::lock_guard lock(mutex_);
      if (!running_) return;
      running_ = false;
      boost::system::error_code ec;
      for (auto& c : connections_) c->socket.shutdown(tcp::socket::shutdown_both, ec);
    }
    stopped_.notify_all();
    // A blocking accept() is not woken by closing the listener: connect to it once instead.
    {
      boost::system::error_code ec;
      net::io_context ioc;
      tcp::socket poke(ioc);
      auto address = acceptor_->local_endpoint(ec).address();
      if (!ec && address.is_unspecified())
        address = address.is_v6() ? net::ip::address(net::ip::address_v6::loopback()) : net::ip::address(net::ip::address_v4::loopback());
      if (!ec) poke.connect(tcp::endpoint(address, port_), ec);
    }
    if (accept_thread_.joinable()) accept_thread_.join();
    boost::system::error_code ec;
    acceptor_->close(ec);
    std::list<std::shared_ptr<connection>> rest;
    {
      std::lock_guard lock(mutex_);
      rest.swap(connections_);
    }
    for (auto& c : rest) {
      c->socket.shutdown(tcp::socket::shutdown_both, ec);
      if (c->thread.joinable()) c->thread.join();
    }
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

 private:
  struct connection {
    explicit connection(boost::asio::io_context& ioc) : socket(ioc) {}
    boost::asio::ip::tcp::socket socket;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void accept_loop() {
    while (running_) {
      auto c = std::make_shared<connection>(ioc_);
      boost::system::error_code ec;
      acceptor_->accept(c->socket, ec);
      if (ec) {
        if (!running_) return;
        continue;
      }
      std::lock_guard lock(mutex_);
      if (!running_) return;
      // Reap finished connections so a long-running server does not accumulate threads.
      for (auto it = connections_.begin(); it != connections_.end();) {
        if ((*it)->done) {
          if ((*it)->thread.joinable()) (*it)->thread.join();
          it = connections_.erase(it);
        } else {
          ++it;
        }
      }
      c->thread = std::thread([this, c] { serve(*c); });
      connections_.push_back(c);
    }
  }

  void serve(connection& c) {
    namespace beast = boost::beast;
    namespace http = beast::http;
    beast::flat_buffer buffer;
    for (;;) {
      beast::error_code ec;
      http::request_parser<http::string_body> parser;
      parser.body_limit(static_cast<std::uint64_t>(opts_.max_body_bytes));
      http::read(c.socket, buffer, parser, ec);
      http_reply reply;
      bool keep_alive = false;
      unsigned version = 11;
      if (ec == http::error::body_limit) {
        reply = {413, nlohmann::json{{"error", "request body larger than " + std::to_string(opts_.max_body_bytes) + " bytes"}}.dump()};
      } else if (ec) {
        break;
      } else {
        auto req = parser.release();
        keep_alive = req.keep_alive();
        version = req.version();
        try {
          reply = handler_({std::string(req.method_string()), std::string(req.target()), std::move(req.body())});
        } catch (const std::exception& e) {
          reply = {500, nlohmann::json{{"error", e.what()}}.dump()};
        }
      }
      http::response<http::string_body> res{static_cast<http::status>(reply.status), version};
      res.set(http::field::server, "unirl-reward-server");
      res.set(http::field::content_type, "application/json");
      res.keep_alive(keep_alive);
      res.body() = std::move(reply.body);
      res.prepare_payload();
      http::write(c.socket, res, ec);
      if (ec || !keep_alive) break;
    }
    boost::system::error_code ignored;
    c.socket.shutdown(boost::asio::ip::tcp::socket::shutdown_send, ignored);
    c.done = true;
  }

  handler handler_;
  server_options opts_;
  boost::asio::io_context ioc_;
  std::unique_ptr<boost::asio::ip::tcp::acceptor> acceptor_;
  std::thread accept_thread_;
  std::mutex mutex_;
  std::condition_variable stopped_;
  std::list<std::shared_ptr<connection>> connections_;
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

  /// Scores one request body (the HTTP layer aside): the response status and body.
  http_reply score_body(const std::string& body) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(body);
    } catch (const nlohmann::json::exception& e) {
      return {400, nlohmann::json{{"error", std::string("malformed request JSON: ") + e.what()}}.dump()};
    }
    json_batch batch;
    try {
      batch = decode_batch(j);
    } catch (const std::exception& e) {
      return {400, nlohmann::json{{"error", e.what()}}.dump()};
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
      return {500, nlohmann::json{{"error", e.what()}}.dump()};
    }
    return {200, out.dump()};
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
