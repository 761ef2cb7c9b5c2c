#pragma once
/// \file remote.hpp
/// A remote reward service: `remote_scorer` sends batches as JSON over HTTP/1.1 (Boost.Beast)
/// with a timeout, retries with exponential backoff and bounded concurrency, and can score
/// asynchronously (`submit` returns a `std::future`) so the next rollout overlaps the scoring.
/// It never returns partial or invented rewards: an error, a timeout, malformed JSON or a reward
/// count other than the batch size is retried as configured, then thrown as
/// `unirl::runtime_failure` naming the URL and the cause.
///
/// Request (`POST <path>`, `Content-Type: application/json`); every field but `size` is present
/// only when the batch has it:
/// ```json
/// {"size": 2,
///  "completions": ["1+1=2", "1+1=3"], "references": ["2", "2"], "prompts": ["1+1=", "1+1="],
///  "tensors": {"images": {"dtype": "float32", "shape": [2, 1, 8, 8], "data": [0.0, ...]}}}
/// ```
/// A tensor may carry `"base64": "<raw little-endian bytes>"` instead of `"data"` (the client's
/// `tensors = base64` option); servers accept both.
/// Response, status 200: `{"rewards": [1.0, 0.0], "components": {"exact_answer": 0.5}}`
/// (`rewards`: exactly `size` finite numbers, in request order; `components`: optional per-component
/// means reported in the step statistics). Any other status is an error; its body should be
/// `{"error": "what went wrong"}`.
///
/// ```cpp
/// unirl::rewards::remote_scorer remote{{.url = "http://10.0.0.5:8000/score", .timeout_s = 10, .retries = 3}};
/// torch::Tensor r = remote(batch);                 // blocking
/// auto pending = remote.submit(batch);             // asynchronous
/// auto next = sample_next();                       // overlaps the scoring
/// torch::Tensor r2 = pending.get();                // throws runtime_failure after the retries
/// ```
#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <array>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/rollout.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/scorer.hpp>

namespace unirl::rewards {

// ---------------------------------------------------------------------------------------------
// The wire format.

/// How tensors travel: JSON numbers (any client can read them) or base64 of the raw
/// little-endian bytes (far smaller and faster for images).
enum class tensor_encoding { numbers, base64 };
}  // namespace unirl::rewards

template <>
inline constexpr std::array unirl::enum_names<unirl::rewards::tensor_encoding>{std::string_view{"numbers"},
                                                                               std::string_view{"base64"}};

namespace unirl::rewards {

namespace detail {
inline constexpr char b64_chars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

inline std::string base64_encode(const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  for (std::size_t i = 0; i < n; i += 3) {
    const std::uint32_t v = (std::uint32_t{p[i]} << 16) | (i + 1 < n ? std::uint32_t{p[i + 1]} << 8 : 0u) |
                            (i + 2 < n ? std::uint32_t{p[i + 2]} : 0u);
    out += b64_chars[(v >> 18) & 63];
    out += b64_chars[(v >> 12) & 63];
    out += i + 1 < n ? b64_chars[(v >> 6) & 63] : '=';
    out += i + 2 < n ? b64_chars[v & 63] : '=';
  }
  return out;
}

inline std::vector<unsigned char> base64_decode(const std::string& s, const std::string& key) {
  auto value = [&](char c) -> std::uint32_t {
    if (c >= 'A' && c <= 'Z') return static_cast<std::uint32_t>(c - 'A');
    if (c >= 'a' && c <= 'z') return static_cast<std::uint32_t>(c - 'a' + 26);
    if (c >= '0' && c <= '9') return static_cast<std::uint32_t>(c - '0' + 52);
    if (c == '+') return 62;
    if (c == '/') return 63;
    throw error("tensor '" + key + "': invalid base64 character '" + std::string(1, c) + "'");
  };
  UNIRL_CHECK(s.size() % 4 == 0, "tensor '", key, "': base64 text of length ", s.size(), "; expected a multiple of 4");
  std::vector<unsigned char> out;
  out.reserve(s.size() / 4 * 3);
  for (std::size_t i = 0; i < s.size(); i += 4) {
    const bool pad2 = s[i + 2] == '=', pad3 = s[i + 3] == '=';
    const std::uint32_t v = (value(s[i]) << 18) | (value(s[i + 1]) << 12) | (pad2 ? 0u : value(s[i + 2]) << 6) |
                            (pad3 ? 0u : value(s[i + 3]));
    out.push_back(static_cast<unsigned char>(v >> 16));
    if (!pad2) out.push_back(static_cast<unsigned char>((v >> 8) & 255));
    if (!pad3) out.push_back(static_cast<unsigned char>(v & 255));
  }
  return out;
}
}  // namespace detail

/// A tensor as JSON: `{"dtype": "float32", "shape": [...], "data": [...]}` (row-major), or with
/// `"base64": "..."` (the raw little-endian bytes) in place of `"data"`. float32, float64, int64
/// and bool are carried; other dtypes are sent as float32 (int32 as int64).
inline nlohmann::json tensor_to_json(const torch::Tensor& t, tensor_encoding enc = tensor_encoding::numbers) {
  auto c = t.detach().to(torch::kCPU).contiguous();
  nlohmann::json j;
  j["shape"] = c.sizes().vec();
  if (c.scalar_type() == torch::kInt32) c = c.to(torch::kInt64);
  if (c.scalar_type() != torch::kInt64 && c.scalar_type() != torch::kBool && c.scalar_type() != torch::kFloat64)
    c = c.to(torch::kFloat32);
  j["dtype"] = c.scalar_type() == torch::kInt64 ? "int64" : c.scalar_type() == torch::kBool ? "bool"
               : c.scalar_type() == torch::kFloat64 ? "float64" : "float32";
  if (c.scalar_type() == torch::kBool) c = c.to(torch::kInt64);
  if (enc == tensor_encoding::base64) {
    UNIRL_CHECK(std::endian::native == std::endian::little, "tensor_to_json: base64 tensors are little-endian; use numbers on this host");
    j["base64"] = detail::base64_encode(c.data_ptr(), static_cast<std::size_t>(c.numel()) * c.element_size());
  } else if (c.scalar_type() == torch::kInt64) {
    j["data"] = std::vector<std::int64_t>(c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel());
  } else if (c.scalar_type() == torch::kFloat64) {
    j["data"] = std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  } else {
    j["data"] = std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return j;
}

/// The inverse of `tensor_to_json`; `key` names the tensor in errors.
inline torch::Tensor tensor_from_json(const nlohmann::json& j, const std::string& key) {
  const bool b64 = j.is_object() && j.contains("base64") && j["base64"].is_string();
  UNIRL_CHECK(j.is_object() && j.contains("shape") && j["shape"].is_array() &&
                  (b64 || (j.contains("data") && j["data"].is_array())),
              "tensor '", key, "': expected {\"dtype\", \"shape\": [...], \"data\": [...] or \"base64\": \"...\"}, got ",
              j.dump().substr(0, 200));
  const auto shape = j["shape"].get<std::vector<std::int64_t>>();
  std::int64_t numel = 1;
  for (auto s : shape) {
    UNIRL_CHECK(s >= 0, "tensor '", key, "': negative dimension ", s, " in its shape");
    numel *= s;
  }
  const std::string dtype = j.value("dtype", "float32");
  UNIRL_CHECK(dtype == "float32" || dtype == "float64" || dtype == "int64" || dtype == "bool", "tensor '", key,
              "': dtype '", dtype, "'; expected float32, float64, int64 or bool");
  const auto type = dtype == "float64" ? torch::kFloat64 : dtype == "float32" ? torch::kFloat32 : torch::kInt64;
  torch::Tensor t;
  if (b64) {
    UNIRL_CHECK(std::endian::native == std::endian::little, "tensor '", key, "': base64 tensors are little-endian; this host is not");
    const auto bytes = detail::base64_decode(j["base64"].get<std::string>(), key);
    const auto width = static_cast<std::int64_t>(torch::elementSize(type));
    UNIRL_CHECK(static_cast<std::int64_t>(bytes.size()) == numel * width, "tensor '", key, "': ", bytes.size(),
                " bytes for shape ", j["shape"].dump(), " of ", dtype, "; expected ", numel * width);
    t = torch::empty({numel}, type);
    if (numel > 0) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  } else {
    UNIRL_CHECK(static_cast<std::int64_t>(j["data"].size()) == numel, "tensor '", key, "': ", j["data"].size(),
                " values for shape ", j["shape"].dump(), "; expected ", numel);
    try {
      if (type == torch::kInt64) t = torch::tensor(j["data"].get<std::vector<std::int64_t>>(), torch::kInt64);
      else if (type == torch::kFloat64) t = torch::tensor(j["data"].get<std::vector<double>>(), torch::kFloat64);
      else t = torch::tensor(j["data"].get<std::vector<float>>(), torch::kFloat32);
    } catch (const nlohmann::json::exception& e) {
      throw error("tensor '" + key + "': its data are not all numbers (" + e.what() + ")");
    }
    t = t.reshape({numel});
  }
  if (dtype == "bool") t = t.to(torch::kBool);
  return t.reshape(shape);
}

/// A batch as the reward server sees it: the request's fields. Models `RolloutBatch`,
/// `HasCompletions`, `HasReferences`, `HasPrompts` and (when an `images` tensor came)
/// `HasImages`, so text rules and image scorers run on it unchanged.
struct json_batch {
  std::int64_t count = 0;
  std::vector<std::string> completions{}, references{}, prompts{};
  torch::Tensor images{};                          // tensors["images"], or undefined
  std::map<std::string, torch::Tensor> tensors{};  // every tensor of the request, by name

  std::int64_t size() const { return count; }
  json_batch select(const torch::Tensor& index) const {
    const auto idx = index.to(torch::kCPU).to(torch::kInt64).contiguous();
    json_batch out;
    out.count = idx.numel();
    const auto* p = idx.data_ptr<std::int64_t>();
    auto pick = [&](const std::vector<std::string>& v) {
      std::vector<std::string> r;
      if (v.empty()) return r;
      for (std::int64_t i = 0; i < idx.numel(); ++i) {
        UNIRL_CHECK(p[i] >= 0 && p[i] < static_cast<std::int64_t>(v.size()), "json_batch::select: index ", p[i],
                    " out of range for ", v.size(), " samples");
        r.push_back(v[static_cast<std::size_t>(p[i])]);
      }
      return r;
    };
    out.completions = pick(completions);
    out.references = pick(references);
    out.prompts = pick(prompts);
    for (const auto& [k, t] : tensors) out.tensors[k] = t.index_select(0, idx.to(t.device()));
    if (out.tensors.count("images")) out.images = out.tensors["images"];
    return out;
  }
};
static_assert(RolloutBatch<json_batch>);

/// The request body for a batch: the non-empty text fields and images it has (see the schema above). A
/// batch type may add fields by providing `void to_reward_json(nlohmann::json&) const`.
template <class B>
nlohmann::json encode_batch(const B& b, tensor_encoding enc = tensor_encoding::numbers) {
  nlohmann::json j = nlohmann::json::object();
  j["size"] = batch_size(b);
  // Text fields a batch leaves empty (a token batch without prompt texts) are not sent.
  if constexpr (HasCompletions<B>) if (!b.completions.empty()) j["completions"] = b.completions;
  if constexpr (HasReferences<B>) if (!b.references.empty()) j["references"] = b.references;
  if constexpr (HasPrompts<B>) if (!b.prompts.empty()) j["prompts"] = b.prompts;
  if constexpr (std::is_same_v<B, json_batch>) {
    for (const auto& [k, t] : b.tensors) j["tensors"][k] = tensor_to_json(t, enc);
  } else if constexpr (HasImages<B>) {
    j["tensors"]["images"] = tensor_to_json(images_of(b), enc);
  }
  if constexpr (requires(nlohmann::json& out) { b.to_reward_json(out); }) b.to_reward_json(j);
  return j;
}

/// Reads a request body into a `json_batch`; throws `unirl::error` naming what is malformed.
inline json_batch decode_batch(const nlohmann::json& j) {
  UNIRL_CHECK(j.is_object(), "reward request: expected a JSON object, got ", j.dump().substr(0, 200));
  UNIRL_CHECK(j.contains("size") && j["size"].is_number_integer() && j["size"].get<std::int64_t>() >= 0,
              "reward request: expected a non-negative integer 'size'");
  json_batch b;
  b.count = j["size"].get<std::int64_t>();
  auto strings = [&](const char* key, std::vector<std::string>& out) {
    if (!j.contains(key)) return;
    UNIRL_CHECK(j[key].is_array(), "reward request: '", key, "' must be an array of strings");
    for (const auto& s : j[key]) {
      UNIRL_CHECK(s.is_string(), "reward request: '", key, "' must be an array of strings, found ", s.dump());
      out.push_back(s.get<std::string>());
    }
    UNIRL_CHECK(static_cast<std::int64_t>(out.size()) == b.count, "reward request: '", key, "' has ", out.size(),
                " entries for size ", b.count);
  };
  strings("completions", b.completions);
  strings("references", b.references);
  strings("prompts", b.prompts);
  if (j.contains("tensors")) {
    UNIRL_CHECK(j["tensors"].is_object(), "reward request: 'tensors' must be an object of named tensors");
    for (auto it = j["tensors"].begin(); it != j["tensors"].end(); ++it) {
      auto t = tensor_from_json(it.value(), it.key());
      UNIRL_CHECK(t.dim() >= 1 && t.size(0) == b.count, "reward request: tensor '", it.key(), "' of shape ", t.sizes(),
                  "; expected a leading dimension of size ", b.count);
      b.tensors[it.key()] = t;
    }
    if (b.tensors.count("images")) b.images = b.tensors["images"];
  }
  return b;
}

// ---------------------------------------------------------------------------------------------
// The client.

/// Options of `remote_scorer`.
struct remote_options {
  std::string url = "http://127.0.0.1:8000/score";  // http://host[:port][/path]
  double timeout_s = 30.0;            // per attempt: connect + send + complete response
  std::int64_t retries = 3;           // further attempts after the first fails
  double backoff_s = 0.2;             // wait before the first retry
  double backoff_multiplier = 2.0;    // each further wait is this much longer ...
  double backoff_max_s = 10.0;        // ... up to this
  std::int64_t max_concurrency = 4;   // requests in flight at once (all calls of this scorer)
  std::int64_t chunk_size = 0;        // > 0: split a batch into requests of at most this many samples
  tensor_encoding tensors = tensor_encoding::numbers;  // base64: raw bytes, for large images

  void validate(const std::string& prefix) const {
    options::require(url.rfind("http://", 0) == 0, prefix + "url", url, "an http:// URL (https is not supported)");
    options::require(timeout_s > 0, prefix + "timeout_s", timeout_s, "> 0");
    options::require(retries >= 0, prefix + "retries", retries, ">= 0");
    options::require(backoff_s >= 0, prefix + "backoff_s", backoff_s, ">= 0");
    options::require(backoff_multiplier >= 1, prefix + "backoff_multiplier", backoff_multiplier, ">= 1");
    options::require(backoff_max_s >= 0, prefix + "backoff_max_s", backoff_max_s, ">= 0");
    options::require(max_concurrency >= 1, prefix + "max_concurrency", max_concurrency, ">= 1");
    options::require(chunk_size >= 0, prefix + "chunk_size", chunk_size, ">= 0");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::remote_options, url, timeout_s, retries, backoff_s, backoff_multiplier,
                        backoff_max_s, max_concurrency, chunk_size, tensors);
namespace unirl::rewards {

/// The parts of an http:// URL.
struct parsed_url {
  std::string host, port, target;
};

/// Splits `http://host[:port][/path]`; throws `config_error` naming the URL when it is not one.
inline parsed_url parse_url(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) throw config_error("url", "'" + url + "' is not an http:// URL");
  const auto rest = url.substr(scheme.size());
  const auto slash = rest.find('/');
  const auto authority = rest.substr(0, slash);
  parsed_url u;
  u.target = slash == std::string::npos ? "/" : rest.substr(slash);
  const auto colon = authority.rfind(':');
  if (colon == std::string::npos) {
    u.host = authority;
    u.port = "80";
  } else {
    u.host = authority.substr(0, colon);
    u.port = authority.substr(colon + 1);
  }
  if (u.host.empty() || u.port.empty() || u.port.find_first_not_of("0123456789") != std::string::npos)
    throw config_error("url", "'" + url + "' has no valid host[:port]");
  return u;
}

/// The body and status of one HTTP exchange.
struct http_result {
  unsigned status = 0;
  std::string body;
};

/// One HTTP/1.1 POST with a deadline covering connect, send and the whole response; throws
/// `unirl::error` with the cause (timed out, connection refused, closed early, ...).
inline http_result http_post(const parsed_url& u, const std::string& body, double timeout_s,
                             std::string_view content_type = "application/json") {
  namespace beast = boost::beast;
  namespace http = beast::http;
  namespace net = boost::asio;
  using tcp = net::ip::tcp;

  net::io_context ioc;
  tcp::resolver resolver(ioc);
  beast::tcp_stream stream(ioc);
  beast::flat_buffer buffer;
  http::request<http::string_body> req{http::verb::post, u.target, 11};
  req.set(http::field::host, u.host);
  req.set(http::field::user_agent, "unirl-reward-client");
  req.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
  req.keep_alive(false);
  req.body() = body;
  req.prepare_payload();
  http::response_parser<http::string_body> parser;
  parser.body_limit(std::uint64_t{1} << 30);

  beast::error_code failure;
  std::string stage;
  const auto deadline = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  auto fail = [&](beast::error_code ec, const char* where) {
    failure = ec;
    stage = where;
  };
  resolver.async_resolve(u.host, u.port, [&](beast::error_code ec, tcp::resolver::results_type results) {
    if (ec) return fail(ec, "resolving the host");
    stream.expires_after(deadline);
    stream.async_connect(results, [&](beast::error_code ec, const tcp::endpoint&) {
      if (ec) return fail(ec, "connecting");
      http::async_write(stream, req, [&](beast::error_code ec, std::size_t) {
        if (ec) return fail(ec, "sending the request");
        http::async_read(stream, buffer, parser, [&](beast::error_code ec, std::size_t) {
          if (ec) return fail(ec, "reading the response");
          beast::error_code ignored;
          stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
        });
      });
    });
  });
  ioc.run();
  if (failure) {
    if (failure == beast::error::timeout)
      throw error(unirl::detail::concat("timed out after ", timeout_s, " s while ", stage));
    if (failure == net::error::connection_refused) throw error("connection refused");
    if (failure == http::error::end_of_stream || failure == net::error::eof || failure == net::error::connection_reset ||
        failure == http::error::partial_message)
      throw error("the server closed the connection while " + stage + " (" + failure.message() + ")");
    throw error(stage + " failed: " + failure.message());
  }
  return {parser.get().result_int(), parser.get().body()};
}

/// Rewards from a response body: exactly `n` finite numbers under "rewards"; `components` (if
/// given) receives the optional per-component means. Throws `unirl::error` naming the defect.
inline torch::Tensor parse_rewards(const std::string& body, std::int64_t n, std::map<std::string, double>* components = nullptr) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    throw error("malformed JSON response (" + std::string(e.what()) + "): '" + body.substr(0, 120) + "'");
  }
  if (!j.is_object() || !j.contains("rewards") || !j["rewards"].is_array())
    throw error("the response has no \"rewards\" array: '" + body.substr(0, 120) + "'");
  const auto& r = j["rewards"];
  if (static_cast<std::int64_t>(r.size()) != n)
    throw error(unirl::detail::concat("the response has ", r.size(), " rewards for a batch of ", n,
                               "; expected exactly one per sample"));
  std::vector<float> v;
  v.reserve(r.size());
  for (std::size_t i = 0; i < r.size(); ++i) {
    if (!r[i].is_number() || !std::isfinite(r[i].get<double>()))
      throw error(unirl::detail::concat("reward ", i, " of the response is not a finite number: ", r[i].dump()));
    v.push_back(r[i].get<float>());
  }
  if (components && j.contains("components") && j["components"].is_object())
    for (auto it = j["components"].begin(); it != j["components"].end(); ++it)
      if (it.value().is_number()) (*components)[it.key()] = it.value().get<double>();
  return to_scores(v);
}

/// A scorer backed by a remote reward service (see the file comment for the schema). Copies
/// share the connection limit and statistics; all members are safe to call from several threads.
class remote_scorer {
 public:
  using options = remote_options;
  static constexpr std::string_view name = "remote";

  remote_scorer() : remote_scorer(options{}) {}
  explicit remote_scorer(options o) : state_(std::make_shared<state>()) {
    unirl::options::validate(o);
    state_->url = parse_url(o.url);
    state_->opts = std::move(o);
  }

  /// Scores a batch, blocking until the service answers (or fails after the retries).
  template <class B>
  torch::Tensor operator()(const B& batch) { return submit(batch).get(); }

  /// Starts scoring a batch and returns at once; the batch is encoded before returning, so it may
  /// be modified or destroyed. `get()` rethrows the `runtime_failure` of a failed request.
  template <class B>
  std::future<torch::Tensor> submit(const B& batch) {
    const std::int64_t n = batch_size(batch);
    const auto chunk = state_->opts.chunk_size > 0 ? state_->opts.chunk_size : std::max<std::int64_t>(n, 1);
    std::vector<std::pair<std::string, std::int64_t>> bodies;
    if (n <= chunk) {
      bodies.emplace_back(encode_batch(batch, state_->opts.tensors).dump(), n);
    } else {
      if constexpr (RolloutBatch<B>) {
        for (std::int64_t s = 0; s < n; s += chunk) {
          const auto len = std::min(chunk, n - s);
          bodies.emplace_back(encode_batch(batch.select(torch::arange(s, s + len, torch::kInt64)), state_->opts.tensors).dump(), len);
        }
      } else {
        throw config_error("chunk_size", "is set but the batch type has no select(index) to split it");
      }
    }
    auto st = state_;
    return std::async(std::launch::async, [st, bodies = std::move(bodies)]() -> torch::Tensor {
      // At most max_concurrency workers pull chunks in order; the slot limit also holds across calls.
      const auto n_parts = bodies.size();
      std::vector<torch::Tensor> out(n_parts);
      std::vector<std::map<std::string, double>> part_comps(n_parts);
      std::vector<std::exception_ptr> errors(n_parts);
      std::atomic<std::size_t> next{0};
      std::atomic<bool> failed{false};
      auto work = [&] {
        for (std::size_t i = next++; i < n_parts && !failed; i = next++) {
          try {
            std::tie(out[i], part_comps[i]) = request(*st, bodies[i].first, bodies[i].second);
          } catch (...) {
            errors[i] = std::current_exception();
            failed = true;  // the batch is lost anyway: send no more of it
          }
        }
      };
      const auto n_workers = std::min<std::size_t>(n_parts, static_cast<std::size_t>(st->opts.max_concurrency));
      std::vector<std::thread> workers;
      for (std::size_t w = 1; w < n_workers; ++w) workers.emplace_back(work);
      work();
      for (auto& w : workers) w.join();
      std::map<std::string, double> comps;
      std::exception_ptr first_error;
      for (std::size_t i = 0; i < n_parts; ++i) {
        if (errors[i] && !first_error) first_error = errors[i];
        if (!errors[i])
          for (const auto& [k, v] : part_comps[i]) comps[k] += v * static_cast<double>(out[i].numel());
      }
      if (first_error) std::rethrow_exception(first_error);  // never a partial batch
      auto r = out.size() == 1 ? out.front() : torch::cat(out, 0);
      {
        std::lock_guard lock(st->mutex);
        st->components.clear();
        for (const auto& [k, v] : comps) st->components[k] = r.numel() > 0 ? v / static_cast<double>(r.numel()) : 0.0;
      }
      return r;
    });
  }

  /// Per-component means the service reported for the last completed call (empty if none).
  std::map<std::string, double> last_components() const {
    std::lock_guard lock(state_->mutex);
    return state_->components;
  }
  /// HTTP attempts made so far (all calls), failed ones included.
  std::int64_t attempts() const {
    std::lock_guard lock(state_->mutex);
    return state_->attempts;
  }
  const options& opts() const { return state_->opts; }

 private:
  struct state {
    options opts;
    parsed_url url;
    mutable std::mutex mutex;
    std::condition_variable slot_free;
    std::int64_t in_flight = 0, attempts = 0;
    std::map<std::string, double> components;
  };

  // One request with its retries; bounded by the connection limit.
  static std::pair<torch::Tensor, std::map<std::string, double>> request(state& st, const std::string& body, std::int64_t n) {
    const auto& o = st.opts;
    std::string cause;
    double wait = o.backoff_s;
    for (std::int64_t attempt = 0; attempt <= o.retries; ++attempt) {
      if (attempt > 0) {
        std::this_thread::sleep_for(std::chrono::duration<double>(wait));
        wait = std::min(wait * o.backoff_multiplier, o.backoff_max_s);
      }
      {
        std::unique_lock lock(st.mutex);
        st.slot_free.wait(lock, [&] { return st.in_flight < o.max_concurrency; });
        ++st.in_flight;
        ++st.attempts;
      }
      struct release {
        state& s;
        ~release() {
          {
            std::lock_guard lock(s.mutex);
            --s.in_flight;
          }
          s.slot_free.notify_one();
        }
      };
      try {
        release guard{st};
        const auto res = http_post(st.url, body, o.timeout_s);
        if (res.status != 200) {
          std::string detail_text = res.body.substr(0, 200);
          try {
            const auto j = nlohmann::json::parse(res.body);
            if (j.is_object() && j.contains("error") && j["error"].is_string()) detail_text = j["error"].get<std::string>();
          } catch (...) {
          }
          throw error(unirl::detail::concat("HTTP ", res.status, ": ", detail_text));
        }
        std::map<std::string, double> comps;
        auto r = parse_rewards(res.body, n, &comps);
        return {r, comps};
      } catch (const std::exception& e) {
        cause = e.what();
      }
    }
    throw runtime_failure(unirl::detail::concat("unirl: remote reward service ", o.url, " failed after ", o.retries + 1,
                                         " attempt(s): ", cause));
  }

  std::shared_ptr<state> state_;
};

}  // namespace unirl::rewards
