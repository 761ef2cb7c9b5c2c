// libFuzzer target: the tokenizer.json loader and the byte-level BPE encoder (torch-free).
//   bash scripts/fuzz.sh tokenizer 60
// First byte even: the rest is a tokenizer.json; when it loads, it encodes and decodes texts and
// its saved form loads again. First byte odd: the rest is text for two fixed tokenizers (GPT-2
// pattern without normalizer; Qwen2 pattern with NFC; added tokens with lstrip / rstrip /
// single_word; a missing byte token reached through byte_fallback).
// Findings: any exception but unirl::error, a crash, a leak, undefined behaviour, or a broken
// invariant: decode_bytes(encode(x)) == x without normalizer, NFC idempotent, decode gives
// valid UTF-8, the split patterns cover the text with non-empty pieces.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>
#include <unirl/tokenizers/tokenizers.hpp>

namespace {
namespace ut = unirl::tokenizers;

ut::bpe_tokenizer make(bool qwen) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 1; b < 256; ++b) {  // byte 0 ("Ā") only through <0xC4><0x80>
    std::string t;
    ut::unicode::append_utf8(t, ut::detail::bytes_map().to_cp[static_cast<std::size_t>(b)]);
    vocab[t] = b;
  }
  for (const auto& [t, id] : {std::pair{"<0xC4>", 256}, {"<0x80>", 257}, {"Ġt", 258}, {"he", 259}, {"Ġthe", 260}, {"in", 261}})
    vocab[t] = id;
  nlohmann::json j = {
      {"added_tokens", {{{"id", 300}, {"content", "<|im_start|>"}, {"special", true}},
                        {{"id", 301}, {"content", "<|im_end|>"}, {"special", true}, {"rstrip", true}},
                        {{"id", 302}, {"content", "<x>"}, {"lstrip", true}, {"single_word", true}},
                        {{"id", 303}, {"content", "<y>"}}}},
      {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, {{"type", "ByteLevel"}}}}}},
      {"model", {{"type", "BPE"}, {"byte_fallback", true}, {"vocab", vocab}, {"merges", {"Ġ t", "h e", "Ġt he", "i n"}}}}};
  if (qwen) {
    j["normalizer"] = {{"type", "NFC"}};
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", std::string(ut::pattern_text(ut::pre_tokenizer_kind::qwen2))}}}},
                                             {{"type", "ByteLevel"}, {"use_regex", false}}}}};
  } else {
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  }
  return ut::bpe_tokenizer::from_json(j, "fuzz");
}

void check(bool ok) {
  if (!ok) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 1) {
    static const auto plain = make(false);
    static const auto qwen = make(true);
    for (bool special : {false, true}) {
      const auto ids = plain.encode(rest, special);
      // rstrip on <|im_end|> and lstrip on <x> swallow white space; elsewhere the bytes come back.
      if (rest.find("<|im_end|>") == std::string_view::npos && rest.find("<x>") == std::string_view::npos)
        check(plain.decode_bytes(ids) == rest);
      check(ut::unicode::is_valid_utf8(plain.decode(ids)));
      check(ut::unicode::is_valid_utf8(qwen.decode(qwen.encode(rest, special), special)));
    }
    const auto n1 = ut::unicode::nfc(rest);
    check(ut::unicode::nfc(n1) == n1);
    check(ut::unicode::is_valid_utf8(rest) == ut::unicode::is_valid_utf8(n1));
    for (auto k : {ut::pre_tokenizer_kind::gpt2, ut::pre_tokenizer_kind::qwen2, ut::pre_tokenizer_kind::llama3}) {
      std::string joined;
      for (auto piece : ut::split_text(k, rest)) {
        check(!piece.empty());
        joined += piece;
      }
      check(joined == rest);
    }
    return 0;
  }
  try {
    const auto tok = ut::bpe_tokenizer::from_json_text(rest, "fuzz.json");
    for (std::string_view text : {std::string_view("Hello world's 123 <|im_end|> \xC3\xA9\xFF"), rest.substr(0, 256)}) {
      const auto ids = tok.encode(text, true);
      for (auto id : ids) check(id >= 0 && id < tok.vocab_size());
      check(ut::unicode::is_valid_utf8(tok.decode(ids)));
    }
    (void)ut::bpe_tokenizer::from_json_text(tok.to_json_text());
  } catch (const unirl::error&) {
  }
  return 0;
}
