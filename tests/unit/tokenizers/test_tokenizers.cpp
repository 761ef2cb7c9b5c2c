// Byte-level BPE tokenizers against independent implementations: the expected ids in
// tests/fixtures/tokenizers come from Hugging Face's Rust `tokenizers` (its official Node binding),
// cross-checked with the JavaScript port @huggingface/tokenizers and gpt-3-encoder
// (make_reference.mjs, reference_stats.json); chat templates against @huggingface/jinja rendering
// the published templates; Unicode edge cases against hand values from the standards.
#include <zlib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <unirl/rollout/token.hpp>
#include <unirl/tokenizers/tokenizers.hpp>

namespace fs = std::filesystem;
using namespace unirl::tokenizers;

namespace {

const fs::path fixtures = fs::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "tokenizers";

std::string gunzip(const fs::path& p) {
  gzFile f = gzopen(p.string().c_str(), "rb");
  REQUIRE(f != nullptr);
  std::string out;
  char buf[1 << 16];
  for (int n; (n = gzread(f, buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  gzclose(f);
  return out;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  for (std::size_t pos = 0; pos < text.size();) {
    auto eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    lines.push_back(text.substr(pos, eol - pos));
    pos = eol + 1;
  }
  return lines;
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> lines = [] {
    std::vector<std::string> out;
    for (const auto& l : split_lines(gunzip(fixtures / "corpus.jsonl.gz"))) out.push_back(nlohmann::json::parse(l).get<std::string>());
    return out;
  }();
  return lines;
}

std::vector<std::vector<std::int64_t>> expected_ids(const std::string& name) {
  std::vector<std::vector<std::int64_t>> out;
  for (const auto& l : split_lines(gunzip(fixtures / name))) {
    std::vector<std::int64_t> ids;
    std::size_t pos = 0;
    while (pos < l.size()) {
      auto sp = l.find(' ', pos);
      if (sp == std::string::npos) sp = l.size();
      ids.push_back(std::stoll(l.substr(pos, sp - pos)));
      pos = sp + 1;
    }
    out.push_back(std::move(ids));
  }
  return out;
}

struct temp_dir {
  fs::path path;
  temp_dir() {
    path = fs::temp_directory_path() / ("unirl_tok_" + std::to_string(std::random_device{}()));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

bpe_tokenizer gpt2() {
  return bpe_tokenizer::from_gpt2_text(gunzip(fixtures / "gpt2" / "vocab.json.gz"), gunzip(fixtures / "gpt2" / "merges.txt.gz"));
}

/// The Qwen3 tokenizer (merges the corpus needs) as a model directory.
fs::path qwen3_dir(const temp_dir& t) {
  const auto d = t.path / "qwen3";
  fs::create_directories(d);
  std::ofstream(d / "tokenizer.json", std::ios::binary) << gunzip(fixtures / "qwen3" / "tokenizer.json.gz");
  fs::copy_file(fixtures / "qwen3" / "tokenizer_config.json", d / "tokenizer_config.json");
  return d;
}

/// Every corpus line encodes to the reference ids and decodes back to itself.
void check_parity(const bpe_tokenizer& tok, const std::string& ids_file, std::int64_t expected_tokens) {
  const auto& lines = corpus();
  const auto expected = expected_ids(ids_file);
  REQUIRE(expected.size() == lines.size());
  std::size_t mismatched = 0, not_round_trip = 0, first_bad = lines.size();
  std::int64_t tokens = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<std::int64_t>> got(lines.size());
  for (std::size_t i = 0; i < lines.size(); ++i) got[i] = tok.encode(lines[i]);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (std::size_t i = 0; i < lines.size(); ++i) {
    tokens += static_cast<std::int64_t>(got[i].size());
    if (got[i] != expected[i]) {
      ++mismatched;
      first_bad = std::min(first_bad, i);
    }
    if (tok.decode(got[i]) != (tok.normalizes_nfc() ? unicode::nfc(lines[i]) : lines[i])) ++not_round_trip;
  }
  INFO(ids_file << ": " << lines.size() << " lines, " << tokens << " tokens, " << mismatched << " mismatched, first at line "
                << first_bad << (first_bad < lines.size() ? ": " + nlohmann::json(lines[first_bad]).dump() : std::string()));
  CHECK(mismatched == 0);
  CHECK(not_round_trip == 0);
  CHECK(tokens == expected_tokens);
  WARN(ids_file << ": " << lines.size() << " lines, " << tokens << " tokens, 0 mismatches expected; cold-cache encode "
                << static_cast<std::int64_t>(static_cast<double>(tokens) / secs) << " tokens/s");
}

}  // namespace

static_assert(std::is_same_v<bpe_tokenizer::decoder_function, unirl::token_decoder>,
              "bpe_tokenizer::decoder() must plug into prompt_batch::decode");

TEST_CASE("tokenizers: GPT-2 matches Hugging Face on the corpus", "[tokenizers][cpu]") {
  const auto tok = gpt2();
  CHECK(tok.vocab_size() == 50257);
  CHECK(tok.num_merges() == 50000);
  CHECK(tok.token_to_id("<|endoftext|>") == 50256);
  CHECK(tok.eos_id() == 50256);
  CHECK(tok.encode("Hello world") == std::vector<std::int64_t>{15496, 995});  // GPT-2's well-known ids
  check_parity(tok, "ids_gpt2.txt.gz", 370641);
}

TEST_CASE("tokenizers: Qwen3 tokenizer.json matches Hugging Face on the corpus", "[tokenizers][cpu]") {
  temp_dir t;
  const auto tok = bpe_tokenizer::from_dir(qwen3_dir(t));
  CHECK(tok.vocab_size() == 151669);
  CHECK(tok.eos_id() == 151645);  // <|im_end|> (tokenizer_config.json)
  CHECK(tok.pad_id() == 151643);  // <|endoftext|>
  CHECK_FALSE(tok.bos_id().has_value());
  CHECK(guess_chat_format(tok.chat_template()) == chat_format::chatml);
  check_parity(tok, "ids_qwen3.txt.gz", 238642);

  SECTION("special tokens in text, decode with and without them") {
    const auto ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n");
    REQUIRE(ids.size() >= 4);
    CHECK(ids.front() == 151644);
    CHECK(std::count(ids.begin(), ids.end(), 151645) == 1);
    CHECK(tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n");
    CHECK(tok.decode(ids, true) == "user\nHi\n");
    CHECK(tok.is_special(151644));
    CHECK_FALSE(tok.is_special(151667));  // <think> is added but not special
    CHECK(tok.encode("a<think>b") == std::vector<std::int64_t>{64, 151667, 65});
    // Ids without a token (Qwen's embedding rows past the vocabulary) decode to nothing.
    CHECK(tok.decode({9707, 151700, -1, 151935}) == "Hello");
    const unirl::prompt_batch in{.tokens = {ids}, .decode = tok.decoder(), .pad_id = tok.pad_id()};
    CHECK(in.decode(ids) == tok.decode(ids));
  }
  SECTION("save writes a tokenizer that loads back to the same ids") {
    temp_dir out;
    tok.save(out.path / "saved");
    const auto back = bpe_tokenizer::from_dir(out.path / "saved");
    CHECK(back.vocab_size() == tok.vocab_size());
    CHECK(back.eos_id() == tok.eos_id());
    CHECK(back.pad_id() == tok.pad_id());
    CHECK(back.chat_template() == tok.chat_template());
    const auto expected = expected_ids("ids_qwen3.txt.gz");
    std::size_t bad = 0;
    for (std::size_t i = 0; i < corpus().size(); i += 7) bad += back.encode(corpus()[i]) != expected[i] ? 1 : 0;
    CHECK(bad == 0);
  }
}

TEST_CASE("tokenizers: tokenizers our trainer wrote match Hugging Face on the corpus", "[tokenizers][cpu]") {
  for (const auto* name : {"trained_qwen2", "trained_gpt2"}) {
    INFO(name);
    const auto tok = bpe_tokenizer::from_dir(fixtures / name);
    CHECK(tok.eos_id() == 0);
    check_parity(tok, std::string("ids_") + name + ".txt.gz", std::string(name) == "trained_qwen2" ? 201103 : 304877);
  }
  SECTION("ignore_merges (Llama-3's option): the reference gives the same ids on this vocabulary") {
    auto json = nlohmann::json::parse(read_text(fixtures / "trained_qwen2" / "tokenizer.json"));
    json["model"]["ignore_merges"] = true;
    check_parity(bpe_tokenizer::from_json(json), "ids_trained_qwen2.txt.gz", 201103);
  }
  SECTION("the committed files are what train_bpe writes (deterministic)") {
    const std::vector<std::string> specials{"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    CHECK(train_bpe(corpus(), 2048, pre_tokenizer_kind::qwen2, specials).to_json_text() ==
          read_text(fixtures / "trained_qwen2" / "tokenizer.json"));
    CHECK(train_bpe(corpus(), 1024, pre_tokenizer_kind::gpt2, specials).to_json_text() ==
          read_text(fixtures / "trained_gpt2" / "tokenizer.json"));
  }
  SECTION("trainer input checks") {
    CHECK_THROWS_WITH(train_bpe({"abc"}, 100, pre_tokenizer_kind::gpt2, {}), Catch::Contains("vocab_size = 100"));
    CHECK_THROWS_WITH(train_bpe({"abc"}, 300, pre_tokenizer_kind::gpt2, {"<a>", "<a>"}), Catch::Contains("given twice"));
  }
}

TEST_CASE("tokenizers: chat templates match @huggingface/jinja on the published templates", "[tokenizers][cpu]") {
  const auto cases = nlohmann::json::parse(read_text(fixtures / "chat_expected.json"));
  REQUIRE(cases.size() == 28);
  for (const auto& c : cases) {
    std::vector<chat_message> messages;
    for (const auto& m : c["messages"]) messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    const auto f = c["format"] == "chatml" ? chat_format::chatml : c["format"] == "qwen2_5" ? chat_format::qwen2_5 : chat_format::llama3;
    INFO(c["source"].get<std::string>() << ", add_generation_prompt " << c["add_generation_prompt"]);
    CHECK(apply_chat_template(f, messages, c["add_generation_prompt"].get<bool>()) == c["text"].get<std::string>());
  }
  CHECK(apply_chat_template(chat_format::plain, {{"system", "S"}, {"user", "2+2?"}}) == "System: S\n\nUser: 2+2?\n\nAssistant:");
  CHECK(guess_chat_format("{{ '<|start_header_id|>' }}") == chat_format::llama3);
  CHECK_FALSE(guess_chat_format("{{ messages }}").has_value());
}

TEST_CASE("tokenizers: split patterns, NFC and UTF-8 repair against hand values", "[tokenizers][cpu]") {
  using V = std::vector<std::string_view>;
  CHECK(split_text(pre_tokenizer_kind::gpt2, "Hello world's  end") == V{"Hello", " world", "'s", " ", " end"});
  CHECK(split_text(pre_tokenizer_kind::gpt2, "I'M 12345 ab\t\n x") == V{"I", "'", "M", " 12345", " ab", "\t\n", " x"});
  CHECK(split_text(pre_tokenizer_kind::qwen2, "I'M 12345") == V{"I", "'M", " ", "1", "2", "3", "4", "5"});
  CHECK(split_text(pre_tokenizer_kind::llama3, "x 12345\n\n  y") == V{"x", " ", "123", "45", "\n\n", " ", " y"});
  CHECK(split_text(pre_tokenizer_kind::qwen2, "a...\n\nb") == V{"a", "...\n\n", "b"});
  CHECK(pattern_kind(pattern_text(pre_tokenizer_kind::llama3)) == pre_tokenizer_kind::llama3);
  CHECK_FALSE(pattern_kind("\\w+").has_value());
  // UAX #15 examples.
  CHECK(unicode::nfc("e\xCC\x81") == "\xC3\xA9");
  CHECK(unicode::nfc("\xE2\x84\xAB") == "\xC3\x85");                  // U+212B ANGSTROM SIGN -> U+00C5
  CHECK(unicode::nfc("\xE1\xBA\x9B\xCC\xA3") == "\xE1\xBA\x9B\xCC\xA3");  // U+1E9B U+0323 stays
  CHECK(unicode::nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8") == "\xEA\xB0\x81");  // L V T -> U+AC01
  CHECK(unicode::nfc("a\xCC\xA3\xCC\x87") == "\xE1\xBA\xA1\xCC\x87");  // a + dot below + dot above
  CHECK(unicode::nfc("\xFF\xCC\x81") == "\xFF\xCC\x81");               // invalid byte passes through
  // WHATWG / Unicode "maximal subpart" replacement.
  CHECK(unicode::to_valid_utf8("\xC3\x28") == "\xEF\xBF\xBD(");
  CHECK(unicode::to_valid_utf8("\xE2\x82") == "\xEF\xBF\xBD");
  CHECK(unicode::to_valid_utf8("\xF0\x90\x80x") == "\xEF\xBF\xBDx");
  CHECK(unicode::to_valid_utf8("\xED\xA0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  CHECK(unicode::category_of(0x4E2D) == unicode::category::letter);
  CHECK(unicode::category_of(0x0663) == unicode::category::number);
  CHECK(unicode::category_of(0x3000) == unicode::category::space);
  CHECK(unicode::category_of(0xFEFF) == unicode::category::other);
}

TEST_CASE("tokenizers: invalid UTF-8 and random bytes encode by their bytes", "[tokenizers][cpu]") {
  const auto g = gpt2();
  temp_dir t;
  const auto q = bpe_tokenizer::from_dir(qwen3_dir(t));  // NFC: decode gives the NFC of the text
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string s(static_cast<std::size_t>(rng() % 40), '\0');
    for (auto& c : s) c = static_cast<char>(rng() % 4 == 0 ? 0x80 + rng() % 128 : rng() % 256);
    if (i % 5 == 0) s += "<|im_end|>";
    for (const auto* tok : {&g, &q}) {
      const auto ids = tok->encode(s);
      CHECK(tok->decode_bytes(ids) == (tok->normalizes_nfc() ? unicode::nfc(s) : s));
      CHECK(unicode::is_valid_utf8(tok->decode(ids)));
    }
  }
  // A lone invalid byte is one "other" code point: GPT-2 keeps the space in front of it.
  const auto ids = g.encode(" \xFF");
  CHECK(ids.size() == 2);
  CHECK(g.decode_bytes(ids) == " \xFF");
  CHECK(g.decode(ids) == " \xEF\xBF\xBD");
}

TEST_CASE("tokenizers: model options on a hand-made tokenizer.json", "[tokenizers][cpu]") {
  // Byte-level vocabulary over "abc " (space is "Ġ") with merges a+b, ab+c, b+c.
  auto make = [](nlohmann::json model_extra, nlohmann::json added = nlohmann::json::array()) {
    nlohmann::json vocab = {{"a", 0}, {"b", 1}, {"c", 2}, {"Ġ", 3}, {"ab", 4}, {"abc", 5}, {"bc", 6}, {"<0x61>", 7}};
    nlohmann::json j = {{"added_tokens", added},
                        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
                        {"decoder", {{"type", "ByteLevel"}}},
                        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array({"b c", "a b", "ab c"})}}}};
    for (auto it = model_extra.begin(); it != model_extra.end(); ++it) j["model"][it.key()] = it.value();
    return bpe_tokenizer::from_json(j);
  };
  using I = std::vector<std::int64_t>;
  CHECK(make({}).encode("abc") == I{0, 6});                      // "b c" ranks first: a + bc
  CHECK(make({{"ignore_merges", true}}).encode("abc") == I{5});  // the word is in the vocabulary
  CHECK(make({{"merges", nlohmann::json::array({nlohmann::json::array({"a", "b"}), nlohmann::json::array({"ab", "c"})})}}).encode("abc") == I{5});
  CHECK(make({}).encode("ab d") == I{4, 3});                     // "d" has no token and no unk: dropped
  CHECK(make({{"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"Ġ", 3}, {"ab", 4}, {"abc", 5}, {"bc", 6}, {"<unk>", 7}}}, {"unk_token", "<unk>"}, {"fuse_unk", true}})
            .encode("dd a") == I{7, 3, 0});
  CHECK(make({{"byte_fallback", true}, {"vocab", {{"b", 1}, {"c", 2}, {"Ġ", 3}, {"bc", 6}, {"<0x61>", 7}}}, {"merges", nlohmann::json::array({"b c"})}})
            .encode("abc") == I{7, 6});
  // Added tokens: lstrip / rstrip take the white space next to them; single_word needs word edges.
  auto added = [](bool l, bool r, bool single) {
    return nlohmann::json::array({{{"id", 8}, {"content", "<x>"}, {"special", true}, {"lstrip", l}, {"rstrip", r}, {"single_word", single}}});
  };
  CHECK(make({}, added(false, false, false)).encode("a <x> b") == I{0, 3, 8, 3, 1});
  CHECK(make({}, added(true, false, false)).encode("a <x> b") == I{0, 8, 3, 1});
  CHECK(make({}, added(false, true, false)).encode("a <x> b") == I{0, 3, 8, 1});
  CHECK(make({}, added(false, false, true)).encode("a<x> <x>") == I{0, 3, 8});  // "<x>" after "a" is text (no tokens)
  CHECK(make({{"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"Ġ", 3}, {"ab", 4}, {"abc", 5}, {"bc", 6}, {"<", 7}, {"x", 9}, {">", 10}}}}, added(false, false, true))
            .encode("a<x>") == I{0, 7, 9, 10});
  CHECK(make({}, added(false, false, false)).vocab_size() == 9);
  // Decoders as Hugging Face chains them (behaviour observed with tokenizers 0.23.2): ByteLevel
  // alone maps "<0x61>" character by character; ByteFallback first turns it into the byte "a";
  // no decoder joins the token texts with spaces.
  {
    nlohmann::json j = {{"pre_tokenizer", {{"type", "ByteLevel"}}},
                        {"model", {{"vocab", {{"a", 0}, {"b", 1}, {"Ġ", 3}, {"<0x61>", 7}, {"<0xFF>", 8}}}, {"merges", nlohmann::json::array()}}}};
    j["decoder"] = {{"type", "ByteLevel"}};
    CHECK(bpe_tokenizer::from_json(j).decode({0, 7, 3, 1}) == "a<0x61> b");
    j["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, {{"type", "ByteLevel"}}}}};
    CHECK(bpe_tokenizer::from_json(j).decode({0, 7, 3, 1}) == "aa b");
    CHECK(bpe_tokenizer::from_json(j).decode_bytes({8, 0}) == "\xEF\xBF\xBD" "a");  // a lone 0xFF is U+FFFD
    j["decoder"] = nullptr;
    CHECK(bpe_tokenizer::from_json(j).decode({0, 7, 3, 1}) == "a <0x61> Ġ b");
  }
  // ByteLevel add_prefix_space, and TemplateProcessing for add_special_tokens.
  nlohmann::json j = {{"added_tokens", added(false, false, false)},
                      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", true}}},
                      {"post_processor", {{"type", "TemplateProcessing"},
                                          {"single", {{{"SpecialToken", {{"id", "<x>"}}}}, {{"Sequence", {{"id", "A"}}}}, {{"SpecialToken", {{"id", "<x>"}}}}}}}},
                      {"decoder", {{"type", "ByteLevel"}}},
                      {"model", {{"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"Ġ", 3}, {"bc", 4}}}, {"merges", {"b c"}}}}};
  const auto p = bpe_tokenizer::from_json(j);
  CHECK(p.encode("abc") == I{3, 0, 4});
  CHECK(p.encode("abc", true) == I{8, 3, 0, 4, 8});
  CHECK(p.encode(" abc") == I{3, 0, 4});
  CHECK(p.decode({8, 3, 0, 4, 8}, true) == " abc");
}

TEST_CASE("tokenizers: malformed tokenizer.json names the key", "[tokenizers][cpu]") {
  const auto base = nlohmann::json::parse(read_text(fixtures / "trained_gpt2" / "tokenizer.json"));
  auto fails = [&](auto mutate, const std::string& what) {
    auto j = base;
    mutate(j);
    CHECK_THROWS_WITH(bpe_tokenizer::from_json_text(j.dump()), Catch::Contains(what));
  };
  CHECK_THROWS_WITH(bpe_tokenizer::from_json_text("{\"model\": "), Catch::Contains("not valid JSON"));
  CHECK_THROWS_WITH(bpe_tokenizer::from_json_text("[1, 2]"), Catch::Contains("top level"));
  fails([](auto& j) { j.erase("model"); }, "model: missing");
  fails([](auto& j) { j["model"]["type"] = "WordPiece"; }, "model.type");
  fails([](auto& j) { j["model"]["vocab"] = nlohmann::json::array(); }, "model.vocab");
  fails([](auto& j) { j["model"]["vocab"]["zz"] = -3; }, "model.vocab[\"zz\"]");
  fails([](auto& j) { j["model"]["vocab"]["zz"] = 1u << 30; }, "model.vocab[\"zz\"]");
  fails([](auto& j) { j["model"]["vocab"]["zz"] = 5; }, "id already used");
  fails([](auto& j) { j["model"].erase("merges"); }, "model.merges: missing");
  fails([](auto& j) { j["model"]["merges"][3] = "abc"; }, "model.merges[3]");
  fails([](auto& j) { j["model"]["merges"][4] = nlohmann::json::array({"q", 1}); }, "model.merges[4]");
  fails([](auto& j) { j["model"]["merges"].push_back("Ġ Ġ Ġ"); }, "one space");
  fails([](auto& j) { j["model"]["merges"].push_back("ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ Ġ"); }, "not in model.vocab");
  fails([](auto& j) { j["model"]["dropout"] = 0.1; }, "model.dropout");
  fails([](auto& j) { j["model"]["unk_token"] = "<nope>"; }, "model.unk_token");
  fails([](auto& j) { j["model"]["byte_fallback"] = "yes"; }, "model.byte_fallback");
  fails([](auto& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "normalizer.type");
  fails([](auto& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }, "pre_tokenizer.type");
  fails([](auto& j) { j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}}}; }, "pre_tokenizer.pattern.Regex");
  fails([](auto& j) { j["pre_tokenizer"] = nullptr; }, "expected a ByteLevel pre-tokenizer");
  fails([](auto& j) { j["decoder"] = {{"type", "WordPiece"}}; }, "decoder.type");
  fails([](auto& j) { j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", {{"id", "<nope>"}}}}}}}; }, "<nope>");
  fails([](auto& j) { j["added_tokens"][0]["content"] = ""; }, "added_tokens[0].content");
  fails([](auto& j) { j["added_tokens"][1]["id"] = 0; }, "added_tokens[1]");
  fails([](auto& j) { j["added_tokens"] = 5; }, "added_tokens");
  CHECK_THROWS_WITH(bpe_tokenizer::from_dir(fixtures / "no_such_dir"), Catch::Contains("not a directory"));
  CHECK_THROWS_WITH(bpe_tokenizer::from_gpt2_text("{\"a\": 0}", "#version: 0.2\na b c\n"), Catch::Contains("merges.txt line 2"));
  auto tok = bpe_tokenizer::from_json(base);
  CHECK_THROWS_WITH(tok.set_special_tokens("<nope>"), Catch::Contains("'<nope>' is not in the vocabulary"));
}
