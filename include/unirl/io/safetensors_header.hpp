#pragma once
/// \file safetensors_header.hpp
/// The torch-free half of unirl's safetensors support: the header parser and validator, and the
/// parser of a sharded checkpoint's `model.safetensors.index.json`. Fuzzed on their own
/// (tests/fuzz/), so they depend on nothing but nlohmann-json.
///
/// A safetensors file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON, and a
/// data region that the tensors' `data_offsets` cover exactly, in order, without holes or overlap.
/// ```cpp
/// std::vector<unsigned char> bytes = read_whole_file("model.safetensors");
/// auto h = unirl::io::parse_safetensors_header(bytes.data(), bytes.size(), bytes.size(), "model.safetensors");
/// for (const auto& e : h.entries) std::cout << e.name << " " << unirl::io::st_dtype_name(e.dtype) << "\n";
/// // tensor bytes: bytes.data() + h.data_offset + e.begin ... + e.end
/// ```
/// Every way the header can lie (length past the end of the file or above the official 100 MB
/// limit, non-UTF-8, non-JSON, not an object, duplicate keys, unknown dtype, negative or
/// overflowing shapes, offsets out of range, overlapping, leaving holes or disagreeing with the
/// shape, `__metadata__` that is not string -> string) throws `format_error` naming the file and
/// the problem; nothing is read outside `[bytes, bytes + available)`.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>

namespace unirl::io {

/// A file or checkpoint that cannot be read as safetensors; `what()` names the file (and the
/// tensor, where one is concerned) and the problem.
struct format_error : unirl::error {
  using error::error;
};

/// Element types of the safetensors format. U16/U32/U64 and the F8 types parse (their files
/// can be inspected), but LibTorch 1.13 has no tensor type for them.
enum class st_dtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, U16, U32, U64, F8_E5M2, F8_E4M3 };

inline constexpr st_dtype st_all_dtypes[] = {st_dtype::F64, st_dtype::F32,    st_dtype::F16,    st_dtype::BF16,
                                             st_dtype::I64, st_dtype::I32,    st_dtype::I16,    st_dtype::I8,
                                             st_dtype::U8,  st_dtype::BOOL,   st_dtype::U16,    st_dtype::U32,
                                             st_dtype::U64, st_dtype::F8_E5M2, st_dtype::F8_E4M3};

/// Largest header the official library accepts (bytes).
inline constexpr std::uint64_t st_max_header_bytes = 100'000'000;

/// The format's name of a dtype ("F32", "BF16", ...).
inline const char* st_dtype_name(st_dtype d) noexcept {
  switch (d) {
    case st_dtype::F64: return "F64";
    case st_dtype::F32: return "F32";
    case st_dtype::F16: return "F16";
    case st_dtype::BF16: return "BF16";
    case st_dtype::I64: return "I64";
    case st_dtype::I32: return "I32";
    case st_dtype::I16: return "I16";
    case st_dtype::I8: return "I8";
    case st_dtype::U8: return "U8";
    case st_dtype::BOOL: return "BOOL";
    case st_dtype::U16: return "U16";
    case st_dtype::U32: return "U32";
    case st_dtype::U64: return "U64";
    case st_dtype::F8_E5M2: return "F8_E5M2";
    case st_dtype::F8_E4M3: return "F8_E4M3";
  }
  return "?";
}

/// Bytes per element.
inline std::size_t st_dtype_size(st_dtype d) noexcept {
  switch (d) {
    case st_dtype::F64: case st_dtype::I64: case st_dtype::U64: return 8;
    case st_dtype::F32: case st_dtype::I32: case st_dtype::U32: return 4;
    case st_dtype::F16: case st_dtype::BF16: case st_dtype::I16: case st_dtype::U16: return 2;
    default: return 1;
  }
}

/// True for the floating-point dtypes (F64, F32, F16, BF16, F8_*).
inline bool st_dtype_is_floating(st_dtype d) noexcept {
  return d == st_dtype::F64 || d == st_dtype::F32 || d == st_dtype::F16 || d == st_dtype::BF16 ||
         d == st_dtype::F8_E5M2 || d == st_dtype::F8_E4M3;
}

/// Position in the official library's dtype order (increasing alignment); its writer lays
/// tensors out by descending rank, then by name.
inline int st_dtype_rank(st_dtype d) noexcept {
  switch (d) {
    case st_dtype::BOOL: return 0;
    case st_dtype::U8: return 1;
    case st_dtype::I8: return 2;
    case st_dtype::F8_E5M2: return 3;
    case st_dtype::F8_E4M3: return 4;
    case st_dtype::I16: return 5;
    case st_dtype::U16: return 6;
    case st_dtype::F16: return 7;
    case st_dtype::BF16: return 8;
    case st_dtype::I32: return 9;
    case st_dtype::U32: return 10;
    case st_dtype::F32: return 11;
    case st_dtype::F64: return 12;
    case st_dtype::I64: return 13;
    case st_dtype::U64: return 14;
  }
  return 0;
}

/// The dtype called `name`, or nothing.
inline std::optional<st_dtype> st_dtype_from_name(std::string_view name) noexcept {
  for (auto d : st_all_dtypes)
    if (name == st_dtype_name(d)) return d;
  return std::nullopt;
}

/// One tensor of a safetensors file: [begin, end) is relative to the data region.
struct st_entry {
  std::string name;
  st_dtype dtype = st_dtype::F32;
  std::vector<std::int64_t> shape;  // () for a scalar
  std::uint64_t begin = 0, end = 0;

  std::uint64_t nbytes() const noexcept { return end - begin; }
  std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;  // validated not to overflow
    return n;
  }
};

/// A parsed, validated header. `entries` are in file order (ascending offsets; tensors of zero
/// bytes at the same offset keep their order in the JSON). `data_offset` = 8 + N.
struct st_header {
  std::vector<st_entry> entries;
  std::map<std::string, std::string> metadata;
  std::uint64_t data_offset = 0;
};

namespace detail {

/// `s` quoted for an error message: control and non-ASCII bytes escaped, long names cut.
inline std::string st_quote(std::string_view s, std::size_t max_len = 160) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out = "'";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i == max_len) {
      out += "...(" + std::to_string(s.size()) + " bytes)";
      break;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f || c == '\\' || c == '\'') {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);  // printable ASCII and UTF-8 (validated before any name is quoted)
    }
  }
  return out + "'";
}

/// Offset of the first byte that is not part of valid UTF-8 (RFC 3629: no overlong forms, no
/// surrogates, nothing above U+10FFFF), or `n` when all of [p, p + n) is valid.
inline std::size_t utf8_invalid_at(const unsigned char* p, std::size_t n) noexcept {
  std::size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned lo = 0x80, hi = 0xbf;  // range of the second byte
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c == 0xe0) len = 3, lo = 0xa0;
    else if ((c >= 0xe1 && c <= 0xec) || c == 0xee || c == 0xef) len = 3;
    else if (c == 0xed) len = 3, hi = 0x9f;
    else if (c == 0xf0) len = 4, lo = 0x90;
    else if (c >= 0xf1 && c <= 0xf3) len = 4;
    else if (c == 0xf4) len = 4, hi = 0x8f;
    else return i;
    if (n - i < len) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xbf) return i;
    i += len;
  }
  return n;
}

[[noreturn]] inline void st_fail(const std::string& source, const std::string& what) {
  throw format_error("unirl: safetensors file " + st_quote(source, 4096) + ": " + what);
}

inline std::string st_shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

inline std::string st_range_string(std::uint64_t b, std::uint64_t e) {
  return "[" + std::to_string(b) + ", " + std::to_string(e) + "]";
}

/// SAX handler building an `st_header` straight from the JSON events: linear in the header
/// size, no DOM, duplicate keys seen (nlohmann's DOM would keep the last one silently).
class st_header_sax {
 public:
  using json = nlohmann::json;
  using number_integer_t = json::number_integer_t;
  using number_unsigned_t = json::number_unsigned_t;
  using number_float_t = json::number_float_t;
  using string_t = json::string_t;
  using binary_t = json::binary_t;

  explicit st_header_sax(st_header& out) : out_(out) {}
  const std::string& error() const { return error_; }

  bool null() { return scalar("null"); }
  bool boolean(bool) { return scalar("a boolean"); }
  bool number_integer(number_integer_t v) {
    if (v >= 0) return unsigned_value(static_cast<std::uint64_t>(v));  // "-0"
    if (in(ctx::shape)) return fail(where() + " has the negative dimension " + std::to_string(v));
    if (in(ctx::offsets)) return fail(where() + " has the negative offset " + std::to_string(v));
    return scalar("a number");
  }
  bool number_unsigned(number_unsigned_t v) { return unsigned_value(v); }
  bool number_float(number_float_t, const string_t& text) {
    if (in(ctx::shape) || in(ctx::offsets))
      return fail(where() + " holds " + st_quote(text) + ": expected a non-negative integer below 2^64");
    return scalar("a number");
  }
  bool binary(binary_t&) { return scalar("binary data"); }
  bool string(string_t& s) {
    if (in(ctx::meta)) {
      out_.metadata.emplace(std::move(key_), std::move(s));
      return true;
    }
    if (in(ctx::entry) && key_ == "dtype") {
      const auto d = st_dtype_from_name(s);
      if (!d) {
        std::string known;
        for (auto k : st_all_dtypes) known += std::string(known.empty() ? "" : ", ") + st_dtype_name(k);
        return fail("tensor " + st_quote(cur_.name) + " has the unknown dtype " + st_quote(s) + " (expected one of " +
                    known + ")");
      }
      cur_.dtype = *d;
      has_dtype_ = true;
      return true;
    }
    return scalar("a string");
  }
  bool start_object(std::size_t) {
    if (stack_.empty()) return push(ctx::top);
    if (in(ctx::top)) {
      if (key_ == "__metadata__") return push(ctx::meta);
      cur_ = st_entry{};
      cur_.name = std::move(key_);
      has_dtype_ = has_shape_ = has_offsets_ = false;
      entry_keys_.clear();
      return push(ctx::entry);
    }
    if (in(ctx::entry) && !known_entry_key()) return push(ctx::skip);  // unknown member: ignored
    if (in(ctx::skip)) return push(ctx::skip);
    return scalar("an object");
  }
  bool key(string_t& k) {
    if (in(ctx::top)) {
      if (!top_keys_.insert(k).second)
        return fail(k == "__metadata__" ? std::string("the key '__metadata__' appears twice")
                                        : "the tensor name " + st_quote(k) + " appears twice");
    } else if (in(ctx::meta)) {
      if (out_.metadata.count(k)) return fail("__metadata__ has the key " + st_quote(k) + " twice");
    } else if (in(ctx::entry)) {
      if (!entry_keys_.insert(k).second)
        return fail("tensor " + st_quote(cur_.name) + " has the member " + st_quote(k) + " twice");
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    const auto c = stack_.back();
    stack_.pop_back();
    if (c == ctx::entry) {
      const char* missing = !has_dtype_ ? "dtype" : !has_shape_ ? "shape" : !has_offsets_ ? "data_offsets" : nullptr;
      if (missing) return fail("tensor " + st_quote(cur_.name) + " has no \"" + missing + "\"");
      out_.entries.push_back(std::move(cur_));
    }
    return true;
  }
  bool start_array(std::size_t) {
    if (in(ctx::entry) && key_ == "shape") {
      cur_.shape.clear();
      has_shape_ = true;
      return push(ctx::shape);
    }
    if (in(ctx::entry) && key_ == "data_offsets") {
      offsets_.clear();
      has_offsets_ = true;
      return push(ctx::offsets);
    }
    if (in(ctx::entry) && !known_entry_key()) return push(ctx::skip);
    if (in(ctx::skip)) return push(ctx::skip);
    return scalar("an array");
  }
  bool end_array() {
    const auto c = stack_.back();
    stack_.pop_back();
    if (c == ctx::offsets) {
      if (offsets_.size() != 2)
        return fail("tensor " + st_quote(cur_.name) + " has " + std::to_string(offsets_.size()) +
                    " data_offsets: expected 2 ([begin, end])");
      cur_.begin = offsets_[0];
      cur_.end = offsets_[1];
    }
    return true;
  }
  bool parse_error(std::size_t pos, const std::string&, const nlohmann::detail::exception& ex) {
    std::string msg = ex.what();
    if (msg.size() > 300) msg = msg.substr(0, 300) + "...";
    return fail("header is not valid JSON (byte " + std::to_string(pos) + " of the header): " + msg);
  }

 private:
  enum class ctx { top, meta, entry, shape, offsets, skip };

  bool in(ctx c) const { return !stack_.empty() && stack_.back() == c; }
  bool push(ctx c) {
    stack_.push_back(c);
    return true;
  }
  bool fail(std::string what) {
    if (error_.empty()) error_ = std::move(what);
    return false;
  }
  bool known_entry_key() const { return key_ == "dtype" || key_ == "shape" || key_ == "data_offsets"; }
  std::string where() const {
    return "tensor " + st_quote(cur_.name) + (in(ctx::shape) ? " shape" : " data_offsets");
  }

  // A scalar (or an object/array where the schema has none): allowed only inside ignored members.
  bool scalar(const char* what) {
    if (stack_.empty()) return fail(std::string("header is ") + what + ", not a JSON object");
    switch (stack_.back()) {
      case ctx::skip: return true;
      case ctx::top:
        if (key_ == "__metadata__" && std::string_view(what) == "null") return true;  // as the official reader
        if (key_ == "__metadata__")
          return fail(std::string("__metadata__ is ") + what + ": expected an object of string to string");
        return fail("the entry of tensor " + st_quote(key_) + " is " + what +
                    ": expected an object with dtype, shape and data_offsets");
      case ctx::meta:
        return fail("__metadata__ value of " + st_quote(key_) + " is " + what + ": expected a string");
      case ctx::entry:
        if (!known_entry_key()) return true;  // unknown member: ignored, as the official reader does
        return fail("tensor " + st_quote(cur_.name) + " member \"" + key_ + "\" is " + what + ": expected " +
                    (key_ == "dtype" ? "a string" : "an array of non-negative integers"));
      case ctx::shape:
      case ctx::offsets:
        return fail(where() + " holds " + what + ": expected non-negative integers");
    }
    return fail("unexpected JSON value");
  }
  bool unsigned_value(std::uint64_t v) {
    if (in(ctx::shape)) {
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        return fail(where() + " has the dimension " + std::to_string(v) + ": expected < 2^63");
      cur_.shape.push_back(static_cast<std::int64_t>(v));
      return true;
    }
    if (in(ctx::offsets)) {
      if (offsets_.size() == 2) return fail(where() + " has more than 2 values: expected [begin, end]");
      offsets_.push_back(v);
      return true;
    }
    return scalar("a number");
  }

  st_header& out_;
  std::vector<ctx> stack_;
  std::string key_;  // last key read at the current level
  std::unordered_set<std::string> top_keys_;
  std::unordered_set<std::string> entry_keys_;
  st_entry cur_;
  std::vector<std::uint64_t> offsets_;
  bool has_dtype_ = false, has_shape_ = false, has_offsets_ = false;
  std::string error_;
};

/// Byte size of a tensor of `shape` and `dtype`, or nothing when it (or the element strides
/// LibTorch would compute for it) overflows.
inline std::optional<std::uint64_t> st_checked_nbytes(const std::vector<std::int64_t>& shape, st_dtype dtype) {
  std::uint64_t numel = 1;
  std::int64_t stride_span = 1;  // product of max(d, 1): LibTorch's contiguous strides must fit int64
  bool zero = false;
  for (auto d : shape) {
    if (d == 0) zero = true;
    if (__builtin_mul_overflow(stride_span, std::max<std::int64_t>(d, 1), &stride_span)) return std::nullopt;
    if (!zero && __builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel)) return std::nullopt;
  }
  if (zero) return 0;
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(st_dtype_size(dtype)), &bytes)) return std::nullopt;
  if (bytes > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
  return bytes;
}

}  // namespace detail

/// Parses and validates the 8-byte length + JSON header of a file of `file_size` bytes whose
/// first `available` bytes are `bytes`; `source` names the file in errors. Throws
/// `format_error`, never reads outside [bytes, bytes + available).
inline st_header parse_safetensors_header(const unsigned char* bytes, std::size_t available, std::uint64_t file_size,
                                          const std::string& source) {
  using detail::st_fail;
  using detail::st_quote;
  if (available > file_size) available = static_cast<std::size_t>(file_size);
  if (file_size < 8)
    st_fail(source, "the file is " + std::to_string(file_size) + " bytes: too short for the 8-byte header length");
  if (available < 8 || bytes == nullptr)
    st_fail(source, "only " + std::to_string(available) + " bytes given: the header length needs 8");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian on any host
  if (n > st_max_header_bytes)
    st_fail(source, "header length " + std::to_string(n) + " exceeds the limit of " +
                        std::to_string(st_max_header_bytes) + " bytes (corrupt file or not safetensors)");
  if (n > file_size - 8)
    st_fail(source, "header length " + std::to_string(n) + " runs past the end of the file (" +
                        std::to_string(file_size) + " bytes)");
  if (n > available - 8)
    st_fail(source, "only " + std::to_string(available) + " bytes given: the header needs " + std::to_string(8 + n));
  const unsigned char* h = bytes + 8;
  const auto len = static_cast<std::size_t>(n);
  if (const auto bad = detail::utf8_invalid_at(h, len); bad != len)
    st_fail(source, "header is not valid UTF-8 (byte " + std::to_string(bad) + " of the header)");

  // JSON never holds a raw NUL byte, but nlohmann's lexer takes one for the end of input, which
  // would accept a header with anything after it.
  for (std::size_t i = 0; i < len; ++i)
    if (h[i] == 0) st_fail(source, "header is not valid JSON: a NUL byte at byte " + std::to_string(i) + " of the header");

  st_header out;
  out.data_offset = 8 + n;
  detail::st_header_sax sax(out);
  const auto* text = reinterpret_cast<const char*>(h);
  const bool ok = nlohmann::json::sax_parse(text, text + len, &sax, nlohmann::json::input_format_t::json, /*strict=*/true);
  if (!ok || !sax.error().empty())
    st_fail(source, sax.error().empty() ? std::string("header is not valid JSON") : sax.error());

  // Sizes, then the layout: sorted by [begin, end), the tensors must tile the data region.
  const std::uint64_t data_size = file_size - 8 - n;
  for (const auto& e : out.entries) {
    if (e.end < e.begin)
      st_fail(source, "tensor " + st_quote(e.name) + " has data_offsets " + detail::st_range_string(e.begin, e.end) +
                          ": end before begin");
    if (e.end > data_size)
      st_fail(source, "tensor " + st_quote(e.name) + " has data_offsets " + detail::st_range_string(e.begin, e.end) +
                          " past the end of the data region (" + std::to_string(data_size) + " bytes)");
    const auto nb = detail::st_checked_nbytes(e.shape, e.dtype);
    if (!nb)
      st_fail(source, "tensor " + st_quote(e.name) + " has shape " + detail::st_shape_string(e.shape) +
                          " whose size overflows");
    if (*nb != e.end - e.begin)
      st_fail(source, "tensor " + st_quote(e.name) + " of dtype " + st_dtype_name(e.dtype) + " and shape " +
                          detail::st_shape_string(e.shape) + " needs " + std::to_string(*nb) +
                          " bytes but data_offsets " + detail::st_range_string(e.begin, e.end) + " span " +
                          std::to_string(e.end - e.begin));
  }
  std::stable_sort(out.entries.begin(), out.entries.end(), [](const st_entry& a, const st_entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  const st_entry* prev = nullptr;
  for (const auto& e : out.entries) {
    if (e.begin < covered)
      st_fail(source, "tensor " + st_quote(e.name) + " data_offsets " + detail::st_range_string(e.begin, e.end) +
                          " overlap tensor " + st_quote(prev->name) + " " +
                          detail::st_range_string(prev->begin, prev->end));
    if (e.begin > covered)
      st_fail(source, "bytes [" + std::to_string(covered) + ", " + std::to_string(e.begin) +
                          ") of the data region belong to no tensor (the format allows no holes; next is tensor " +
                          st_quote(e.name) + ")");
    covered = e.end;
    prev = &e;
  }
  if (covered != data_size)
    st_fail(source, "bytes [" + std::to_string(covered) + ", " + std::to_string(data_size) +
                        ") at the end of the data region belong to no tensor (the format allows no trailing bytes)");
  return out;
}

/// The `model.safetensors.index.json` of a sharded checkpoint.
struct st_index {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file, relative to the index
  std::optional<std::uint64_t> total_size;        // metadata.total_size, when it is an integer
};

/// Parses an index file's text; `source` names it in errors. Throws `format_error` for
/// non-UTF-8, non-JSON, duplicate keys, a missing or non string -> string "weight_map", or a
/// shard name that is empty, absolute or leaves the index's directory ("..").
inline st_index parse_safetensors_index(std::string_view text, const std::string& source) {
  auto fail = [&](const std::string& what) {
    throw format_error("unirl: safetensors index " + detail::st_quote(source, 4096) + ": " + what);
  };
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  if (const auto bad = detail::utf8_invalid_at(p, text.size()); bad != text.size())
    fail("not valid UTF-8 (byte " + std::to_string(bad) + ")");
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)  // nlohmann would stop there
    fail("not valid JSON: a NUL byte at byte " + std::to_string(nul));
  using json = nlohmann::json;
  std::vector<std::unordered_set<std::string>> keys;  // per open object
  std::string duplicate;
  json j;
  try {
    j = json::parse(
        text.begin(), text.end(),
        [&](int, json::parse_event_t ev, json& v) {
          if (ev == json::parse_event_t::object_start) keys.emplace_back();
          else if (ev == json::parse_event_t::object_end) keys.pop_back();
          else if (ev == json::parse_event_t::key && !keys.empty() && !keys.back().insert(v.get<std::string>()).second &&
                   duplicate.empty())
            duplicate = v.get<std::string>();
          return true;
        },
        /*allow_exceptions=*/true);
  } catch (const json::exception& e) {
    std::string msg = e.what();
    if (msg.size() > 300) msg = msg.substr(0, 300) + "...";
    fail("not valid JSON: " + msg);
  }
  if (!duplicate.empty()) fail("the key " + detail::st_quote(duplicate) + " appears twice in one object");
  if (!j.is_object()) fail(std::string("not a JSON object (it is ") + j.type_name() + ")");
  const auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) fail("no \"weight_map\" object of tensor name -> shard file");
  st_index out;
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string())
      fail("weight_map[" + detail::st_quote(name) + "] is " + file.type_name() + ": expected a shard file name");
    const auto& f = file.get_ref<const std::string&>();
    bool bad = f.empty() || f.front() == '/' || f.find('\\') != std::string::npos || f.find('\0') != std::string::npos;
    for (std::size_t b = 0; !bad && b <= f.size();) {  // every path component: not empty, not "." or ".."
      const auto e = std::min(f.find('/', b), f.size());
      const auto part = std::string_view(f).substr(b, e - b);
      bad = part.empty() || part == "." || part == "..";
      b = e + 1;
    }
    if (bad)
      fail("weight_map[" + detail::st_quote(name) + "] = " + detail::st_quote(f) +
           ": expected a relative file name inside the index's directory");
    out.weight_map.emplace(name, f);
  }
  if (const auto md = j.find("metadata"); md != j.end() && md->is_object())
    if (const auto ts = md->find("total_size"); ts != md->end() && ts->is_number_unsigned())
      out.total_size = ts->get<std::uint64_t>();
  return out;
}

}  // namespace unirl::io
