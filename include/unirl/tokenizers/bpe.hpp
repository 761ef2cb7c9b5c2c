#pragma once
/// \file bpe.hpp
/// Byte-level BPE tokenizers as Hugging Face `tokenizers` runs them (GPT-2, Qwen2 / Qwen2.5 /
/// Qwen3, Llama-3 and anything trained with `train_bpe`), loaded from a `tokenizer.json`, from
/// GPT-2's `vocab.json` + `merges.txt`, or from a model directory. Free of LibTorch:
/// `decoder()` returns the same `std::function` type as `unirl::token_decoder`.
///
/// ```cpp
/// auto tok = unirl::tokenizers::bpe_tokenizer::from_dir("Qwen2.5-0.5B-Instruct");
/// auto ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n");   // special tokens recognised
/// std::string text = tok.decode(ids, /*skip_special_tokens=*/true);
/// unirl::prompt_batch in{.tokens = {ids}, .decode = tok.decoder(), .pad_id = tok.pad_id()};
/// ```
///
/// Supported `tokenizer.json` pieces (anything else is an error naming the key):
/// - `normalizer`: null, `NFC`, or a `Sequence` of those;
/// - `pre_tokenizer`: `ByteLevel` (`add_prefix_space`, `use_regex`), `Split` with the GPT-2,
///   Qwen2 or Llama-3 regex (behavior `Isolated`, `invert` false), a `Sequence` of those; a
///   `ByteLevel` step is required;
/// - `model`: `BPE` with `vocab`, `merges` ("a b" strings or [a, b] pairs), `unk_token`,
///   `fuse_unk`, `byte_fallback` (<0xNN> tokens), `ignore_merges`; `dropout` null or 0;
/// - `added_tokens` (special or not) with `lstrip`, `rstrip`, `single_word`; matched on the raw
///   text, leftmost-longest, before normalisation;
/// - `post_processor` (used by `encode(text, true)`): null, `ByteLevel`, `TemplateProcessing`
///   (its `single` template), `RobertaProcessing` / `BertProcessing`, `Sequence`;
/// - `decoder`: `ByteLevel`, `ByteFallback`, `Fuse`, a `Sequence` of those, or null (tokens
///   joined by spaces).
///
/// Untrusted text: a byte that is not valid UTF-8 is one code point of class "other" for the
/// split patterns and is encoded by its byte, so `decode_bytes(encode(x)) == x` for any bytes
/// (`decode` then replaces the invalid sequences by U+FFFD, as Hugging Face does).
#include <algorithm>
#include <array>
#include <cctype>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/error.hpp>
#include <unirl/tokenizers/pre_tokenizer.hpp>
#include <unirl/tokenizers/unicode.hpp>

namespace unirl::tokenizers {

/// A token matched in the text before pre-tokenisation (`tokenizer.json`'s `added_tokens`).
struct added_token {
  std::string content;
  std::int64_t id = 0;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

namespace detail {

/// GPT-2's reversible byte <-> printable code point map (bytes_to_unicode).
struct byte_map {
  std::array<std::uint32_t, 256> to_cp{};
  std::array<std::int16_t, 324> to_byte{};
  byte_map() {
    to_byte.fill(-1);
    std::array<bool, 256> direct{};
    for (int b = '!'; b <= '~'; ++b) direct[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
    std::uint32_t n = 0;
    for (int b = 0; b < 256; ++b) to_cp[b] = direct[b] ? static_cast<std::uint32_t>(b) : 256 + n++;
    for (int b = 0; b < 256; ++b) to_byte[to_cp[b]] = static_cast<std::int16_t>(b);
  }
};
inline const byte_map& bytes_map() {
  static const byte_map m;
  return m;
}

/// Raw bytes -> byte-level token text ("Ġworld").
inline std::string bytes_to_token(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) unicode::append_utf8(out, bytes_map().to_cp[b]);
  return out;
}

/// Byte-level token text -> raw bytes, or nullopt when a character is outside the byte alphabet.
inline std::optional<std::string> token_to_bytes(std::string_view token) {
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(token.data());
  const auto* end = p + token.size();
  while (p < end) {
    std::uint32_t cp = 0;
    p += unicode::decode_utf8(p, end, cp);
    if (cp >= 324 || bytes_map().to_byte[cp] < 0) return std::nullopt;
    out += static_cast<char>(bytes_map().to_byte[cp]);
  }
  return out;
}

struct string_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using string_map = std::unordered_map<std::string, std::int64_t, string_hash, std::equal_to<>>;

struct pretok_step {
  bool split = false;  // Split(Regex) when true, else ByteLevel
  pre_tokenizer_kind kind = pre_tokenizer_kind::gpt2;
  bool add_prefix_space = false;
  bool use_regex = true;
};

enum class decode_step : std::uint8_t { byte_level, byte_fallback, fuse };

/// The immutable state a `bpe_tokenizer` handle shares (plus its thread-safe word cache).
struct bpe_state {
  // Vocabulary: token text (as in tokenizer.json) per id; flags 1 = in model.vocab, 2 = added,
  // 4 = special; 0 = no token has this id.
  std::vector<std::string> id_token;
  std::vector<std::uint8_t> id_flags;
  std::vector<std::string> id_bytes;  // what the decoder emits for the id
  string_map token_ids;               // token text -> id (model vocabulary and added tokens)
  string_map model_bytes;             // raw bytes -> id, model vocabulary (ignore_merges)
  std::array<std::int64_t, 256> byte_id{};
  // Merges in rank order and (left << 32 | right) -> (rank, merged id).
  std::vector<std::pair<std::int64_t, std::int64_t>> merges;
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merge_map;
  std::optional<std::int64_t> unk_id;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::array<std::int64_t, 256> fallback_id{};  // <0xNN> tokens (-1 when absent)

  std::vector<added_token> added;                     // sorted by content length, longest first
  std::array<std::vector<std::size_t>, 256> added_by_first_byte{};
  bool nfc = false;
  std::vector<pretok_step> pretok;
  std::vector<decode_step> decoder;
  bool decoder_null = false;
  std::vector<std::int64_t> prefix_ids, suffix_ids;  // post_processor, for add_special_tokens

  // What save() writes back verbatim.
  nlohmann::ordered_json normalizer_json, pre_tokenizer_json, post_processor_json, decoder_json;
  std::string chat_template;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<std::int64_t>, string_hash, std::equal_to<>> cache;
};

[[noreturn]] inline void json_fail(const std::string& where, const std::string& what) {
  throw ::unirl::error("unirl: " + where + ": " + what);
}

inline std::string dump_short(const nlohmann::json& j) {
  auto s = j.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  UNIRL_CHECK(in.good(), "tokenizer: cannot open '", p.string(), "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline nlohmann::json parse_json(std::string_view text, const std::string& name) {
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    json_fail(name, std::string("not valid JSON (") + e.what() + ")");
  }
}

inline bool get_bool(const nlohmann::json& obj, const char* key, bool dflt, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) json_fail(where + "." + key, "= " + dump_short(*it) + ": expected true or false");
  return it->get<bool>();
}

inline std::int64_t get_id(const nlohmann::json& v, const std::string& where) {
  if (!v.is_number_integer() && !v.is_number_unsigned())
    json_fail(where, "= " + dump_short(v) + ": expected a token id (an integer)");
  // 2^22 ids bound what an untrusted file can make us allocate (real vocabularies: <= ~260k).
  if (v.is_number_unsigned() ? v.get<std::uint64_t>() >= (1u << 22) : (v.get<std::int64_t>() < 0 || v.get<std::int64_t>() >= (1 << 22)))
    json_fail(where, "= " + dump_short(v) + ": expected a token id in [0, 4194304)");
  return v.get<std::int64_t>();
}

inline const nlohmann::json& require(const nlohmann::json& obj, const char* key, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end()) json_fail(where.empty() ? std::string(key) : where + "." + key, "missing");
  return *it;
}

inline std::string type_of(const nlohmann::json& obj, const std::string& where) {
  if (!obj.is_object()) json_fail(where, "= " + dump_short(obj) + ": expected an object with a \"type\"");
  const auto& t = require(obj, "type", where);
  if (!t.is_string()) json_fail(where + ".type", "= " + dump_short(t) + ": expected a string");
  return t.get<std::string>();
}

/// Nesting of Sequence components an untrusted file may use.
inline constexpr int max_component_depth = 16;

inline void check_depth(int depth, const std::string& where) {
  if (depth > max_component_depth) json_fail(where, "Sequence nested deeper than " + std::to_string(max_component_depth));
}

inline void parse_pre_tokenizer(const nlohmann::json& j, const std::string& where, std::vector<pretok_step>& out, int depth = 0) {
  if (j.is_null()) return;
  check_depth(depth, where);
  const auto type = type_of(j, where);
  if (type == "Sequence") {
    const auto& list = require(j, "pretokenizers", where);
    if (!list.is_array()) json_fail(where + ".pretokenizers", "expected an array");
    for (std::size_t i = 0; i < list.size(); ++i)
      parse_pre_tokenizer(list[i], where + ".pretokenizers[" + std::to_string(i) + "]", out, depth + 1);
  } else if (type == "ByteLevel") {
    pretok_step s;
    s.add_prefix_space = get_bool(j, "add_prefix_space", false, where);
    s.use_regex = get_bool(j, "use_regex", true, where);
    out.push_back(s);
  } else if (type == "Split") {
    const auto& pat = require(j, "pattern", where);
    if (!pat.is_object() || !pat.contains("Regex") || !pat["Regex"].is_string())
      json_fail(where + ".pattern", "= " + dump_short(pat) + ": expected {\"Regex\": \"...\"}");
    const auto rx = pat["Regex"].get<std::string>();
    const auto kind = pattern_kind(rx);
    if (!kind)
      json_fail(where + ".pattern.Regex", "= '" + rx + "': expected the GPT-2, Qwen2 or Llama-3 split pattern");
    if (j.contains("behavior") && !(j["behavior"].is_string() && j["behavior"] == "Isolated"))
      json_fail(where + ".behavior", "= " + dump_short(j["behavior"]) + ": expected \"Isolated\"");
    if (get_bool(j, "invert", false, where)) json_fail(where + ".invert", "= true: expected false");
    pretok_step s;
    s.split = true;
    s.kind = *kind;
    out.push_back(s);
  } else {
    json_fail(where + ".type", "= '" + type + "': expected ByteLevel, Split or Sequence");
  }
}

inline void parse_normalizer(const nlohmann::json& j, const std::string& where, bool& nfc, int depth = 0) {
  if (j.is_null()) return;
  check_depth(depth, where);
  const auto type = type_of(j, where);
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const auto& list = require(j, "normalizers", where);
    if (!list.is_array()) json_fail(where + ".normalizers", "expected an array");
    for (std::size_t i = 0; i < list.size(); ++i)
      parse_normalizer(list[i], where + ".normalizers[" + std::to_string(i) + "]", nfc, depth + 1);
  } else {
    json_fail(where + ".type", "= '" + type + "': expected NFC or Sequence (other normalizers are not supported)");
  }
}

inline void parse_decoder(const nlohmann::json& j, const std::string& where, std::vector<decode_step>& out, int depth = 0) {
  check_depth(depth, where);
  const auto type = type_of(j, where);
  if (type == "ByteLevel") out.push_back(decode_step::byte_level);
  else if (type == "ByteFallback") out.push_back(decode_step::byte_fallback);
  else if (type == "Fuse") out.push_back(decode_step::fuse);
  else if (type == "Sequence") {
    const auto& list = require(j, "decoders", where);
    if (!list.is_array()) json_fail(where + ".decoders", "expected an array");
    for (std::size_t i = 0; i < list.size(); ++i)
      parse_decoder(list[i], where + ".decoders[" + std::to_string(i) + "]", out, depth + 1);
  } else {
    json_fail(where + ".type", "= '" + type + "': expected ByteLevel, ByteFallback, Fuse or Sequence");
  }
}

inline void parse_post_processor(const nlohmann::json& j, const std::string& where, const bpe_state& st,
                                 std::vector<std::int64_t>& prefix, std::vector<std::int64_t>& suffix, int depth = 0) {
  if (j.is_null()) return;
  check_depth(depth, where);
  const auto type = type_of(j, where);
  auto special_id = [&](const nlohmann::json& pair, const std::string& w) {
    // ["<s>", 0] in Roberta/Bert processors.
    if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string())
      json_fail(w, "= " + dump_short(pair) + ": expected [\"token\", id]");
    return get_id(pair[1], w + "[1]");
  };
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const auto& list = require(j, "processors", where);
    if (!list.is_array()) json_fail(where + ".processors", "expected an array");
    for (std::size_t i = 0; i < list.size(); ++i)
      parse_post_processor(list[i], where + ".processors[" + std::to_string(i) + "]", st, prefix, suffix, depth + 1);
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    prefix.push_back(special_id(require(j, "cls", where), where + ".cls"));
    suffix.insert(suffix.begin(), special_id(require(j, "sep", where), where + ".sep"));
  } else if (type == "TemplateProcessing") {
    const auto& single = require(j, "single", where);
    if (!single.is_array()) json_fail(where + ".single", "expected an array");
    const auto& specials = j.contains("special_tokens") ? j["special_tokens"] : nlohmann::json::object();
    bool seen_a = false;
    for (std::size_t i = 0; i < single.size(); ++i) {
      const auto w = where + ".single[" + std::to_string(i) + "]";
      const auto& item = single[i];
      if (item.is_object() && item.contains("Sequence")) {
        seen_a = true;
      } else if (item.is_object() && item.contains("SpecialToken") && item["SpecialToken"].is_object() &&
                 item["SpecialToken"].contains("id") && item["SpecialToken"]["id"].is_string()) {
        const auto name = item["SpecialToken"]["id"].get<std::string>();
        std::vector<std::int64_t> ids;
        if (specials.is_object() && specials.contains(name) && specials[name].is_object() &&
            specials[name].contains("ids") && specials[name]["ids"].is_array()) {
          for (std::size_t k = 0; k < specials[name]["ids"].size(); ++k)
            ids.push_back(get_id(specials[name]["ids"][k], where + ".special_tokens." + name + ".ids"));
        } else if (const auto it = st.token_ids.find(name); it != st.token_ids.end()) {
          ids.push_back(it->second);
        } else {
          json_fail(w, "special token '" + name + "' is neither in special_tokens nor in the vocabulary");
        }
        auto& dst = seen_a ? suffix : prefix;
        dst.insert(dst.end(), ids.begin(), ids.end());
      } else {
        json_fail(w, "= " + dump_short(item) + ": expected {\"Sequence\": ...} or {\"SpecialToken\": {\"id\": ...}}");
      }
    }
  } else {
    json_fail(where + ".type", "= '" + type + "': expected ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing or Sequence");
  }
}

}  // namespace detail

/// A byte-level BPE tokenizer (see the file comment). Copies share the immutable vocabulary;
/// encode/decode are thread-safe.
class bpe_tokenizer {
 public:
  using decoder_function = std::function<std::string(const std::vector<std::int64_t>&)>;

  /// Loads a Hugging Face `tokenizer.json`. Without a tokenizer_config.json (see `from_dir`),
  /// EOS (and so padding) is `<|endoftext|>` when the vocabulary has it; `set_special_tokens`
  /// changes them.
  static bpe_tokenizer from_file(const std::filesystem::path& tokenizer_json) {
    const auto text = detail::read_file(tokenizer_json);
    return from_json_text(text, tokenizer_json.filename().string());
  }

  /// Parses the text of a `tokenizer.json`; `name` prefixes error messages.
  static bpe_tokenizer from_json_text(std::string_view text, const std::string& name = "tokenizer.json") {
    return from_json(detail::parse_json(text, name), name);
  }

  /// Builds from a parsed `tokenizer.json`.
  static bpe_tokenizer from_json(const nlohmann::json& root, const std::string& name = "tokenizer.json");

  /// GPT-2's `vocab.json` (token -> id) and `merges.txt` ("#version" line, then "a b" per line):
  /// ByteLevel pre-tokenizer and decoder; `<|endoftext|>` (when in the vocabulary) is a special
  /// added token, as in transformers' GPT2TokenizerFast.
  static bpe_tokenizer from_gpt2_files(const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt) {
    return from_gpt2_text(detail::read_file(vocab_json), detail::read_file(merges_txt));
  }
  static bpe_tokenizer from_gpt2_text(std::string_view vocab_json, std::string_view merges_txt);

  /// A model directory: `tokenizer.json`, else `vocab.json` + `merges.txt`; `tokenizer_config.json`
  /// (when present) gives `chat_template`, `eos_token`, `pad_token`, `bos_token` and, for the
  /// GPT-2 files, `added_tokens_decoder`.
  static bpe_tokenizer from_dir(const std::filesystem::path& model_dir);

 private:
  static bpe_tokenizer from_dir_files(const std::filesystem::path& model_dir);

 public:

  /// Token ids of `text`. Added and special tokens written in the text are recognised;
  /// `add_special_tokens` applies the post-processor (e.g. Llama-3's BOS).
  std::vector<std::int64_t> encode(std::string_view text, bool add_special_tokens = false) const {
    std::vector<std::int64_t> out;
    encode_into(text, out, add_special_tokens);
    return out;
  }
  void encode_into(std::string_view text, std::vector<std::int64_t>& out, bool add_special_tokens = false) const;

  /// Text of `ids` (invalid UTF-8 replaced by U+FFFD). Ids with no token (holes in the vocabulary,
  /// out of range) are skipped, as Hugging Face does: a sampled id never makes decoding throw.
  std::string decode(const std::vector<std::int64_t>& ids, bool skip_special_tokens = false) const {
    return unicode::to_valid_utf8(decode_bytes(ids, skip_special_tokens));
  }
  /// The raw bytes `ids` stand for (no U+FFFD replacement).
  std::string decode_bytes(const std::vector<std::int64_t>& ids, bool skip_special_tokens = false) const;

  /// `decode` as a `unirl::token_decoder` (the same std::function type) for `prompt_batch::decode`.
  decoder_function decoder(bool skip_special_tokens = false) const {
    return [self = *this, skip_special_tokens](const std::vector<std::int64_t>& ids) {
      return self.decode(ids, skip_special_tokens);
    };
  }

  /// Largest id + 1, added tokens included.
  std::int64_t vocab_size() const { return static_cast<std::int64_t>(st_->id_token.size()); }
  std::optional<std::int64_t> token_to_id(std::string_view token) const {
    const auto it = st_->token_ids.find(token);
    if (it == st_->token_ids.end()) return std::nullopt;
    return it->second;
  }
  /// The token text of `id` (as in tokenizer.json: "Ġworld"), nullopt for an unused id.
  std::optional<std::string> id_to_token(std::int64_t id) const {
    if (id < 0 || id >= vocab_size() || st_->id_flags[static_cast<std::size_t>(id)] == 0) return std::nullopt;
    return st_->id_token[static_cast<std::size_t>(id)];
  }
  bool is_special(std::int64_t id) const {
    return id >= 0 && id < vocab_size() && (st_->id_flags[static_cast<std::size_t>(id)] & 4) != 0;
  }
  const std::vector<added_token>& added_tokens() const { return st_->added; }
  /// True when the normalizer is NFC (Qwen2): then decode(encode(x)) == unicode::nfc(x).
  bool normalizes_nfc() const { return st_->nfc; }
  std::size_t num_merges() const { return st_->merges.size(); }

  /// Padding id: `pad_token` of the config, else the EOS id, else 0.
  std::int64_t pad_id() const { return pad_ ? *pad_ : eos_ ? *eos_ : 0; }
  std::optional<std::int64_t> eos_id() const { return eos_; }
  std::optional<std::int64_t> bos_id() const { return bos_; }
  /// Sets EOS / padding / BOS by token text (an empty string leaves that one unchanged); throws
  /// naming a token that is not in the vocabulary.
  bpe_tokenizer& set_special_tokens(std::string_view eos, std::string_view pad = {}, std::string_view bos = {}) {
    auto look = [&](std::string_view t, const char* what) {
      const auto id = token_to_id(t);
      UNIRL_CHECK(id.has_value(), "bpe_tokenizer: ", what, " token '", t, "' is not in the vocabulary");
      return *id;
    };
    if (!eos.empty()) eos_ = look(eos, "EOS");
    if (!pad.empty()) pad_ = look(pad, "padding");
    if (!bos.empty()) bos_ = look(bos, "BOS");
    return *this;
  }
  /// The Jinja chat template of tokenizer_config.json (empty when none was read).
  const std::string& chat_template() const { return chat_template_; }

  /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (created if needed), loadable
  /// by Hugging Face tokenizers / transformers and their JavaScript ports.
  void save(const std::filesystem::path& dir) const;
  /// The `tokenizer.json` text `save` writes.
  std::string to_json_text() const;

 private:
  std::shared_ptr<const detail::bpe_state> st_;
  std::optional<std::int64_t> eos_, pad_, bos_;
  std::string chat_template_;

  void bpe_word(std::string_view bytes, std::vector<std::int64_t>& out) const;
  void encode_segment(std::string_view text, std::vector<std::int64_t>& out) const;
};

// ---------------------------------------------------------------------------------------------
// Loading

inline bpe_tokenizer bpe_tokenizer::from_json(const nlohmann::json& root, const std::string& name) {
  using detail::json_fail;
  if (!root.is_object()) json_fail(name, "expected a JSON object at the top level");
  auto st = std::make_shared<detail::bpe_state>();
  const auto& model = detail::require(root, "model", name);
  const std::string mw = name + ": model";
  if (!model.is_object()) json_fail(mw, "expected an object");
  if (model.contains("type") && !(model["type"].is_string() && model["type"] == "BPE"))
    json_fail(mw + ".type", "= " + detail::dump_short(model["type"]) + ": expected \"BPE\"");
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0))
    json_fail(mw + ".dropout", "= " + detail::dump_short(model["dropout"]) + ": expected null (BPE dropout is not supported)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() && !(model[key].is_string() && model[key].get<std::string>().empty()))
      json_fail(mw + "." + key, "= " + detail::dump_short(model[key]) + ": expected null or \"\" (byte-level BPE)");
  }
  st->fuse_unk = detail::get_bool(model, "fuse_unk", false, mw);
  st->byte_fallback = detail::get_bool(model, "byte_fallback", false, mw);
  st->ignore_merges = detail::get_bool(model, "ignore_merges", false, mw);

  // Vocabulary.
  const auto& vocab = detail::require(model, "vocab", mw);
  if (!vocab.is_object()) json_fail(mw + ".vocab", "expected an object of token -> id");
  std::int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    max_id = std::max(max_id, detail::get_id(it.value(), mw + ".vocab[\"" + it.key() + "\"]"));
  const auto& added_json = root.contains("added_tokens") ? root["added_tokens"] : nlohmann::json::array();
  if (!added_json.is_array()) json_fail(name + ": added_tokens", "expected an array");
  for (std::size_t i = 0; i < added_json.size(); ++i) {
    const auto w = name + ": added_tokens[" + std::to_string(i) + "]";
    if (!added_json[i].is_object()) json_fail(w, "expected an object");
    max_id = std::max(max_id, detail::get_id(detail::require(added_json[i], "id", w), w + ".id"));
  }
  const auto n = static_cast<std::size_t>(max_id + 1);
  st->id_token.assign(n, {});
  st->id_flags.assign(n, 0);
  st->id_bytes.assign(n, {});
  st->token_ids.reserve(vocab.size() + added_json.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const auto id = static_cast<std::size_t>(it.value().get<std::int64_t>());
    if (st->id_flags[id] != 0)
      json_fail(mw + ".vocab[\"" + it.key() + "\"]", "= " + std::to_string(id) + ": id already used by \"" + st->id_token[id] + "\"");
    st->id_token[id] = it.key();
    st->id_flags[id] = 1;
    st->token_ids.emplace(it.key(), static_cast<std::int64_t>(id));
  }
  if (const auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
    if (!it->is_string()) json_fail(mw + ".unk_token", "= " + detail::dump_short(*it) + ": expected a string or null");
    const auto u = st->token_ids.find(it->get<std::string>());
    if (u == st->token_ids.end()) json_fail(mw + ".unk_token", "= '" + it->get<std::string>() + "': not in model.vocab");
    st->unk_id = u->second;
  }

  // Added tokens.
  for (std::size_t i = 0; i < added_json.size(); ++i) {
    const auto w = name + ": added_tokens[" + std::to_string(i) + "]";
    const auto& a = added_json[i];
    const auto& c = detail::require(a, "content", w);
    if (!c.is_string() || c.get<std::string>().empty()) json_fail(w + ".content", "= " + detail::dump_short(c) + ": expected a non-empty string");
    added_token t;
    t.content = c.get<std::string>();
    t.id = a["id"].get<std::int64_t>();
    t.special = detail::get_bool(a, "special", false, w);
    t.lstrip = detail::get_bool(a, "lstrip", false, w);
    t.rstrip = detail::get_bool(a, "rstrip", false, w);
    t.single_word = detail::get_bool(a, "single_word", false, w);
    t.normalized = detail::get_bool(a, "normalized", !t.special, w);
    const auto id = static_cast<std::size_t>(t.id);
    if ((st->id_flags[id] & 1) != 0 && st->id_token[id] != t.content)
      json_fail(w, "id " + std::to_string(id) + " is \"" + st->id_token[id] + "\" in model.vocab, not \"" + t.content + "\"");
    if ((st->id_flags[id] & 2) != 0) json_fail(w, "id " + std::to_string(id) + " is given twice in added_tokens");
    if (const auto other = st->token_ids.find(t.content); other != st->token_ids.end() && other->second != t.id && (st->id_flags[static_cast<std::size_t>(other->second)] & 2) != 0)
      json_fail(w, "\"" + t.content + "\" is given twice in added_tokens");
    st->id_token[id] = t.content;
    st->id_flags[id] |= static_cast<std::uint8_t>(2 | (t.special ? 4 : 0));
    st->token_ids[t.content] = t.id;
    st->added.push_back(std::move(t));
  }
  std::stable_sort(st->added.begin(), st->added.end(),
                   [](const added_token& a, const added_token& b) { return a.content.size() > b.content.size(); });
  for (std::size_t i = 0; i < st->added.size(); ++i)
    st->added_by_first_byte[static_cast<unsigned char>(st->added[i].content[0])].push_back(i);

  // Decoded bytes of each id (the ByteLevel decoder maps a token when all its characters are in
  // the byte alphabet, else emits its text, as Hugging Face's decoder does).
  for (std::size_t id = 0; id < n; ++id) {
    if (st->id_flags[id] == 0) continue;
    auto b = detail::token_to_bytes(st->id_token[id]);
    st->id_bytes[id] = b ? *b : st->id_token[id];
  }
  st->byte_id.fill(-1);
  for (int b = 0; b < 256; ++b) {
    std::string tok;
    unicode::append_utf8(tok, detail::bytes_map().to_cp[static_cast<std::size_t>(b)]);
    if (const auto it = vocab.find(tok); it != vocab.end()) st->byte_id[static_cast<std::size_t>(b)] = it.value().get<std::int64_t>();
  }
  st->fallback_id.fill(-1);
  if (st->byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "<0x%02X>", b);
      if (const auto it = vocab.find(hex); it != vocab.end()) st->fallback_id[static_cast<std::size_t>(b)] = it.value().get<std::int64_t>();
    }
  }
  if (st->ignore_merges) {
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const auto id = it.value().get<std::int64_t>();
      st->model_bytes.emplace(st->id_bytes[static_cast<std::size_t>(id)], id);
    }
  }

  // Merges.
  const auto& merges = detail::require(model, "merges", mw);
  if (!merges.is_array()) json_fail(mw + ".merges", "expected an array");
  st->merges.reserve(merges.size());
  st->merge_map.reserve(merges.size());
  for (std::size_t i = 0; i < merges.size(); ++i) {
    const auto w = mw + ".merges[" + std::to_string(i) + "]";
    const auto& m = merges[i];
    std::string a, b;
    if (m.is_string()) {
      const auto s = m.get<std::string>();
      const auto sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        json_fail(w, "= \"" + s + "\": expected two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      json_fail(w, "= " + detail::dump_short(m) + ": expected \"a b\" or [\"a\", \"b\"]");
    }
    const auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    if (ia == vocab.end()) json_fail(w, "token \"" + a + "\" is not in model.vocab");
    if (ib == vocab.end()) json_fail(w, "token \"" + b + "\" is not in model.vocab");
    if (iab == vocab.end()) json_fail(w, "merged token \"" + a + b + "\" is not in model.vocab");
    const auto la = ia.value().get<std::int64_t>(), lb = ib.value().get<std::int64_t>();
    const auto key = (static_cast<std::uint64_t>(la) << 32) | static_cast<std::uint64_t>(lb);
    // The first (lowest-rank) occurrence of a pair wins, as in Hugging Face.
    st->merge_map.emplace(key, std::make_pair(static_cast<std::int32_t>(i), static_cast<std::int32_t>(iab.value().get<std::int64_t>())));
    st->merges.emplace_back(la, lb);
  }

  // Components.
  const auto get_component = [&](const char* key) -> nlohmann::json {
    return root.contains(key) ? root[key] : nlohmann::json(nullptr);
  };
  detail::parse_normalizer(get_component("normalizer"), name + ": normalizer", st->nfc);
  detail::parse_pre_tokenizer(get_component("pre_tokenizer"), name + ": pre_tokenizer", st->pretok);
  if (std::none_of(st->pretok.begin(), st->pretok.end(), [](const detail::pretok_step& s) { return !s.split; }))
    json_fail(name + ": pre_tokenizer", "expected a ByteLevel pre-tokenizer (alone or in a Sequence): only byte-level BPE is supported");
  const auto dec = get_component("decoder");
  if (dec.is_null()) st->decoder_null = true;
  else detail::parse_decoder(dec, name + ": decoder", st->decoder);
  detail::parse_post_processor(get_component("post_processor"), name + ": post_processor", *st, st->prefix_ids, st->suffix_ids);
  for (auto id : st->prefix_ids) if (id >= static_cast<std::int64_t>(n) || st->id_flags[static_cast<std::size_t>(id)] == 0) json_fail(name + ": post_processor", "id " + std::to_string(id) + " has no token");
  for (auto id : st->suffix_ids) if (id >= static_cast<std::int64_t>(n) || st->id_flags[static_cast<std::size_t>(id)] == 0) json_fail(name + ": post_processor", "id " + std::to_string(id) + " has no token");
  st->normalizer_json = get_component("normalizer");
  st->pre_tokenizer_json = get_component("pre_tokenizer");
  st->post_processor_json = get_component("post_processor");
  st->decoder_json = dec;

  bpe_tokenizer t;
  t.st_ = std::move(st);
  if (const auto e = t.token_to_id("<|endoftext|>")) t.eos_ = e;
  return t;
}

inline bpe_tokenizer bpe_tokenizer::from_gpt2_text(std::string_view vocab_json, std::string_view merges_txt) {
  auto vocab = detail::parse_json(vocab_json, "vocab.json");
  if (!vocab.is_object()) detail::json_fail("vocab.json", "expected an object of token -> id");
  nlohmann::json merges = nlohmann::json::array();
  std::size_t line_no = 0, pos = 0;
  while (pos < merges_txt.size()) {
    auto eol = merges_txt.find('\n', pos);
    if (eol == std::string_view::npos) eol = merges_txt.size();
    auto line = merges_txt.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.substr(0, 8) == "#version")) continue;
    const auto sp = line.find(' ');
    if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos)
      detail::json_fail("merges.txt line " + std::to_string(line_no), "= \"" + std::string(line) + "\": expected two tokens separated by one space");
    merges.push_back(nlohmann::json::array({std::string(line.substr(0, sp)), std::string(line.substr(sp + 1))}));
  }
  nlohmann::json root;
  root["version"] = "1.0";
  root["added_tokens"] = nlohmann::json::array();
  if (vocab.contains("<|endoftext|>")) {
    root["added_tokens"].push_back({{"id", vocab["<|endoftext|>"]}, {"content", "<|endoftext|>"}, {"single_word", false},
                                    {"lstrip", false}, {"rstrip", false}, {"normalized", true}, {"special", true}});
  }
  root["normalizer"] = nullptr;
  root["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  root["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  root["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  root["model"] = {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
                   {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                   {"vocab", std::move(vocab)}, {"merges", std::move(merges)}};
  return from_json(root, "vocab.json + merges.txt");
}

inline bpe_tokenizer bpe_tokenizer::from_dir(const std::filesystem::path& dir) {
  // Every error of the files names the directory they were read from.
  try {
    return from_dir_files(dir);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.find(dir.string()) != std::string::npos) throw;
    throw ::unirl::error("unirl: the tokenizer of '" + dir.string() + "': " + what);
  }
}

inline bpe_tokenizer bpe_tokenizer::from_dir_files(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  UNIRL_CHECK(fs::is_directory(dir), "bpe_tokenizer::from_dir: '", dir.string(), "' is not a directory");
  nlohmann::json config = nlohmann::json::object();
  if (fs::exists(dir / "tokenizer_config.json")) {
    config = detail::parse_json(detail::read_file(dir / "tokenizer_config.json"), "tokenizer_config.json");
    if (!config.is_object()) detail::json_fail("tokenizer_config.json", "expected a JSON object");
  }
  bpe_tokenizer t;
  if (fs::exists(dir / "tokenizer.json")) {
    t = from_file(dir / "tokenizer.json");
  } else if (fs::exists(dir / "vocab.json") && fs::exists(dir / "merges.txt")) {
    if (config.contains("added_tokens_decoder") && config["added_tokens_decoder"].is_object()) {
      // GPT-2 style directories list their added tokens in the config only.
      auto root = nlohmann::json::parse(from_gpt2_text(detail::read_file(dir / "vocab.json"), detail::read_file(dir / "merges.txt")).to_json_text());
      root["added_tokens"] = nlohmann::json::array();
      for (auto it = config["added_tokens_decoder"].begin(); it != config["added_tokens_decoder"].end(); ++it) {
        const auto w = "tokenizer_config.json: added_tokens_decoder[\"" + it.key() + "\"]";
        if (!it.value().is_object() || !it.value().contains("content")) detail::json_fail(w, "expected an object with \"content\"");
        std::int64_t id = 0;
        try {
          id = std::stoll(it.key());
        } catch (const std::exception&) {
          detail::json_fail(w, "expected a numeric id as the key");
        }
        auto entry = it.value();
        entry["id"] = id;
        root["added_tokens"].push_back(entry);
      }
      t = from_json(root, "vocab.json + merges.txt + tokenizer_config.json");
    } else {
      t = from_gpt2_files(dir / "vocab.json", dir / "merges.txt");
    }
  } else {
    UNIRL_CHECK(false, "bpe_tokenizer::from_dir: '", dir.string(), "' has neither tokenizer.json nor vocab.json + merges.txt");
  }
  auto token_of = [&](const char* key) -> std::string {
    const auto it = config.find(key);
    if (it == config.end() || it->is_null()) return {};
    if (it->is_string()) return it->get<std::string>();
    if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) return (*it)["content"].get<std::string>();
    detail::json_fail(std::string("tokenizer_config.json: ") + key, "= " + detail::dump_short(*it) + ": expected a token string or {\"content\": ...}");
  };
  auto resolve = [&](const char* key, std::optional<std::int64_t>& dst) {
    const auto s = token_of(key);
    if (s.empty()) return;
    const auto id = t.token_to_id(s);
    if (!id) detail::json_fail(std::string("tokenizer_config.json: ") + key, "= '" + s + "': not in the vocabulary");
    dst = id;
  };
  resolve("eos_token", t.eos_);
  resolve("pad_token", t.pad_);
  resolve("bos_token", t.bos_);
  if (const auto it = config.find("chat_template"); it != config.end() && !it->is_null()) {
    if (it->is_string()) {
      t.chat_template_ = it->get<std::string>();
    } else if (it->is_array()) {  // [{"name": "default", "template": "..."}, ...]
      for (const auto& e : *it)
        if (e.is_object() && e.contains("name") && e["name"] == "default" && e.contains("template") && e["template"].is_string())
          t.chat_template_ = e["template"].get<std::string>();
    } else {
      detail::json_fail("tokenizer_config.json: chat_template", "expected a string or a list of {name, template}");
    }
  } else if (fs::exists(dir / "chat_template.jinja")) {
    t.chat_template_ = detail::read_file(dir / "chat_template.jinja");
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Encoding

inline void bpe_tokenizer::bpe_word(std::string_view bytes, std::vector<std::int64_t>& out) const {
  const auto& st = *st_;
  if (bytes.empty()) return;
  if (bytes.size() < 256) {
    std::lock_guard<std::mutex> lock(st.cache_mutex);
    if (const auto it = st.cache.find(bytes); it != st.cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<std::int64_t> result;
  if (st.ignore_merges) {
    if (const auto it = st.model_bytes.find(bytes); it != st.model_bytes.end()) result.push_back(it->second);
  }
  if (result.empty()) {
    thread_local std::vector<std::int64_t> sym;
    sym.clear();
    bool last_unk = false;
    for (unsigned char b : bytes) {
      const auto id = st.byte_id[b];
      if (id >= 0) {
        sym.push_back(id);
        last_unk = false;
        continue;
      }
      if (st.byte_fallback) {
        // The byte-level character of b, as UTF-8, in <0xNN> tokens.
        std::string ch;
        unicode::append_utf8(ch, detail::bytes_map().to_cp[b]);
        bool all = true;
        for (unsigned char c : ch) all = all && st.fallback_id[c] >= 0;
        if (all) {
          for (unsigned char c : ch) sym.push_back(st.fallback_id[c]);
          last_unk = false;
          continue;
        }
      }
      if (st.unk_id) {
        if (!(st.fuse_unk && last_unk)) sym.push_back(*st.unk_id);
        last_unk = true;
      }
    }
    // Merge the lowest-rank adjacent pair, leftmost first, until none is left (Hugging Face's
    // order). A linked list over `sym` with a priority queue keeps long words O(n log n).
    const std::size_t n = sym.size();
    if (n > 1) {
      thread_local std::vector<std::int32_t> next, prev;
      next.resize(n);
      prev.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        next[i] = i + 1 < n ? static_cast<std::int32_t>(i + 1) : -1;
        prev[i] = static_cast<std::int32_t>(i) - 1;
      }
      struct cand {
        std::int32_t rank, pos, right;
        std::int64_t left_id, right_id;
        bool operator>(const cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
      };
      std::priority_queue<cand, std::vector<cand>, std::greater<cand>> q;
      auto push = [&](std::int32_t i) {
        const auto j = next[static_cast<std::size_t>(i)];
        if (j < 0) return;
        const auto key = (static_cast<std::uint64_t>(sym[static_cast<std::size_t>(i)]) << 32) |
                         static_cast<std::uint64_t>(sym[static_cast<std::size_t>(j)]);
        if (const auto it = st.merge_map.find(key); it != st.merge_map.end())
          q.push({it->second.first, i, j, sym[static_cast<std::size_t>(i)], sym[static_cast<std::size_t>(j)]});
      };
      for (std::size_t i = 0; i + 1 < n; ++i) push(static_cast<std::int32_t>(i));
      std::vector<bool> dead(n, false);
      while (!q.empty()) {
        const auto c = q.top();
        q.pop();
        const auto i = static_cast<std::size_t>(c.pos);
        if (dead[i] || next[i] != c.right || sym[i] != c.left_id || sym[static_cast<std::size_t>(c.right)] != c.right_id) continue;
        const auto key = (static_cast<std::uint64_t>(c.left_id) << 32) | static_cast<std::uint64_t>(c.right_id);
        sym[i] = st.merge_map.find(key)->second.second;
        const auto j = static_cast<std::size_t>(c.right);
        dead[j] = true;
        next[i] = next[j];
        if (next[j] >= 0) prev[static_cast<std::size_t>(next[j])] = static_cast<std::int32_t>(i);
        if (prev[i] >= 0) push(prev[i]);
        push(static_cast<std::int32_t>(i));
      }
      for (std::int32_t i = 0; i >= 0; i = next[static_cast<std::size_t>(i)]) result.push_back(sym[static_cast<std::size_t>(i)]);
    } else {
      result.assign(sym.begin(), sym.end());
    }
  }
  out.insert(out.end(), result.begin(), result.end());
  if (bytes.size() < 256) {
    std::lock_guard<std::mutex> lock(st.cache_mutex);
    if (st.cache.size() > 500000) st.cache.clear();
    st.cache.emplace(std::string(bytes), std::move(result));
  }
}

inline void bpe_tokenizer::encode_segment(std::string_view text, std::vector<std::int64_t>& out) const {
  const auto& st = *st_;
  if (text.empty()) return;
  std::string normalized;
  if (st.nfc) {
    normalized = unicode::nfc(text);
    text = normalized;
  }
  // Pieces after each pre-tokenizer step (views into `text` or into `owned`).
  thread_local std::vector<std::string_view> pieces, next_pieces;
  std::deque<std::string> owned;  // pieces with a prefix space added (stable addresses)
  pieces.assign(1, text);
  for (const auto& step : st.pretok) {
    next_pieces.clear();
    for (auto p : pieces) {
      if (!step.split && step.add_prefix_space && (p.empty() || p.front() != ' ')) {
        auto& prefixed = owned.emplace_back(1, ' ');
        prefixed.append(p.data(), p.size());
        p = prefixed;
      }
      if (step.split) split_text(step.kind, p, next_pieces);
      else if (step.use_regex) split_text(pre_tokenizer_kind::gpt2, p, next_pieces);
      else next_pieces.push_back(p);
    }
    std::swap(pieces, next_pieces);
  }
  for (auto p : pieces) bpe_word(p, out);
}

inline void bpe_tokenizer::encode_into(std::string_view text, std::vector<std::int64_t>& out, bool add_special_tokens) const {
  const auto& st = *st_;
  if (add_special_tokens) out.insert(out.end(), st.prefix_ids.begin(), st.prefix_ids.end());
  if (st.added.empty()) {
    encode_segment(text, out);
  } else {
    auto is_word = [](std::uint32_t cp) {
      const auto c = unicode::category_of(cp);
      return c == unicode::category::letter || c == unicode::category::number || cp == '_';
    };
    auto last_cp = [&](std::size_t end) -> std::uint32_t {  // code point ending at byte `end`
      std::size_t b = end - 1;
      while (b > 0 && end - b < 4 && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
      std::uint32_t cp = 0;
      const auto* p = reinterpret_cast<const unsigned char*>(text.data());
      unicode::decode_utf8(p + b, p + end, cp);
      return cp;
    };
    auto first_cp = [&](std::size_t begin) -> std::uint32_t {
      std::uint32_t cp = 0;
      const auto* p = reinterpret_cast<const unsigned char*>(text.data());
      unicode::decode_utf8(p + begin, p + text.size(), cp);
      return cp;
    };
    std::size_t seg_begin = 0;  // start of the text not yet encoded
    std::size_t i = 0;
    while (i < text.size()) {
      const auto& cands = st.added_by_first_byte[static_cast<unsigned char>(text[i])];
      const added_token* hit = nullptr;
      for (auto k : cands) {
        const auto& t = st.added[k];
        if (text.compare(i, t.content.size(), t.content) != 0) continue;
        if (t.single_word) {
          const auto e = i + t.content.size();
          if ((i > 0 && is_word(last_cp(i))) || (e < text.size() && is_word(first_cp(e)))) continue;
        }
        hit = &t;
        break;
      }
      if (hit == nullptr) {
        ++i;
        continue;
      }
      std::size_t start = i, stop = i + hit->content.size();
      if (hit->lstrip) {
        while (start > seg_begin) {
          const auto cp = last_cp(start);
          if (!unicode::is_space(cp)) break;
          std::string tmp;
          unicode::append_utf8(tmp, cp);
          start -= tmp.size();
        }
      }
      if (hit->rstrip) {
        while (stop < text.size()) {
          std::uint32_t cp = 0;
          const auto* p = reinterpret_cast<const unsigned char*>(text.data());
          const auto len = unicode::decode_utf8(p + stop, p + text.size(), cp);
          if (!unicode::is_space(cp)) break;
          stop += len;
        }
      }
      encode_segment(text.substr(seg_begin, start - seg_begin), out);
      out.push_back(hit->id);
      seg_begin = i = stop;
    }
    encode_segment(text.substr(seg_begin), out);
  }
  if (add_special_tokens) out.insert(out.end(), st.suffix_ids.begin(), st.suffix_ids.end());
}

// ---------------------------------------------------------------------------------------------
// Decoding and saving

inline std::string bpe_tokenizer::decode_bytes(const std::vector<std::int64_t>& ids, bool skip_special_tokens) const {
  const auto& st = *st_;
  std::string out;
  auto keep = [&](std::int64_t id) {
    if (id < 0 || id >= vocab_size()) return false;
    const auto flags = st.id_flags[static_cast<std::size_t>(id)];
    return flags != 0 && !(skip_special_tokens && (flags & 4) != 0);
  };
  if (st.decoder.size() == 1 && st.decoder[0] == detail::decode_step::byte_level) {  // the usual case
    for (const auto id : ids)
      if (keep(id)) out += st.id_bytes[static_cast<std::size_t>(id)];
    return out;
  }
  std::vector<std::string> toks;
  for (const auto id : ids)
    if (keep(id)) toks.push_back(st.id_token[static_cast<std::size_t>(id)]);
  if (st.decoder_null) {  // Hugging Face joins the tokens with spaces when there is no decoder
    for (std::size_t i = 0; i < toks.size(); ++i) out += (i ? " " : "") + toks[i];
    return out;
  }
  // The decoder chain, step by step over the token texts, as Hugging Face runs it.
  auto fallback_byte = [](const std::string& t) -> int {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>' || !std::isxdigit(static_cast<unsigned char>(t[3])) ||
        !std::isxdigit(static_cast<unsigned char>(t[4])))
      return -1;
    return std::stoi(t.substr(3, 2), nullptr, 16);
  };
  for (const auto step : st.decoder) {
    std::vector<std::string> next;
    if (step == detail::decode_step::byte_fallback) {
      std::string run;
      std::size_t run_len = 0;
      auto flush = [&] {
        if (run_len == 0) return;
        if (unicode::is_valid_utf8(run)) next.push_back(run);
        else for (std::size_t i = 0; i < run_len; ++i) next.emplace_back("\xEF\xBF\xBD");
        run.clear();
        run_len = 0;
      };
      for (auto& t : toks) {
        const int b = fallback_byte(t);
        if (b >= 0) {
          run += static_cast<char>(b);
          ++run_len;
        } else {
          flush();
          next.push_back(std::move(t));
        }
      }
      flush();
    } else if (step == detail::decode_step::fuse) {
      std::string all;
      for (const auto& t : toks) all += t;
      next.push_back(std::move(all));
    } else {  // byte_level: a token whose characters are all byte characters becomes those bytes
      for (auto& t : toks) {
        auto b = detail::token_to_bytes(t);
        next.push_back(b ? std::move(*b) : std::move(t));
      }
    }
    toks = std::move(next);
  }
  for (const auto& t : toks) out += t;
  return out;
}

inline std::string bpe_tokenizer::to_json_text() const {
  const auto& st = *st_;
  nlohmann::ordered_json root;
  root["version"] = "1.0";
  root["truncation"] = nullptr;
  root["padding"] = nullptr;
  auto added = nlohmann::ordered_json::array();
  auto sorted = st.added;
  std::sort(sorted.begin(), sorted.end(), [](const added_token& a, const added_token& b) { return a.id < b.id; });
  for (const auto& t : sorted) {
    nlohmann::ordered_json a;
    a["id"] = t.id;
    a["content"] = t.content;
    a["single_word"] = t.single_word;
    a["lstrip"] = t.lstrip;
    a["rstrip"] = t.rstrip;
    a["normalized"] = t.normalized;
    a["special"] = t.special;
    added.push_back(std::move(a));
  }
  root["added_tokens"] = std::move(added);
  root["normalizer"] = st.normalizer_json;
  root["pre_tokenizer"] = st.pre_tokenizer_json;
  root["post_processor"] = st.post_processor_json;
  root["decoder"] = st.decoder_json;
  nlohmann::ordered_json model;
  model["type"] = "BPE";
  model["dropout"] = nullptr;
  model["unk_token"] = st.unk_id ? nlohmann::ordered_json(st.id_token[static_cast<std::size_t>(*st.unk_id)]) : nlohmann::ordered_json(nullptr);
  model["continuing_subword_prefix"] = nullptr;
  model["end_of_word_suffix"] = nullptr;
  model["fuse_unk"] = st.fuse_unk;
  model["byte_fallback"] = st.byte_fallback;
  model["ignore_merges"] = st.ignore_merges;
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (std::size_t id = 0; id < st.id_token.size(); ++id)
    if ((st.id_flags[id] & 1) != 0) vocab[st.id_token[id]] = id;
  model["vocab"] = std::move(vocab);
  // "a b" strings are read by every version of tokenizers; pairs only when a token has a space.
  bool spaces = false;
  for (const auto& [a, b] : st.merges)
    spaces = spaces || st.id_token[static_cast<std::size_t>(a)].find(' ') != std::string::npos ||
             st.id_token[static_cast<std::size_t>(b)].find(' ') != std::string::npos;
  auto merges = nlohmann::ordered_json::array();
  for (const auto& [a, b] : st.merges) {
    const auto& ta = st.id_token[static_cast<std::size_t>(a)];
    const auto& tb = st.id_token[static_cast<std::size_t>(b)];
    if (spaces) merges.push_back(nlohmann::ordered_json::array({ta, tb}));
    else merges.push_back(ta + " " + tb);
  }
  model["merges"] = std::move(merges);
  root["model"] = std::move(model);
  return root.dump(1, ' ', false, nlohmann::ordered_json::error_handler_t::strict);
}

inline void bpe_tokenizer::save(const std::filesystem::path& dir) const {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  {
    std::ofstream out(dir / "tokenizer.json", std::ios::binary);
    UNIRL_CHECK(out.good(), "bpe_tokenizer::save: cannot write '", (dir / "tokenizer.json").string(), "'");
    out << to_json_text();
  }
  nlohmann::ordered_json config;
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  config["clean_up_tokenization_spaces"] = false;
  config["add_bos_token"] = false;
  auto tok = [&](const std::optional<std::int64_t>& id) {
    return id ? nlohmann::ordered_json(st_->id_token[static_cast<std::size_t>(*id)]) : nlohmann::ordered_json(nullptr);
  };
  config["bos_token"] = tok(bos_);
  config["eos_token"] = tok(eos_);
  config["pad_token"] = tok(pad_ ? pad_ : eos_);
  if (!chat_template_.empty()) config["chat_template"] = chat_template_;
  std::ofstream out(dir / "tokenizer_config.json", std::ios::binary);
  UNIRL_CHECK(out.good(), "bpe_tokenizer::save: cannot write '", (dir / "tokenizer_config.json").string(), "'");
  out << config.dump(2);
}

}  // namespace unirl::tokenizers
