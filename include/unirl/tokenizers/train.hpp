#pragma once
/// \file train.hpp
/// A byte-level BPE trainer for examples and tests that need a real, small tokenizer.
///
/// ```cpp
/// using namespace unirl::tokenizers;
/// auto tok = train_bpe(lines, 2048, pre_tokenizer_kind::qwen2, {"<|endoftext|>", "<|im_start|>", "<|im_end|>"});
/// tok.save("my_tokenizer");   // tokenizer.json + tokenizer_config.json, loadable by HF / transformers.js
/// ```
/// Ids: the special tokens first (0..k-1, the first one is EOS), then the 256 byte tokens (in the
/// order of their byte-level characters, as Hugging Face's trainer does), then one token per merge.
/// Each step merges the most frequent adjacent pair over the pre-tokenized corpus (ties: the
/// pair whose token texts compare smallest), until `vocab_size` tokens or no pair is left.
/// Special tokens written in the corpus are cut out before counting. The `qwen2` kind also writes
/// Qwen2's NFC normalizer and normalizes the corpus with it.
#include <algorithm>
#include <array>
#include <cstdint>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>
#include <unirl/tokenizers/bpe.hpp>
#include <unirl/tokenizers/pre_tokenizer.hpp>

namespace unirl::tokenizers {

inline bpe_tokenizer train_bpe(const std::vector<std::string>& corpus, std::int64_t vocab_size, pre_tokenizer_kind kind,
                               std::vector<std::string> special_tokens) {
  const auto k = static_cast<std::int64_t>(special_tokens.size());
  UNIRL_CHECK(vocab_size >= 256 + k, "train_bpe: vocab_size = ", vocab_size, ": expected >= 256 + ", k,
              " special tokens");
  for (std::size_t i = 0; i < special_tokens.size(); ++i) {
    UNIRL_CHECK(!special_tokens[i].empty(), "train_bpe: special_tokens[", i, "] is empty");
    UNIRL_CHECK(unicode::is_valid_utf8(special_tokens[i]), "train_bpe: special_tokens[", i, "] is not valid UTF-8");
    for (std::size_t j = 0; j < i; ++j)
      UNIRL_CHECK(special_tokens[i] != special_tokens[j], "train_bpe: special token '", special_tokens[i], "' is given twice");
  }
  const bool nfc = kind == pre_tokenizer_kind::qwen2;

  // 1. Word counts over the pre-tokenized corpus.
  std::unordered_map<std::string, std::int64_t> word_count;
  std::vector<std::string_view> pieces;
  for (const auto& line : corpus) {
    // Cut the special tokens out.
    std::vector<std::string_view> parts{line};
    for (const auto& s : special_tokens) {
      std::vector<std::string_view> next;
      for (auto p : parts) {
        std::size_t at = 0;
        while (true) {
          const auto f = p.find(s, at);
          next.push_back(p.substr(at, f == std::string_view::npos ? std::string_view::npos : f - at));
          if (f == std::string_view::npos) break;
          at = f + s.size();
        }
      }
      parts = std::move(next);
    }
    for (auto p : parts) {
      const std::string text = nfc ? unicode::nfc(p) : std::string(p);
      pieces.clear();
      split_text(kind, text, pieces);
      for (auto w : pieces) ++word_count[std::string(w)];
    }
  }

  // 2. Initial vocabulary: special tokens, then the byte alphabet sorted by character.
  std::vector<std::string> tokens(special_tokens.begin(), special_tokens.end());  // id -> raw bytes
  std::vector<int> bytes_by_char(256);
  for (int b = 0; b < 256; ++b) bytes_by_char[static_cast<std::size_t>(b)] = b;
  std::sort(bytes_by_char.begin(), bytes_by_char.end(),
            [](int a, int b) { return detail::bytes_map().to_cp[static_cast<std::size_t>(a)] < detail::bytes_map().to_cp[static_cast<std::size_t>(b)]; });
  std::array<std::int32_t, 256> byte_id{};
  for (int b : bytes_by_char) {
    byte_id[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(tokens.size());
    tokens.emplace_back(1, static_cast<char>(b));
  }
  std::unordered_map<std::string, std::int32_t> token_index;
  for (std::size_t i = static_cast<std::size_t>(k); i < tokens.size(); ++i) token_index.emplace(tokens[i], static_cast<std::int32_t>(i));

  // 3. Words as symbol ids, pair counts and where each pair occurs.
  std::vector<std::vector<std::int32_t>> words;
  std::vector<std::int64_t> counts;
  words.reserve(word_count.size());
  {
    std::vector<std::pair<std::string, std::int64_t>> sorted(word_count.begin(), word_count.end());
    std::sort(sorted.begin(), sorted.end());  // deterministic word order
    for (const auto& [w, c] : sorted) {
      std::vector<std::int32_t> s;
      s.reserve(w.size());
      for (unsigned char b : w) s.push_back(byte_id[b]);
      words.push_back(std::move(s));
      counts.push_back(c);
    }
  }
  auto key_of = [](std::int32_t a, std::int32_t b) { return (static_cast<std::uint64_t>(a) << 32) | static_cast<std::uint32_t>(b); };
  std::unordered_map<std::uint64_t, std::int64_t> pair_count;
  std::unordered_map<std::uint64_t, std::vector<std::int32_t>> where;
  for (std::size_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w];
    for (std::size_t i = 0; i + 1 < s.size(); ++i) {
      const auto key = key_of(s[i], s[i + 1]);
      pair_count[key] += counts[w];
      auto& v = where[key];
      if (v.empty() || v.back() != static_cast<std::int32_t>(w)) v.push_back(static_cast<std::int32_t>(w));
    }
  }
  struct cand {
    std::int64_t count;
    std::uint64_t key;
  };
  auto worse = [&](const cand& x, const cand& y) {  // priority_queue: true when x ranks below y
    if (x.count != y.count) return x.count < y.count;
    const auto& xa = tokens[x.key >> 32];
    const auto& ya = tokens[y.key >> 32];
    if (xa != ya) return xa > ya;
    return tokens[x.key & 0xFFFFFFFFu] > tokens[y.key & 0xFFFFFFFFu];
  };
  std::priority_queue<cand, std::vector<cand>, decltype(worse)> q(worse);
  for (const auto& [key, c] : pair_count) q.push({c, key});

  // 4. Merge until the vocabulary is full.
  std::vector<std::pair<std::int32_t, std::int32_t>> merges;
  std::vector<std::int64_t> stamp(words.size(), -1);
  std::unordered_set<std::uint64_t> touched;
  while (static_cast<std::int64_t>(tokens.size()) < vocab_size && !q.empty()) {
    const auto top = q.top();
    q.pop();
    const auto it = pair_count.find(top.key);
    const auto current = it == pair_count.end() ? 0 : it->second;
    if (current != top.count) {  // stale entry
      if (current > 0) q.push({current, top.key});
      continue;
    }
    if (current <= 0) break;
    const auto a = static_cast<std::int32_t>(top.key >> 32);
    const auto b = static_cast<std::int32_t>(top.key & 0xFFFFFFFFu);
    const auto merged = tokens[static_cast<std::size_t>(a)] + tokens[static_cast<std::size_t>(b)];
    std::int32_t id = 0;
    if (const auto f = token_index.find(merged); f != token_index.end()) {
      id = f->second;
    } else {
      id = static_cast<std::int32_t>(tokens.size());
      tokens.push_back(merged);
      token_index.emplace(merged, id);
    }
    merges.emplace_back(a, b);
    const auto merge_no = static_cast<std::int64_t>(merges.size());
    touched.clear();
    const auto occurrences = std::move(where[top.key]);
    where.erase(top.key);
    for (const auto w : occurrences) {
      if (stamp[static_cast<std::size_t>(w)] == merge_no) continue;
      stamp[static_cast<std::size_t>(w)] = merge_no;
      auto& s = words[static_cast<std::size_t>(w)];
      const auto c = counts[static_cast<std::size_t>(w)];
      bool has = false;
      for (std::size_t i = 0; i + 1 < s.size() && !has; ++i) has = s[i] == a && s[i + 1] == b;
      if (!has) continue;
      for (std::size_t i = 0; i + 1 < s.size(); ++i) {
        const auto key = key_of(s[i], s[i + 1]);
        pair_count[key] -= c;
        touched.insert(key);
      }
      std::vector<std::int32_t> t;
      t.reserve(s.size());
      for (std::size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          t.push_back(id);
          i += 2;
        } else {
          t.push_back(s[i++]);
        }
      }
      s = std::move(t);
      for (std::size_t i = 0; i + 1 < s.size(); ++i) {
        const auto key = key_of(s[i], s[i + 1]);
        pair_count[key] += c;
        touched.insert(key);
        auto& v = where[key];
        if (v.empty() || v.back() != w) v.push_back(w);
      }
    }
    for (const auto key : touched) {
      const auto f = pair_count.find(key);
      if (f == pair_count.end()) continue;
      if (f->second <= 0) pair_count.erase(f);
      else q.push({f->second, key});
    }
  }

  // 5. The tokenizer.json of the result.
  nlohmann::json root;
  root["version"] = "1.0";
  root["added_tokens"] = nlohmann::json::array();
  for (std::int64_t i = 0; i < k; ++i)
    root["added_tokens"].push_back({{"id", i}, {"content", special_tokens[static_cast<std::size_t>(i)]}, {"single_word", false},
                                    {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}});
  root["normalizer"] = nfc ? nlohmann::json{{"type", "NFC"}} : nlohmann::json(nullptr);
  if (kind == pre_tokenizer_kind::gpt2) {
    root["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  } else {
    root["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         nlohmann::json::array({{{"type", "Split"}, {"pattern", {{"Regex", std::string(pattern_text(kind))}}}, {"behavior", "Isolated"}, {"invert", false}},
                                {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}})}};
  }
  root["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  root["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  nlohmann::json vocab = nlohmann::json::object();
  for (std::int64_t i = 0; i < k; ++i) vocab[special_tokens[static_cast<std::size_t>(i)]] = i;
  for (std::size_t i = static_cast<std::size_t>(k); i < tokens.size(); ++i) vocab[detail::bytes_to_token(tokens[i])] = i;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [a, b] : merges)
    merge_list.push_back(detail::bytes_to_token(tokens[static_cast<std::size_t>(a)]) + " " + detail::bytes_to_token(tokens[static_cast<std::size_t>(b)]));
  root["model"] = {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                   {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                   {"vocab", std::move(vocab)}, {"merges", std::move(merge_list)}};
  auto tok = bpe_tokenizer::from_json(root, "train_bpe");
  if (k > 0) tok.set_special_tokens(special_tokens[0], special_tokens[0]);
  return tok;
}

}  // namespace unirl::tokenizers
