#pragma once
/// \file unicode.hpp
/// The Unicode pieces byte-level tokenizers need, without ICU or std::regex: UTF-8 decoding that
/// never fails (an invalid byte is one code point of its own, `invalid_byte(b)`), the general
/// categories the pre-tokenizer patterns test (`\p{L}`, `\p{N}`, `\s` = White_Space) and NFC.
/// Tables: detail/unicode_tables.hpp, generated from Node's ICU by detail/gen_unicode_tables.mjs.
///
/// ```cpp
/// using namespace unirl::tokenizers;
/// unicode::nfc("e\xCC\x81");                  // "\xC3\xA9" (é)
/// unicode::category_of(0x4E2D);               // unicode::category::letter
/// ```
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include <unirl/tokenizers/detail/unicode_tables.hpp>

namespace unirl::tokenizers::unicode {

/// The classes the GPT-2 / Qwen2 / Llama-3 split patterns distinguish.
enum class category : std::uint8_t { other = 0, letter = 1, number = 2, space = 3 };

/// Code points at or above this value stand for one byte of invalid UTF-8 (`invalid_byte`).
inline constexpr std::uint32_t invalid_base = 0x110000;
constexpr std::uint32_t invalid_byte(unsigned char b) { return invalid_base + b; }

/// Decodes one code point at `p` (< end). Returns its length in bytes (>= 1). A byte that does not
/// start a well-formed sequence (overlong, surrogate, > U+10FFFF, truncated) decodes, alone, to
/// `invalid_byte(byte)`.
inline std::size_t decode_utf8(const unsigned char* p, const unsigned char* end, std::uint32_t& cp) {
  const unsigned char b0 = p[0];
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  }
  const auto n = static_cast<std::size_t>(end - p);
  auto cont = [&](std::size_t i) { return i < n && (p[i] & 0xC0) == 0x80; };
  if (b0 >= 0xC2 && b0 <= 0xDF && cont(1)) {
    cp = (static_cast<std::uint32_t>(b0 & 0x1F) << 6) | (p[1] & 0x3F);
    return 2;
  }
  if (b0 >= 0xE0 && b0 <= 0xEF && cont(1) && cont(2)) {
    const std::uint32_t c = (static_cast<std::uint32_t>(b0 & 0x0F) << 12) |
                            (static_cast<std::uint32_t>(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    if (c >= 0x800 && (c < 0xD800 || c > 0xDFFF)) {
      cp = c;
      return 3;
    }
  }
  if (b0 >= 0xF0 && b0 <= 0xF4 && cont(1) && cont(2) && cont(3)) {
    const std::uint32_t c = (static_cast<std::uint32_t>(b0 & 0x07) << 18) |
                            (static_cast<std::uint32_t>(p[1] & 0x3F) << 12) |
                            (static_cast<std::uint32_t>(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
    if (c >= 0x10000 && c <= 0x10FFFF) {
      cp = c;
      return 4;
    }
  }
  cp = invalid_byte(b0);
  return 1;
}

/// Appends the UTF-8 of `cp` (an `invalid_byte` appends its raw byte).
inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp >= invalid_base) {
    out += static_cast<char>(cp - invalid_base);
  } else if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// True when `s` is well-formed UTF-8.
inline bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    std::uint32_t cp = 0;
    p += decode_utf8(p, end, cp);
    if (cp >= invalid_base) return false;
  }
  return true;
}

/// `s` with each maximal ill-formed subsequence replaced by U+FFFD (what Rust's
/// `String::from_utf8_lossy` and the WHATWG TextDecoder do).
inline std::string to_valid_utf8(std::string_view s) {
  if (is_valid_utf8(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 8);
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    std::uint32_t cp = 0;
    const auto len = decode_utf8(p, end, cp);
    if (cp < invalid_base) {
      out.append(reinterpret_cast<const char*>(p), len);
      p += len;
      continue;
    }
    // Maximal subpart: a lead byte followed by the continuation bytes that could still belong to
    // a well-formed sequence (Unicode table 3-7 bounds on the second byte).
    const unsigned char b0 = *p;
    std::size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) need = 1;
    else if (b0 >= 0xE0 && b0 <= 0xEF) { need = 2; if (b0 == 0xE0) lo = 0xA0; if (b0 == 0xED) hi = 0x9F; }
    else if (b0 >= 0xF0 && b0 <= 0xF4) { need = 3; if (b0 == 0xF0) lo = 0x90; if (b0 == 0xF4) hi = 0x8F; }
    std::size_t used = 1;
    if (need > 0 && p + 1 < end && p[1] >= lo && p[1] <= hi) {
      ++used;
      while (used <= need && p + used < end && (p[used] & 0xC0) == 0x80) ++used;
    }
    out += "\xEF\xBF\xBD";
    p += used;
  }
  return out;
}

namespace detail {
template <class T, std::size_t N>
std::size_t run_index(const T (&runs)[N], std::uint64_t packed_key) {
  // Index of the last run whose packed start is <= packed_key.
  const auto* it = std::upper_bound(std::begin(runs), std::end(runs), packed_key,
                                    [](std::uint64_t k, T r) { return k < static_cast<std::uint64_t>(r); });
  return static_cast<std::size_t>(it - std::begin(runs)) - 1;
}

inline constexpr auto ascii_categories = [] {
  std::array<category, 128> t{};
  for (int c = 0; c < 128; ++c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) t[c] = category::letter;
    else if (c >= '0' && c <= '9') t[c] = category::number;
    else if ((c >= 0x09 && c <= 0x0D) || c == ' ') t[c] = category::space;
    else t[c] = category::other;
  }
  return t;
}();
}  // namespace detail

/// The pattern class of `cp`; `invalid_byte`s are `other` (like U+FFFD, what they would decode to).
inline category category_of(std::uint32_t cp) {
  if (cp < 128) return detail::ascii_categories[cp];
  if (cp >= invalid_base) return category::other;
  const auto i = detail::run_index(tokenizers::detail::ucd::category_runs, (std::uint64_t{cp} << 2) | 3);
  return static_cast<category>(tokenizers::detail::ucd::category_runs[i] & 3);
}
inline bool is_space(std::uint32_t cp) { return category_of(cp) == category::space; }

/// Order-preserving rank of the canonical combining class (0 = starter).
inline std::uint32_t combining_rank(std::uint32_t cp) {
  if (cp < 0x300 || cp >= invalid_base) return 0;
  const auto i = detail::run_index(tokenizers::detail::ucd::ccc_runs, (std::uint64_t{cp} << 8) | 0xFF);
  return tokenizers::detail::ucd::ccc_runs[i] & 0xFF;
}

namespace detail {
inline bool nfc_maybe(std::uint32_t cp) {
  if (cp < 0x300 || cp >= invalid_base) return false;
  const auto i = run_index(tokenizers::detail::ucd::nfc_maybe_runs, (std::uint64_t{cp} << 1) | 1);
  return (tokenizers::detail::ucd::nfc_maybe_runs[i] & 1) != 0;
}
inline constexpr std::uint32_t SBase = 0xAC00, LBase = 0x1100, VBase = 0x1161, TBase = 0x11A7;
inline constexpr std::uint32_t LCount = 19, VCount = 21, TCount = 28, NCount = VCount * TCount,
                               SCount = LCount * NCount;

inline void decompose(std::uint32_t cp, std::vector<std::uint32_t>& out) {
  namespace u = tokenizers::detail::ucd;
  if (cp >= SBase && cp < SBase + SCount) {
    const auto s = cp - SBase;
    out.push_back(LBase + s / NCount);
    out.push_back(VBase + (s % NCount) / TCount);
    if (s % TCount != 0) out.push_back(TBase + s % TCount);
    return;
  }
  const auto* b = std::begin(u::decomp_code_points);
  const auto* e = std::end(u::decomp_code_points);
  const auto* it = std::lower_bound(b, e, cp);
  if (it == e || *it != cp) {
    out.push_back(cp);
    return;
  }
  const auto k = static_cast<std::size_t>(it - b);
  for (auto j = u::decomp_offset[k]; j < u::decomp_offset[k + 1]; ++j) out.push_back(u::decomp_data[j]);
}

inline std::int64_t compose(std::uint32_t a, std::uint32_t b) {
  namespace u = tokenizers::detail::ucd;
  if (a >= LBase && a < LBase + LCount && b >= VBase && b < VBase + VCount)
    return SBase + ((a - LBase) * VCount + (b - VBase)) * TCount;
  if (a >= SBase && a < SBase + SCount && (a - SBase) % TCount == 0 && b > TBase && b < TBase + TCount)
    return a + (b - TBase);
  if (a >= invalid_base || b >= invalid_base) return -1;
  const std::uint64_t key = (std::uint64_t{a} << 21) | b;
  const auto* it = std::lower_bound(std::begin(u::comp_keys), std::end(u::comp_keys), key);
  if (it == std::end(u::comp_keys) || *it != key) return -1;
  return u::comp_values[it - std::begin(u::comp_keys)];
}
}  // namespace detail

/// Unicode Normalization Form C. Invalid bytes pass through unchanged (as starters).
inline std::string nfc(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  bool maybe = false;
  for (const auto* q = p; q < end;) {
    if (*q < 0xCC) {  // below U+0300: nothing composes or decomposes
      ++q;
      continue;
    }
    std::uint32_t cp = 0;
    q += decode_utf8(q, end, cp);
    if (detail::nfc_maybe(cp)) {
      maybe = true;
      break;
    }
  }
  if (!maybe) return std::string(s);
  std::vector<std::uint32_t> d;
  d.reserve(s.size());
  while (p < end) {
    std::uint32_t cp = 0;
    p += decode_utf8(p, end, cp);
    detail::decompose(cp, d);
  }
  for (std::size_t i = 1; i < d.size(); ++i) {  // canonical ordering
    const auto k = combining_rank(d[i]);
    if (k == 0) continue;
    for (std::size_t j = i; j > 0 && combining_rank(d[j - 1]) > k; --j) std::swap(d[j - 1], d[j]);
  }
  std::string out;
  if (d.empty()) return out;
  std::size_t starter_pos = 0, n = 1;
  std::uint32_t starter = d[0];
  std::uint32_t last = combining_rank(starter) != 0 ? 256 : 0;
  for (std::size_t i = 1; i < d.size(); ++i) {
    const auto ch = d[i];
    const auto k = combining_rank(ch);
    const auto c = detail::compose(starter, ch);
    if (c >= 0 && (last < k || last == 0)) {
      d[starter_pos] = starter = static_cast<std::uint32_t>(c);
      continue;
    }
    if (k == 0) {
      starter_pos = n;
      starter = ch;
    }
    last = k;
    d[n++] = ch;
  }
  out.reserve(s.size());
  for (std::size_t i = 0; i < n; ++i) append_utf8(out, d[i]);
  return out;
}

}  // namespace unirl::tokenizers::unicode
