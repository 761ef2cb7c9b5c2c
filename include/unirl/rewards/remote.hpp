#pragma once
/// \file remote.hpp
/// A remote reward service: `remote_scorer` sends batches as JSON over HTTP/1.1 (Boost.Beast)
/// with a timeout, retries with exponential backoff and bounded concurrency, and can score
/// asynchronously (`submit` returns a `std::future`) so the next rollout overlaps the scoring.
/// It never returns partial or invented rewards: every failure is thrown as `unirl::runtime_failure`
/// naming the URL and the cause (server text escaped and cut short). Transient failures — no
/// connection, a timeout, HTTP 5xx, 408, 429 — are retried as configured (after the backoff, or
/// the server's `Retry-After`), all within `deadline_s`; the others fail at once: any other 4xx, a
/// redirect (its `Location` is in the message; `follow_redirects` follows it), and a response that
/// breaks the schema (malformed JSON, no "rewards", a wrong count, a reward that is not finite or
/// outside float32's range).
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
#include <ctime>
#include <deque>
#include <array>
#include <cstdint>
#include <limits>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <time.h>

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
#include <unirl/rewards/http_client.hpp>
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

/// Decodes base64 `s` into `out` (room for `capacity` bytes); returns the bytes written.
inline std::size_t base64_decode_into(std::string_view s, const std::string& key, unsigned char* out, std::size_t capacity) {
  auto value = [&](char c) -> std::uint32_t {
    if (c >= 'A' && c <= 'Z') return static_cast<std::uint32_t>(c - 'A');
    if (c >= 'a' && c <= 'z') return static_cast<std::uint32_t>(c - 'a' + 26);
    if (c >= '0' && c <= '9') return static_cast<std::uint32_t>(c - '0' + 52);
    if (c == '+') return 62;
    if (c == '/') return 63;
    throw error("tensor '" + key + "': invalid base64 character '" + std::string(1, c) + "'");
  };
  UNIRL_CHECK(s.size() % 4 == 0, "tensor '", key, "': base64 text of length ", s.size(), "; expected a multiple of 4");
  std::size_t n = 0;
  auto put = [&](std::uint32_t byte) {
    UNIRL_CHECK(n < capacity, "tensor '", key, "': its base64 text holds more than the ", capacity, " bytes expected");
    out[n++] = static_cast<unsigned char>(byte);
  };
  for (std::size_t i = 0; i < s.size(); i += 4) {
    const bool pad2 = s[i + 2] == '=', pad3 = s[i + 3] == '=';
    const std::uint32_t v = (value(s[i]) << 18) | (value(s[i + 1]) << 12) | (pad2 ? 0u : value(s[i + 2]) << 6) |
                            (pad3 ? 0u : value(s[i + 3]));
    put(v >> 16);
    if (!pad2) put((v >> 8) & 255);
    if (!pad3) put(v & 255);
  }
  return n;
}

inline std::vector<unsigned char> base64_decode(const std::string& s, const std::string& key) {
  std::vector<unsigned char> out(s.size() / 4 * 3);
  out.resize(base64_decode_into(s, key, out.data(), out.size()));
  return out;
}

/// The torch dtype of a wire dtype name (bool travels as int64 0 / 1).
inline torch::ScalarType wire_type(const std::string& dtype, const std::string& key) {
  UNIRL_CHECK(dtype == "float32" || dtype == "float64" || dtype == "int64" || dtype == "bool", "tensor '", key,
              "': dtype '", dtype, "'; expected float32, float64, int64 or bool");
  return dtype == "float64" ? torch::kFloat64 : dtype == "float32" ? torch::kFloat32 : torch::kInt64;
}

/// The element count of `shape`, checked: no negative dimension, no overflow.
inline std::int64_t wire_numel(const std::vector<std::int64_t>& shape, const std::string& key) {
  std::int64_t numel = 1;
  for (auto d : shape) {
    UNIRL_CHECK(d >= 0, "tensor '", key, "': negative dimension ", d, " in its shape");
    UNIRL_CHECK(!__builtin_mul_overflow(numel, d, &numel), "tensor '", key, "': its shape has more elements than an int64 counts");
  }
  return numel;
}

/// A (numel,) tensor of `type` from base64 text, decoded straight into its storage.
inline torch::Tensor tensor_from_base64(std::string_view b64, torch::ScalarType type, std::int64_t numel,
                                        const std::string& key, const std::string& shape_text, const std::string& dtype) {
  UNIRL_CHECK(std::endian::native == std::endian::little, "tensor '", key, "': base64 tensors are little-endian; this host is not");
  UNIRL_CHECK(b64.size() % 4 == 0, "tensor '", key, "': base64 text of length ", b64.size(), "; expected a multiple of 4");
  const auto width = static_cast<std::int64_t>(torch::elementSize(type));
  const auto bytes = b64.size() / 4 * 3 - (b64.size() >= 1 && b64.back() == '=') - (b64.size() >= 2 && b64[b64.size() - 2] == '=');
  UNIRL_CHECK(numel <= std::numeric_limits<std::int64_t>::max() / width && static_cast<std::int64_t>(bytes) == numel * width,
              "tensor '", key, "': ", bytes, " bytes for shape ", shape_text, " of ", dtype, "; expected ", numel * width);
  auto t = torch::empty({numel}, type);
  if (numel > 0) base64_decode_into(b64, key, static_cast<unsigned char*>(t.data_ptr()), bytes);
  return t;
}

/// Reads `n` JSON numbers through `at(i)` into a (n,) tensor of `type` (no intermediate copy).
template <class At>
torch::Tensor tensor_from_numbers(std::int64_t n, torch::ScalarType type, const std::string& key, At at) {
  auto t = torch::empty({n}, type);
  auto bad = [&](std::int64_t i, const nlohmann::json& v) {
    throw error(unirl::detail::concat("tensor '", key, "': its data are not all numbers: value ", i, " is ",
                                      v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).substr(0, 40)));
  };
  for (std::int64_t i = 0; i < n; ++i) {
    const nlohmann::json& v = at(i);
    if (!v.is_number()) bad(i, v);
    if (type == torch::kInt64) {
      UNIRL_CHECK(v.is_number_integer(), "tensor '", key, "': value ", i, " (", v.dump(), ") of an int64 tensor is not an integer");
      t.data_ptr<std::int64_t>()[i] = v.get<std::int64_t>();
    } else if (type == torch::kFloat64) {
      t.data_ptr<double>()[i] = v.get<double>();
    } else {
      t.data_ptr<float>()[i] = static_cast<float>(v.get<double>());
    }
  }
  return t;
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
              j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).substr(0, 200));
  std::vector<std::int64_t> shape;
  for (const auto& d : j["shape"]) {
    UNIRL_CHECK(d.is_number_integer(), "tensor '", key, "': shape ", j["shape"].dump(), " is not a list of integers");
    shape.push_back(d.get<std::int64_t>());
  }
  const auto numel = detail::wire_numel(shape, key);
  const std::string dtype = j.contains("dtype") && j["dtype"].is_string() ? j["dtype"].get<std::string>() : "float32";
  const auto type = detail::wire_type(dtype, key);
  torch::Tensor t;
  if (b64) {
    t = detail::tensor_from_base64(j["base64"].get_ref<const std::string&>(), type, numel, key, j["shape"].dump(), dtype);
  } else {
    const auto& data = j["data"];
    UNIRL_CHECK(static_cast<std::int64_t>(data.size()) == numel, "tensor '", key, "': ", data.size(),
                " values for shape ", j["shape"].dump(), "; expected ", numel);
    t = detail::tensor_from_numbers(numel, type, key, [&](std::int64_t i) -> const nlohmann::json& { return data[static_cast<std::size_t>(i)]; });
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

namespace detail {
// Builds a json_batch while the request text is parsed (nlohmann's SAX interface): strings move
// straight into the batch and tensor numbers into one flat buffer per tensor, with no JSON tree in
// between, so a request costs a small multiple of its body whatever it holds (a tree costs 16+
// bytes per number). Unknown fields are skipped, as decode_batch(json) ignores them.
class batch_reader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  json_batch finish() {
    UNIRL_CHECK(has_size_, "reward request: expected a non-negative integer 'size'");
    b_.count = size_;
    check_count("completions", b_.completions);
    check_count("references", b_.references);
    check_count("prompts", b_.prompts);
    for (auto& [name, p] : tensors_) {
      UNIRL_CHECK(p.has_shape && (p.has_base64 || p.has_data), "tensor '", name,
                  "': expected {\"dtype\", \"shape\": [...], \"data\": [...] or \"base64\": \"...\"}");
      const auto numel = wire_numel(p.shape, name);
      const auto type = wire_type(p.dtype, name);
      const auto shape_text = nlohmann::json(p.shape).dump();
      torch::Tensor t;
      if (p.has_base64) {
        t = tensor_from_base64(p.base64, type, numel, name, shape_text, p.dtype);
        std::string().swap(p.base64);
      } else {
        const auto count = static_cast<std::int64_t>(p.reals.empty() ? p.ints.size() : p.reals.size());
        UNIRL_CHECK(count == numel, "tensor '", name, "': ", count, " values for shape ", shape_text, "; expected ", numel);
        t = torch::empty({numel}, type);
        if (type == torch::kInt64) {
          UNIRL_CHECK(p.reals.empty() || numel == 0, "tensor '", name, "': an int64 tensor with a value that is not an integer");
          std::copy(p.ints.begin(), p.ints.end(), t.data_ptr<std::int64_t>());
        } else if (type == torch::kFloat64) {
          if (p.reals.empty()) std::transform(p.ints.begin(), p.ints.end(), t.data_ptr<double>(), [](std::int64_t v) { return static_cast<double>(v); });
          else std::copy(p.reals.begin(), p.reals.end(), t.data_ptr<double>());
        } else {
          if (p.reals.empty()) std::transform(p.ints.begin(), p.ints.end(), t.data_ptr<float>(), [](std::int64_t v) { return static_cast<float>(v); });
          else std::transform(p.reals.begin(), p.reals.end(), t.data_ptr<float>(), [](double v) { return static_cast<float>(v); });
        }
        std::deque<double>().swap(p.reals);
        std::deque<std::int64_t>().swap(p.ints);
      }
      if (p.dtype == "bool") t = t.to(torch::kBool);
      t = t.reshape(p.shape);
      UNIRL_CHECK(t.dim() >= 1 && t.size(0) == b_.count, "reward request: tensor '", name, "' of shape ", t.sizes(),
                  "; expected a leading dimension of size ", b_.count);
      b_.tensors[name] = t;
    }
    if (b_.tensors.count("images")) b_.images = b_.tensors["images"];
    return std::move(b_);
  }

  bool null() override { return scalar("null"); }
  bool boolean(bool v) override { return scalar(v ? "true" : "false"); }
  bool number_integer(number_integer_t v) override { return integer(v); }
  bool number_unsigned(number_unsigned_t v) override {
    if (v <= static_cast<number_unsigned_t>(std::numeric_limits<std::int64_t>::max())) return integer(static_cast<std::int64_t>(v));
    return real(static_cast<double>(v), std::to_string(v));
  }
  bool number_float(number_float_t v, const string_t& text) override { return real(v, text); }
  bool string(string_t& v) override {
    if (skip_) return true;
    switch (where_) {
      // A copy, sized exactly (a moved-out token has up to twice its length in capacity, and the
      // parser would regrow its buffer for the next one).
      case at::text_array: text_->emplace_back(v.data(), v.size()); return true;
      case at::tensor_field:
        if (field_ == "dtype") tensor().dtype = std::move(v);
        if (field_ == "base64") tensor().base64 = std::move(v), tensor().has_base64 = true;
        UNIRL_CHECK(field_ != "shape" && field_ != "data", "tensor '", tensor_name_, "': '", field_, "' cannot be a string");
        where_ = at::tensor;
        return true;
      default: return scalar("\"" + v.substr(0, 40) + "\"");
    }
  }
  bool binary(binary_t&) override { return scalar("binary"); }
  bool start_object(std::size_t) override {
    if (skip_) return ++skip_, true;
    switch (where_) {
      case at::start: where_ = at::root; return true;
      case at::root_field:
        if (field_ != "tensors") return skip_ = 1, true;
        where_ = at::tensors; return true;
      case at::tensors_field: where_ = at::tensor; tensors_[tensor_name_]; return true;
      case at::tensor_field: return skip_ = 1, true;
      default: return unexpected("an object");
    }
  }
  bool key(string_t& k) override {
    if (skip_) return true;
    switch (where_) {
      case at::root: field_ = std::move(k); where_ = at::root_field; return true;
      case at::tensors: tensor_name_ = std::move(k); where_ = at::tensors_field; return true;
      case at::tensor: field_ = std::move(k); where_ = at::tensor_field; return true;
      default: return true;
    }
  }
  bool end_object() override {
    if (skip_) return end_skipped();
    if (where_ == at::root) where_ = at::done;
    else if (where_ == at::tensors) where_ = at::root;
    else if (where_ == at::tensor) where_ = at::tensors;
    return true;
  }
  bool start_array(std::size_t) override {
    if (skip_) return ++skip_, true;
    if (where_ == at::root_field) {
      if (field_ == "completions") text_ = &b_.completions;
      else if (field_ == "references") text_ = &b_.references;
      else if (field_ == "prompts") text_ = &b_.prompts;
      else return skip_ = 1, true;
      text_key_ = field_;
      seen_.push_back(field_);
      where_ = at::text_array;
      return true;
    }
    if (where_ == at::tensor_field && (field_ == "shape" || field_ == "data")) {
      where_ = field_ == "shape" ? at::shape_array : at::data_array;
      if (field_ == "shape") tensor().has_shape = true;
      else tensor().has_data = true;
      return true;
    }
    if (where_ == at::tensor_field) return skip_ = 1, true;
    if (where_ == at::start) return unexpected("an array");
    return unexpected("a nested array");
  }
  bool end_array() override {
    if (skip_) return end_skipped();
    if (where_ == at::text_array) where_ = at::root;
    else if (where_ == at::shape_array || where_ == at::data_array) where_ = at::tensor;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    throw error(std::string("reward request: malformed JSON: ") + e.what());
  }

 private:
  enum class at { start, root, root_field, text_array, tensors, tensors_field, tensor, tensor_field, shape_array, data_array, done };
  struct pending_tensor {
    std::string dtype = "float32", base64;
    std::vector<std::int64_t> shape;
    // The numbers of "data", in blocks (no reallocation doubling the peak): integers while all are,
    // then every value as a double from the first non-integer on.
    std::deque<std::int64_t> ints;
    std::deque<double> reals;
    bool has_shape = false, has_data = false, has_base64 = false;
  };
  pending_tensor& tensor() { return tensors_[tensor_name_]; }

  bool integer(std::int64_t v) {
    if (skip_) return true;
    if (where_ == at::root_field && field_ == "size") {
      UNIRL_CHECK(v >= 0, "reward request: expected a non-negative integer 'size', got ", v);
      size_ = v, has_size_ = true, where_ = at::root;
      return true;
    }
    if (where_ == at::shape_array) return tensor().shape.push_back(v), true;
    if (where_ == at::data_array) {
      auto& p = tensor();
      if (p.reals.empty()) p.ints.push_back(v);
      else p.reals.push_back(static_cast<double>(v));
      return true;
    }
    return scalar(std::to_string(v));
  }
  bool real(double v, const std::string& text) {
    if (skip_) return true;
    if (where_ == at::data_array) {
      auto& p = tensor();
      if (p.reals.empty() && !p.ints.empty()) {
        for (auto i : p.ints) p.reals.push_back(static_cast<double>(i));
        std::deque<std::int64_t>().swap(p.ints);
      }
      p.reals.push_back(v);
      return true;
    }
    return scalar(text);
  }
  // A scalar where it is not expected: an error for a known field, nothing for an unknown one.
  bool scalar(const std::string& text) {
    if (skip_) return true;
    switch (where_) {
      case at::root_field:
        UNIRL_CHECK(field_ != "size", "reward request: expected a non-negative integer 'size', got ", text);
        UNIRL_CHECK(field_ != "completions" && field_ != "references" && field_ != "prompts", "reward request: '", field_,
                    "' must be an array of strings");
        UNIRL_CHECK(field_ != "tensors", "reward request: 'tensors' must be an object of named tensors");
        where_ = at::root;
        return true;
      case at::text_array: throw error("reward request: '" + text_key_ + "' must be an array of strings, found " + text);
      case at::tensors_field: throw error("tensor '" + tensor_name_ + "': expected an object, got " + text);
      case at::tensor_field:
        UNIRL_CHECK(field_ != "dtype" && field_ != "base64" && field_ != "shape" && field_ != "data", "tensor '",
                    tensor_name_, "': '", field_, "' cannot be ", text);
        where_ = at::tensor;
        return true;
      case at::shape_array: throw error("tensor '" + tensor_name_ + "': its shape holds " + text + "; expected integers");
      case at::data_array: throw error("tensor '" + tensor_name_ + "': its data are not all numbers: found " + text);
      default: return unexpected(text);
    }
  }
  bool end_skipped() {
    if (--skip_ == 0) where_ = where_ == at::root_field ? at::root : where_ == at::tensor_field ? at::tensor : where_;
    return true;
  }
  bool unexpected(const std::string& what) {
    if (where_ == at::start) throw error("reward request: expected a JSON object, got " + what);
    throw error("reward request: unexpected " + what + (field_.empty() ? "" : " in '" + field_ + "'"));
  }
  template <class V>
  void check_count(const char* key, const V& v) const {
    if (std::find(seen_.begin(), seen_.end(), key) == seen_.end()) return;
    UNIRL_CHECK(static_cast<std::int64_t>(v.size()) == size_, "reward request: '", key, "' has ", v.size(),
                " entries for size ", size_);
  }

  json_batch b_;
  std::map<std::string, pending_tensor> tensors_;
  std::vector<std::string>* text_ = nullptr;
  std::vector<std::string> seen_;  // the text fields the request has
  std::string field_, text_key_, tensor_name_;
  std::int64_t size_ = 0, skip_ = 0;
  bool has_size_ = false;
  at where_ = at::start;
};
}  // namespace detail

/// Reads a request body straight from its text (what the server does): the same checks and the
/// same batch as `decode_batch(nlohmann::json::parse(body))`, in a small multiple of the body's
/// memory. Throws `unirl::error` naming what is malformed.
inline json_batch decode_request(std::string_view body) {
  detail::batch_reader reader;
  nlohmann::json::sax_parse(body, &reader);
  return reader.finish();
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
  double deadline_s = 300.0;          // one request with all its retries and waits; caps each attempt's timeout
  bool follow_redirects = false;      // re-send the POST to a 301/302/307/308's Location (http://, at most 5 hops)

  void validate(const std::string& prefix) const {
    options::require(url.rfind("http://", 0) == 0, prefix + "url", url, "an http:// URL (https is not supported)");
    options::require(timeout_s > 0, prefix + "timeout_s", timeout_s, "> 0");
    options::require(retries >= 0, prefix + "retries", retries, ">= 0");
    options::require(backoff_s >= 0, prefix + "backoff_s", backoff_s, ">= 0");
    options::require(backoff_multiplier >= 1, prefix + "backoff_multiplier", backoff_multiplier, ">= 1");
    options::require(backoff_max_s >= 0, prefix + "backoff_max_s", backoff_max_s, ">= 0");
    options::require(max_concurrency >= 1, prefix + "max_concurrency", max_concurrency, ">= 1");
    options::require(chunk_size >= 0, prefix + "chunk_size", chunk_size, ">= 0");
    options::require(deadline_s > 0, prefix + "deadline_s", deadline_s, "> 0");
  }
};
}  // namespace unirl::rewards
BOOST_HANA_ADAPT_STRUCT(unirl::rewards::remote_options, url, timeout_s, retries, backoff_s, backoff_multiplier,
                        backoff_max_s, max_concurrency, chunk_size, tensors, deadline_s, follow_redirects);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::rewards::remote_options>{
    unirl::options::field_doc{"url", "the reward service: http://host[:port][/path]"},
    unirl::options::field_doc{"timeout_s", "seconds per attempt (connect, send, response)"},
    unirl::options::field_doc{"retries", "further attempts after the first fails"},
    unirl::options::field_doc{"backoff_s", "wait before the first retry, seconds"},
    unirl::options::field_doc{"backoff_multiplier", "each further wait is this much longer"},
    unirl::options::field_doc{"backoff_max_s", "longest wait between retries, seconds"},
    unirl::options::field_doc{"max_concurrency", "requests in flight at once"},
    unirl::options::field_doc{"chunk_size", "> 0: split a batch into requests of at most this many samples"},
    unirl::options::field_doc{"tensors", "how tensors travel: numbers, or base64 raw bytes"},
    unirl::options::field_doc{"deadline_s", "seconds for one request with all its retries"},
    unirl::options::field_doc{"follow_redirects", "re-send the POST to a redirect's Location (at most 5 hops)"}};
namespace unirl::rewards {

/// Rewards from a response body: exactly `n` finite numbers under "rewards", each within float32's
/// range (1e39 is refused, not turned into inf); `components` (if given) receives the optional
/// per-component means. `first_sample` is the batch index of the first reward (chunked requests),
/// for the messages. Throws `unirl::error` naming the defect (the sample index, an escaped excerpt
/// of the body).
inline torch::Tensor parse_rewards(const std::string& body, std::int64_t n, std::map<std::string, double>* components = nullptr,
                                   std::int64_t first_sample = 0) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    throw detail::permanent_error("malformed JSON response (" + detail::excerpt(e.what(), 200) + "): '" + detail::excerpt(body) + "'");
  }
  if (!j.is_object() || !j.contains("rewards") || !j["rewards"].is_array())
    throw detail::permanent_error("the response has no \"rewards\" array: '" + detail::excerpt(body) + "'");
  const auto& r = j["rewards"];
  if (static_cast<std::int64_t>(r.size()) != n)
    throw detail::permanent_error(unirl::detail::concat("the response has ", r.size(), " rewards for a batch of ", n,
                                                        "; expected exactly one per sample"));
  auto sample = [&](std::size_t i) {
    return first_sample == 0 ? std::string() : unirl::detail::concat(" (sample ", first_sample + static_cast<std::int64_t>(i), " of the batch)");
  };
  std::vector<float> v;
  v.reserve(r.size());
  for (std::size_t i = 0; i < r.size(); ++i) {
    if (!r[i].is_number() || !std::isfinite(r[i].get<double>()))
      throw detail::permanent_error(unirl::detail::concat("reward ", i, " of the response is not a finite number: ",
                                                          detail::excerpt(r[i].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), 40), sample(i)));
    const double x = r[i].get<double>();
    if (std::abs(x) > static_cast<double>(std::numeric_limits<float>::max()))
      throw detail::permanent_error(unirl::detail::concat("reward ", i, " of the response is ", x, sample(i),
                                                          ", outside the range of float32 (|r| <= ", std::numeric_limits<float>::max(),
                                                          "); expected a finite float32 reward"));
    v.push_back(static_cast<float>(x));
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
    std::vector<part> bodies;
    if (n <= chunk) {
      bodies.push_back({encode_batch(batch, state_->opts.tensors).dump(), n, 0});
    } else {
      if constexpr (RolloutBatch<B>) {
        for (std::int64_t s = 0; s < n; s += chunk) {
          const auto len = std::min(chunk, n - s);
          bodies.push_back({encode_batch(batch.select(torch::arange(s, s + len, torch::kInt64)), state_->opts.tensors).dump(), len, s});
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
            std::tie(out[i], part_comps[i]) = request(*st, bodies[i]);
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
  struct part {
    std::string body;
    std::int64_t n = 0, first = 0;  // samples, index of the first in the batch
  };
  struct state {
    options opts;
    parsed_url url;
    mutable std::mutex mutex;
    std::condition_variable slot_free;
    std::int64_t in_flight = 0, attempts = 0;
    std::map<std::string, double> components;
  };

  // One request with its retries, bounded in count (retries), in time (deadline_s) and by the
  // connection limit. Transient failures (no connection, timeouts, 5xx, 408, 429) are retried
  // after the backoff or the server's Retry-After; the others fail at once.
  static std::pair<torch::Tensor, std::map<std::string, double>> request(state& st, const part& p) {
    using clock = std::chrono::steady_clock;
    const auto& o = st.opts;
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(o.deadline_s));
    auto remaining = [&] { return std::chrono::duration<double>(deadline - clock::now()).count(); };
    auto failure = [&](std::int64_t attempts, const std::string& how, const std::string& cause) {
      return runtime_failure(unirl::detail::concat("unirl: remote reward service ", o.url, " failed after ", attempts,
                                                   " attempt(s)", how, ": ", cause));
    };
    double backoff = o.backoff_s;
    for (std::int64_t attempt = 0;; ++attempt) {
      std::string cause;
      std::optional<double> retry_after;
      {
        std::unique_lock lock(st.mutex);
        if (!st.slot_free.wait_until(lock, deadline, [&] { return st.in_flight < o.max_concurrency; }))
          throw failure(attempt, "", unirl::detail::concat("no connection slot came free within deadline_s = ", o.deadline_s,
                                                           " s (max_concurrency = ", o.max_concurrency, ")"));
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
        auto target = st.url;
        for (int hop = 0;; ++hop) {
          const auto res = http_post(target, p.body, std::min(o.timeout_s, std::max(remaining(), 1e-3)));
          if (res.status == 200) {
            std::map<std::string, double> comps;
            auto r = parse_rewards(res.body, p.n, &comps, p.first);
            return {r, comps};
          }
          const auto status_text = unirl::detail::concat("HTTP ", res.status);
          if (res.status >= 300 && res.status < 400) {
            const auto where = res.location.empty() ? std::string("no Location") : "Location: " + detail::excerpt(res.location, 200);
            const bool followable = res.status == 301 || res.status == 302 || res.status == 307 || res.status == 308;
            if (!o.follow_redirects || !followable || res.location.empty())
              throw detail::permanent_error(status_text + " (" + where + "): redirect not followed" +
                                            (followable && !res.location.empty() ? "; use that URL or set follow_redirects" : ""));
            if (hop >= 5) throw detail::permanent_error(status_text + " (" + where + "): more than 5 redirects");
            target = redirect_target(target, res.location);
            continue;
          }
          // The server's reason: its {"error": ...} or an excerpt of the body, escaped and cut.
          std::string why;
          try {
            const auto j = nlohmann::json::parse(res.body);
            if (j.is_object() && j.contains("error") && j["error"].is_string()) why = detail::excerpt(j["error"].get<std::string>(), 300);
          } catch (...) {
          }
          if (why.empty()) why = detail::excerpt(res.body);
          if (!res.content_encoding.empty()) why += " (Content-Encoding: " + detail::excerpt(res.content_encoding, 40) + ")";
          if (!res.retry_after.empty()) why += " (Retry-After: " + detail::excerpt(res.retry_after, 40) + ")";
          const bool transient = res.status >= 500 || res.status == 408 || res.status == 429;
          if (!transient) throw detail::permanent_error(status_text + ": " + why);
          if (!res.retry_after.empty()) retry_after = detail::parse_retry_after(res.retry_after);
          throw error(status_text + ": " + why);
        }
      } catch (const detail::permanent_error& e) {
        throw failure(attempt + 1, ", not retried (the same request would fail again)", e.what());
      } catch (const std::exception& e) {
        cause = e.what();
      }
      if (attempt >= o.retries) throw failure(attempt + 1, "", cause);
      const double pause = retry_after ? *retry_after : backoff;
      if (!retry_after) backoff = std::min(backoff * o.backoff_multiplier, o.backoff_max_s);
      if (pause >= remaining())
        throw failure(attempt + 1, unirl::detail::concat(", giving up: the next try (", retry_after ? "Retry-After " : "backoff ",
                                                         pause, " s) would start past deadline_s = ", o.deadline_s, " s"),
                      cause);
      std::this_thread::sleep_for(std::chrono::duration<double>(pause));
    }
  }

  // Where a redirect points: an absolute http:// URL, or a path on the same server.
  static parsed_url redirect_target(const parsed_url& from, const std::string& location) {
    if (!location.empty() && location.front() == '/') return {from.host, from.port, location};
    try {
      return parse_url(location);
    } catch (const std::exception&) {
      throw detail::permanent_error("redirect to '" + detail::excerpt(location, 200) + "', which is not an http://host[:port] URL");
    }
  }

  std::shared_ptr<state> state_;
};

}  // namespace unirl::rewards
