#pragma once
/// \file char_tokenizer.hpp
/// A character-level tokenizer over a fixed alphabet: one id per character, plus a padding id.
/// Enough for small verifiable tasks (arithmetic, formats) and for tests.
///
/// ```cpp
/// unirl::models::char_tokenizer tok("0123456789+=.");
/// auto ids = tok.encode("12+7=");                   // {1, 2, 10, 7, 11}
/// std::string s = tok.decode({1, 9});               // "19"
/// unirl::prompt_batch in{.tokens = {ids}, .decode = tok.decoder(), .pad_id = tok.pad_id()};
/// ```
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <unirl/core/error.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::models {

/// Characters of `alphabet` are ids 0..n-1; `pad_id() == n`; `vocab_size() == n + 1`.
class char_tokenizer {
 public:
  explicit char_tokenizer(std::string alphabet) : alphabet_(std::move(alphabet)) {
    UNIRL_CHECK(!alphabet_.empty(), "char_tokenizer: the alphabet is empty");
    index_.fill(-1);
    for (std::size_t i = 0; i < alphabet_.size(); ++i) {
      const auto c = static_cast<unsigned char>(alphabet_[i]);
      UNIRL_CHECK(index_[c] < 0, "char_tokenizer: character '", alphabet_[i], "' appears twice in the alphabet");
      index_[c] = static_cast<std::int64_t>(i);
    }
  }

  std::int64_t vocab_size() const { return static_cast<std::int64_t>(alphabet_.size()) + 1; }
  std::int64_t pad_id() const { return static_cast<std::int64_t>(alphabet_.size()); }
  /// The id of one character; throws naming a character outside the alphabet.
  std::int64_t id(char c) const {
    const auto i = index_[static_cast<unsigned char>(c)];
    UNIRL_CHECK(i >= 0, "char_tokenizer: character '", c, "' is not in the alphabet \"", alphabet_, "\"");
    return i;
  }

  std::vector<std::int64_t> encode(const std::string& s) const {
    std::vector<std::int64_t> out;
    out.reserve(s.size());
    for (char c : s) out.push_back(id(c));
    return out;
  }
  /// Text of `ids`; the padding id decodes to nothing.
  std::string decode(const std::vector<std::int64_t>& ids) const {
    std::string s;
    s.reserve(ids.size());
    for (auto i : ids) {
      UNIRL_CHECK(i >= 0 && i <= pad_id(), "char_tokenizer: id ", i, " is outside [0, ", pad_id(), "]");
      if (i != pad_id()) s += alphabet_[static_cast<std::size_t>(i)];
    }
    return s;
  }
  /// `decode` as a `token_decoder` for `prompt_batch::decode`.
  token_decoder decoder() const {
    return [self = *this](const std::vector<std::int64_t>& ids) { return self.decode(ids); };
  }

 private:
  std::string alphabet_;
  std::array<std::int64_t, 256> index_{};
};

}  // namespace unirl::models
