#pragma once
/// \file pre_tokenizer.hpp
/// The split patterns of byte-level BPE tokenizers, as hand-written matchers over UTF-8 code
/// points (no std::regex): each gives exactly the pieces the regex gives with leftmost,
/// first-alternative matching.
///
/// | kind     | pattern (Hugging Face `tokenizer.json`)                                                                                       |
/// |----------|--------------------------------------------------------------------------------------------------------------------------------|
/// | `gpt2`   | `'s\|'t\|'re\|'ve\|'m\|'ll\|'d\| ?\p{L}+\| ?\p{N}+\| ?[^\s\p{L}\p{N}]+\|\s+(?!\S)\|\s+`                                         |
/// | `qwen2`  | `(?i:'s\|'t\|'re\|'ve\|'m\|'ll\|'d)\|[^\r\n\p{L}\p{N}]?\p{L}+\|\p{N}\| ?[^\s\p{L}\p{N}]+[\r\n]*\|\s*[\r\n]+\|\s+(?!\S)\|\s+`      |
/// | `llama3` | as `qwen2` with `\p{N}{1,3}` (also GPT-4's cl100k pattern)                                                                      |
///
/// `\s` is Unicode White_Space (what Rust's and Oniguruma's `\s` match; JavaScript's `\s` differs
/// on U+0085 and U+FEFF). A byte of invalid UTF-8 is one code point of class "other".
///
/// ```cpp
/// using namespace unirl::tokenizers;
/// auto parts = split_text(pre_tokenizer_kind::gpt2, "Hello world's  end");
/// // {"Hello", " world", "'s", " ", " end"}
/// ```
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <unirl/tokenizers/unicode.hpp>

namespace unirl::tokenizers {

/// Which split pattern a byte-level pre-tokenizer uses.
enum class pre_tokenizer_kind : std::uint8_t { gpt2, qwen2, llama3 };

/// The regex text a kind implements, exactly as it appears in a `tokenizer.json`.
inline std::string_view pattern_text(pre_tokenizer_kind k) {
  switch (k) {
    case pre_tokenizer_kind::gpt2:
      return R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
    case pre_tokenizer_kind::qwen2:
      return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
    case pre_tokenizer_kind::llama3:
      return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  }
  return {};
}

inline std::string_view to_string(pre_tokenizer_kind k) {
  switch (k) {
    case pre_tokenizer_kind::gpt2: return "gpt2";
    case pre_tokenizer_kind::qwen2: return "qwen2";
    case pre_tokenizer_kind::llama3: return "llama3";
  }
  return "?";
}

/// The kind whose pattern is `regex` (nullopt for a pattern this library does not implement).
inline std::optional<pre_tokenizer_kind> pattern_kind(std::string_view regex) {
  for (auto k : {pre_tokenizer_kind::gpt2, pre_tokenizer_kind::qwen2, pre_tokenizer_kind::llama3})
    if (regex == pattern_text(k)) return k;
  return std::nullopt;
}

namespace detail {

/// Decoded code points of one text: `cp[i]` starts at byte `off[i]`; `off[n]` is the text size.
struct cp_buffer {
  std::vector<std::uint32_t> cp;
  std::vector<unicode::category> cat;
  std::vector<std::uint32_t> off;

  void assign(std::string_view s) {
    cp.clear();
    cat.clear();
    off.clear();
    const auto* b = reinterpret_cast<const unsigned char*>(s.data());
    const auto* p = b;
    const auto* end = b + s.size();
    while (p < end) {
      std::uint32_t c = 0;
      const auto len = unicode::decode_utf8(p, end, c);
      cp.push_back(c);
      cat.push_back(unicode::category_of(c));
      off.push_back(static_cast<std::uint32_t>(p - b));
      p += len;
    }
    off.push_back(static_cast<std::uint32_t>(s.size()));
  }
};

inline bool ascii_lower_is(std::uint32_t c, char lower, bool fold) {
  return c == static_cast<std::uint32_t>(lower) || (fold && c == static_cast<std::uint32_t>(lower - 'a' + 'A'));
}

/// End (code-point index) of the match that starts at i (< n).
inline std::size_t match_at(const cp_buffer& b, std::size_t i, pre_tokenizer_kind kind) {
  using unicode::category;
  const auto& cp = b.cp;
  const auto& cat = b.cat;
  const std::size_t n = cp.size();
  const bool qwen = kind != pre_tokenizer_kind::gpt2;
  // Contractions: 's 't 're 've 'm 'll 'd (ASCII case-insensitive for qwen2 / llama3).
  if (cp[i] == '\'' && i + 1 < n) {
    const auto c1 = cp[i + 1];
    if (ascii_lower_is(c1, 's', qwen) || ascii_lower_is(c1, 't', qwen)) return i + 2;
    if (i + 2 < n) {
      const auto c2 = cp[i + 2];
      if ((ascii_lower_is(c1, 'r', qwen) && ascii_lower_is(c2, 'e', qwen)) ||
          (ascii_lower_is(c1, 'v', qwen) && ascii_lower_is(c2, 'e', qwen)))
        return i + 3;
    }
    if (ascii_lower_is(c1, 'm', qwen)) return i + 2;
    if (i + 2 < n && ascii_lower_is(c1, 'l', qwen) && ascii_lower_is(cp[i + 2], 'l', qwen)) return i + 3;
    if (ascii_lower_is(c1, 'd', qwen)) return i + 2;
  }
  auto run = [&](std::size_t j, category c) {
    while (j < n && cat[j] == c) ++j;
    return j;
  };
  if (!qwen) {
    const std::size_t j = (cp[i] == ' ' && i + 1 < n) ? i + 1 : i;
    if (cat[j] == category::letter) return run(j, category::letter);
    if (cat[j] == category::number) return run(j, category::number);
    if (cat[j] == category::other) return run(j, category::other);
  } else {
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (cat[i] == category::letter) return run(i, category::letter);
    if (cat[i] != category::number && cp[i] != '\r' && cp[i] != '\n' && i + 1 < n &&
        cat[i + 1] == category::letter)
      return run(i + 1, category::letter);
    // \p{N}{1,k}
    if (cat[i] == category::number) {
      const std::size_t most = kind == pre_tokenizer_kind::llama3 ? 3 : 1;
      std::size_t j = i;
      while (j < n && j - i < most && cat[j] == category::number) ++j;
      return j;
    }
    // ?[^\s\p{L}\p{N}]+[\r\n]*
    const std::size_t j = (cp[i] == ' ' && i + 1 < n) ? i + 1 : i;
    if (cat[j] == category::other) {
      std::size_t k = run(j, category::other);
      while (k < n && (cp[k] == '\r' || cp[k] == '\n')) ++k;
      return k;
    }
  }
  // White space: [\s*[\r\n]+ (qwen)] | \s+(?!\S) | \s+
  const std::size_t k = run(i, category::space);
  if (qwen) {
    for (std::size_t q = k; q > i; --q)
      if (cp[q - 1] == '\r' || cp[q - 1] == '\n') return q;
  }
  if (k == n) return n;
  return k - 1 > i ? k - 1 : k;
}

}  // namespace detail

/// Appends the pieces of `text` under `kind`'s pattern to `out` (views into `text`).
inline void split_text(pre_tokenizer_kind kind, std::string_view text, std::vector<std::string_view>& out) {
  thread_local detail::cp_buffer buf;
  buf.assign(text);
  const std::size_t n = buf.cp.size();
  for (std::size_t i = 0; i < n;) {
    const std::size_t j = detail::match_at(buf, i, kind);
    out.push_back(text.substr(buf.off[i], buf.off[j] - buf.off[i]));
    i = j;
  }
}

inline std::vector<std::string_view> split_text(pre_tokenizer_kind kind, std::string_view text) {
  std::vector<std::string_view> out;
  split_text(kind, text, out);
  return out;
}

}  // namespace unirl::tokenizers
