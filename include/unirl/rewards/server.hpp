#pragma once
/// \file server.hpp
/// `reward_server`, which hosts any local scorer behind the schema of remote.hpp on the HTTP/1.1
/// JSON server of http_server.hpp, so rewards can run on their own machines.
///
/// ```cpp
/// unirl::rewards::reward_server server{unirl::rewards::weighted<exact_answer, regex_format>{},
///                                      {.host = "0.0.0.0", .port = 8000}};
/// server.start();                      // serves on background threads
/// std::cout << server.url() << "\n";   // http://0.0.0.0:8000/score
/// server.wait();                       // until stop() from another thread; or:
/// unirl::rewards::serve_until_signal(server);   // until SIGINT / SIGTERM, then a clean stop
/// ```
/// Endpoints: `POST /score` (the request / response schema of remote.hpp) and `GET /health`
/// (`{"status": "ok"}`). A malformed request gets status 400, a body over `max_body_bytes` 413, a
/// scorer that throws 500, a head over `max_header_bytes` 431, and a connection over
/// `max_connections` or a request past `queue_depth` 503 (with `Retry-After`), each with
/// `{"error": "<one line>"}`; a failing scorer fails its request, never the server. Idle and slow
/// connections hold no thread and time out (http_server.hpp).
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/reward.hpp>
#include <unirl/core/error.hpp>
#include <unirl/rewards/http_server.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

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
  /// The HTTP server underneath (connections, queue, limits).
  const json_http_server& http() const { return server_; }

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
