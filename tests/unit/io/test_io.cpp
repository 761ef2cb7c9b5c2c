// unirl::io — safetensors reading and writing, checked against files written by the official
// library (tests/fixtures/safetensors/, made by make_fixtures.py) and their expected values.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/io/safetensors.hpp>

namespace fs = std::filesystem;
namespace io = unirl::io;
using json = nlohmann::json;
using torch::indexing::Slice;

namespace {

const fs::path fixtures = fs::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "safetensors";

json expected() {
  std::ifstream in(fixtures / "expected.json");
  REQUIRE(in);
  return json::parse(in);
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// A fresh directory under the system temp dir, removed at scope exit.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("unirl_io_" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// Each element's bytes, as the hex of its little-endian value (the form of expected.json).
std::vector<std::string> hex_bits(const torch::Tensor& t) {
  const auto c = t.contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  const auto size = static_cast<std::size_t>(c.element_size());
  static constexpr char hex[] = "0123456789abcdef";
  std::vector<std::string> out;
  for (std::int64_t i = 0; i < c.numel(); ++i) {
    std::string s;
    for (std::size_t b = size; b-- > 0;) {  // little-endian host: most significant byte last in memory
      const auto v = p[static_cast<std::size_t>(i) * size + b];
      s += hex[v >> 4];
      s += hex[v & 15];
    }
    out.push_back(s);
  }
  return out;
}

std::vector<std::string> strings(const json& j) { return j.get<std::vector<std::string>>(); }

std::string dtype_of(const torch::Tensor& t) {
  static const std::map<torch::ScalarType, std::string> names{
      {torch::kFloat64, "F64"}, {torch::kFloat32, "F32"}, {torch::kFloat16, "F16"}, {torch::kBFloat16, "BF16"},
      {torch::kInt64, "I64"},   {torch::kInt32, "I32"},   {torch::kInt16, "I16"},   {torch::kInt8, "I8"},
      {torch::kUInt8, "U8"},    {torch::kBool, "BOOL"}};
  return names.at(t.scalar_type());
}

void check_against(const torch::Tensor& t, const json& e, const std::string& name) {
  INFO("tensor " << name);
  CHECK(t.device().is_cpu());
  CHECK(dtype_of(t) == e["dtype"].get<std::string>());
  CHECK(t.sizes().vec() == e["shape"].get<std::vector<std::int64_t>>());
  CHECK(hex_bits(t) == strings(e["bits"]));
}

/// A file of the 8-byte length + `header` (as is, no padding) + `data`; `n` overrides the length.
std::string st_bytes(const std::string& header, const std::string& data = "", std::int64_t n = -1) {
  const auto len = n < 0 ? static_cast<std::uint64_t>(header.size()) : static_cast<std::uint64_t>(n);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((len >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string message_of_format_error(const fs::path& file) {
  try {
    io::safetensors_file f(file);
  } catch (const io::format_error& e) {
    return e.what();
  }
  return "<no format_error>";
}

#if defined(__linux__)
/// Whether [p, p + n) lies inside a mapping of `file` according to the kernel (/proc/self/maps).
bool in_mapping_of(const void* p, std::size_t n, const fs::path& file) {
  const auto target = fs::canonical(file).string();
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  while (std::getline(maps, line)) {
    std::istringstream is(line);
    std::string range, perms, offset, dev, inode, path;
    is >> range >> perms >> offset >> dev >> inode;
    std::getline(is >> std::ws, path);
    if (path != target) continue;
    const auto dash = range.find('-');
    const auto lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const auto hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (a >= lo && a + n <= hi) return true;
  }
  return false;
}

/// Whether any mapping of `file` exists in this process.
bool mapped(const fs::path& file) {
  const auto target = fs::canonical(file).string();
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.size() >= target.size() && line.compare(line.size() - target.size(), target.size(), target) == 0) return true;
  return false;
}
#endif

}  // namespace

TEST_CASE("safetensors: a file of the official writer reads back bit-exactly", "[io][cpu]") {
  const auto exp = expected()["single"];
  const auto path = fixtures / "single.safetensors";
  const io::safetensors_file f(path);
  CHECK(f.path() == path);
  CHECK(f.names() == strings(exp["order"]));  // file order = ascending data offsets
  CHECK(f.metadata() == exp["metadata"].get<std::map<std::string, std::string>>());
  REQUIRE(f.size() == exp["tensors"].size());
  for (const auto& [name, e] : exp["tensors"].items()) {
    REQUIRE(f.contains(name));
    CHECK(std::string(io::st_dtype_name(f.info(name).dtype)) == e["dtype"].get<std::string>());
    CHECK(f.info(name).shape == e["shape"].get<std::vector<std::int64_t>>());
    check_against(f.tensor(name), e, name);
  }
  CHECK(f.tensor("f32.scalar").dim() == 0);
  CHECK(f.tensor("f32.empty").sizes().vec() == std::vector<std::int64_t>{0, 3});
  CHECK_FALSE(f.contains("f32.matri"));

  // The same through a checkpoint and load_safetensors.
  const io::safetensors_checkpoint ckpt(path);
  CHECK(ckpt.names() == strings(exp["order"]));
  CHECK(ckpt.file_of("f16.t3") == path.string());
  const auto all = io::load_safetensors(path);
  REQUIRE(all.size() == exp["tensors"].size());
  for (const auto& [name, e] : exp["tensors"].items()) check_against(all.at(name), e, name);

  // A missing tensor names the file and the tensor.
  try {
    (void)f.info("no.such.tensor");
    FAIL("no error");
  } catch (const io::format_error& e) {
    CHECK_THAT(e.what(), Catch::Contains(path.string()) && Catch::Contains("'no.such.tensor'"));
  }
  CHECK_THROWS_AS(ckpt.tensor("no.such.tensor"), io::format_error);
}

TEST_CASE("safetensors: a sharded checkpoint in the Hugging Face layout reads back bit-exactly", "[io][cpu]") {
  const auto exp = expected()["sharded"];
  const auto dir = fixtures / "sharded";
  for (const auto& where : {dir, dir / "model.safetensors.index.json"}) {
    const io::safetensors_checkpoint ckpt(where);
    CHECK(ckpt.source() == dir / "model.safetensors.index.json");
    REQUIRE(ckpt.names().size() == exp["tensors"].size());
    REQUIRE(ckpt.files().size() == 2);
    // Shard by shard, each in file order: the first shard's two tensors come first.
    CHECK(exp["tensors"][ckpt.names()[0]]["file"] == "model-00001-of-00002.safetensors");
    CHECK(exp["tensors"][ckpt.names()[1]]["file"] == "model-00001-of-00002.safetensors");
    for (const auto& [name, e] : exp["tensors"].items()) {
      REQUIRE(ckpt.contains(name));
      CHECK(fs::path(ckpt.file_of(name)).filename() == e["file"].get<std::string>());
      check_against(ckpt.tensor(name), e, name);
    }
  }
  const auto all = io::load_safetensors(dir);
  CHECK(all.size() == exp["tensors"].size());
}

TEST_CASE("safetensors: aligned tensors are views of the mapping, kept alive, private", "[io][cpu]") {
  temp_dir tmp;
  const auto path = tmp.path / "copy.safetensors";
  fs::copy_file(fixtures / "single.safetensors", path);
  const auto original = read_bytes(path);
  const auto exp = expected()["single"]["tensors"];

  torch::Tensor w;
  {
    const io::safetensors_file f(path);
    w = f.tensor("f32.matrix");
    const auto* p = static_cast<const unsigned char*>(w.data_ptr());
    // No copy: the tensor's bytes are the file's bytes, inside the mapping at the header's offset.
    CHECK(p == f.mapped_data() + f.header().data_offset + f.info("f32.matrix").begin);
#if defined(__linux__)
    CHECK(in_mapping_of(w.data_ptr(), static_cast<std::size_t>(w.nbytes()), path));
#endif
    for (const auto& name : f.names()) {  // every tensor of an official file is aligned, so none is copied
      const auto t = f.tensor(name);
      if (t.numel() > 0) CHECK(static_cast<const unsigned char*>(t.data_ptr()) >= f.mapped_data());
      if (t.numel() > 0) CHECK(static_cast<const unsigned char*>(t.data_ptr()) < f.mapped_data() + f.mapped_size());
    }
  }
  // The file object is gone; the tensor keeps the mapping alive.
#if defined(__linux__)
  CHECK(in_mapping_of(w.data_ptr(), static_cast<std::size_t>(w.nbytes()), path));
#endif
  CHECK(hex_bits(w) == strings(exp["f32.matrix"]["bits"]));
  // Writing into the view is private to the process: the file keeps its bytes.
  w.fill_(7.0f);
  CHECK(read_bytes(path) == original);
  CHECK(hex_bits(io::safetensors_file(path).tensor("f32.matrix")) == strings(exp["f32.matrix"]["bits"]));
  w.reset();
#if defined(__linux__)
  CHECK_FALSE(mapped(path));  // the last tensor released, the mapping goes
#endif

  // Saving over a file that is mapped leaves the mapped tensors intact (rename, not overwrite).
  const io::safetensors_file f(path);
  const auto before = f.tensor("i64.vec");
  io::save_safetensors(path, {{"x", torch::ones({2})}});
  CHECK(hex_bits(before) == strings(exp["i64.vec"]["bits"]));
  CHECK(io::safetensors_file(path).names() == std::vector<std::string>{"x"});
}

TEST_CASE("safetensors: a misaligned tensor is copied once, with the right values", "[io][cpu]") {
  temp_dir tmp;
  // Header of 61 bytes: the data region starts at 69, so the F32 tensor is misaligned.
  std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  const float v[2] = {1.5f, -2.25f};
  std::string data(1, '\x05');
  data.append(reinterpret_cast<const char*>(v), sizeof v);
  const auto path = tmp.path / "misaligned.safetensors";
  write_bytes(path, st_bytes(header, data));
  const io::safetensors_file f(path);
  const auto w = f.tensor("w");
  const auto* p = static_cast<const unsigned char*>(w.data_ptr());
  CHECK((p < f.mapped_data() || p >= f.mapped_data() + f.mapped_size()));  // a copy
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 4 == 0);
  CHECK(w[0].item<float>() == 1.5f);
  CHECK(w[1].item<float>() == -2.25f);
  CHECK(f.tensor("a").item<std::uint8_t>() == 5);
}

TEST_CASE("safetensors: the writer lays files out exactly as the official writer", "[io][cpu]") {
  // Re-save what the official library wrote, with its metadata: same header (as JSON; the
  // official metadata map has no fixed key order), same header length, same data bytes.
  temp_dir tmp;
  const auto src = fixtures / "single.safetensors";
  const io::safetensors_file official(src);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  auto names = official.names();
  std::reverse(names.begin(), names.end());  // the input order must not matter
  for (const auto& n : names) tensors.emplace_back(n, official.tensor(n));
  const auto out = tmp.path / "unirl.safetensors";
  io::save_safetensors(out, tensors, official.metadata());

  const auto a = read_bytes(src), b = read_bytes(out);
  REQUIRE(a.size() == b.size());
  CHECK(a.substr(0, 8) == b.substr(0, 8));  // header length, padding included
  const auto n = official.header().data_offset;
  CHECK(json::parse(a.substr(8, n - 8)) == json::parse(b.substr(8, n - 8)));
  CHECK(b.substr(8, n - 8).find_first_not_of(' ', b.substr(8, n - 8).rfind('}') + 1) == std::string::npos);
  CHECK(a.substr(n) == b.substr(n));
  CHECK(n % 8 == 0);
}

TEST_CASE("safetensors: write and read back every dtype, non-contiguous inputs included", "[io][cpu]") {
  temp_dir tmp;
  torch::manual_seed(3);
  const auto f32 = torch::randn({4, 5});
  std::vector<std::pair<std::string, torch::Tensor>> tensors{
      {"f64", torch::randn({3, 2}, torch::kFloat64)},
      {"f32", f32},
      {"f16", torch::randn({7}).to(torch::kFloat16)},
      {"bf16", torch::randn({2, 3, 4}).to(torch::kBFloat16)},
      {"i64", torch::randint(-1000000, 1000000, {5}, torch::kInt64) * 1000003},
      {"i32", torch::randint(-100000, 100000, {2, 2}, torch::kInt32)},
      {"i16", torch::randint(-30000, 30000, {3}, torch::kInt16)},
      {"i8", torch::randint(-128, 127, {6}, torch::kInt8)},
      {"u8", torch::randint(0, 255, {6}, torch::kUInt8)},
      {"bool", torch::rand({3, 3}) > 0.5},
      {"scalar", torch::tensor(2.5, torch::kFloat64)},
      {"empty", torch::zeros({2, 0, 3}, torch::kInt32)},
      {"transposed", f32.t()},                                               // strides (1, 5)
      {"strided", f32.index({Slice(), Slice(0, torch::indexing::None, 2)})},  // every other column
      {"expanded", torch::arange(3, torch::kInt16).expand({4, 3})},           // stride 0
      {"neg_view", torch::_neg_view(f32.narrow(0, 1, 2))},                    // lazily negated
      {"métadonnée.ü", torch::ones({1})},
  };
  const auto path = tmp.path / "sub" / "all.safetensors";  // parent directories are created
  io::save_safetensors(path, tensors, {{"step", "12"}, {"note", "line\nbreak \"quoted\" \\ é"}});
  REQUIRE(fs::exists(path));
  for (const auto& e : fs::directory_iterator(path.parent_path()))  // no temporary left behind
    CHECK(e.path().filename() == "all.safetensors");

  const io::safetensors_file f(path);
  CHECK(f.metadata() == std::map<std::string, std::string>{
                            {"format", "pt"}, {"step", "12"}, {"note", "line\nbreak \"quoted\" \\ é"}});
  CHECK(f.header().data_offset % 8 == 0);
  REQUIRE(f.size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    INFO(name);
    const auto r = f.tensor(name);
    CHECK(r.scalar_type() == t.scalar_type());
    CHECK(r.sizes() == t.sizes());
    CHECK(hex_bits(r) == hex_bits(t.resolve_neg()));
  }
  CHECK(torch::equal(f.tensor("neg_view"), -f32.narrow(0, 1, 2)));
  // Layout: descending alignment (8-byte types first), then name.
  const auto order = f.names();
  CHECK(order.front() == "i64");  // I64 ranks above F64 in the official dtype order
  CHECK(order.back() == "bool");
  const auto pos = [&](const std::string& n) { return std::find(order.begin(), order.end(), n) - order.begin(); };
  CHECK(pos("i64") < pos("f64"));
  CHECK(pos("f64") < pos("f32"));
  CHECK(pos("f32") < pos("bf16"));
  CHECK(pos("bf16") < pos("f16"));
  CHECK(pos("f16") < pos("i16"));
  CHECK(pos("i8") < pos("u8"));

  // A "format" the caller gives is kept.
  io::save_safetensors(path, {{"x", torch::zeros({1})}}, {{"format", "mlx"}});
  CHECK(io::safetensors_file(path).metadata().at("format") == "mlx");
}

TEST_CASE("safetensors: the writer refuses what it cannot write, and leaves the file alone", "[io][cpu]") {
  temp_dir tmp;
  const auto path = tmp.path / "w.safetensors";
  io::save_safetensors(path, {{"keep", torch::ones({2})}});
  const auto before = read_bytes(path);
  auto expect_error = [&](const std::vector<std::pair<std::string, torch::Tensor>>& ts,
                          const std::map<std::string, std::string>& md, const std::string& what) {
    try {
      io::save_safetensors(path, ts, md);
      FAIL("no error for " << what);
    } catch (const unirl::error& e) {
      CHECK_THAT(e.what(), Catch::Contains(what));
    }
    CHECK(read_bytes(path) == before);
  };
  expect_error({{"a", torch::ones({1})}, {"a", torch::ones({1})}}, {}, "'a' appears twice");
  expect_error({{"__metadata__", torch::ones({1})}}, {}, "'__metadata__' is reserved");
  expect_error({{"c", torch::ones({2}, torch::kComplexFloat)}}, {}, "tensor 'c' has dtype ComplexFloat");
  expect_error({{"u", torch::Tensor()}}, {}, "tensor 'u' is undefined");
  expect_error({{std::string("bad\xff"), torch::ones({1})}}, {}, "is not valid UTF-8");
  expect_error({{"ok", torch::ones({1})}}, {{"k", std::string("\xc3")}}, "is not valid UTF-8");
  expect_error({{"s", torch::ones({2, 2}).to_sparse()}}, {}, "tensor 's' is not dense");
  CHECK_THROWS_AS(io::save_safetensors_sharded(tmp.path / "d", {{"a", torch::ones({1})}}, 0), unirl::error);
}

TEST_CASE("safetensors: sharded save and load (Hugging Face layout)", "[io][cpu]") {
  temp_dir tmp;
  torch::manual_seed(5);
  // 400 + 400 + 200 + 16 + 1200 + 8 bytes in shards of at most 1000, in the given order: a + b + c
  // = 1000 fits; d starts shard 2; big (1200, above the limit) gets shard 3 alone; e goes to shard 4.
  const std::vector<std::pair<std::string, torch::Tensor>> tensors{
      {"a", torch::randn({100})},
      {"b", torch::randn({10, 10})},
      {"c", torch::randn({100}).to(torch::kBFloat16)},
      {"d", torch::arange(2, torch::kInt64)},
      {"big", torch::randn({300})},
      {"e", torch::randn({2}).t()},
  };
  const auto dir = tmp.path / "ckpt";
  fs::create_directories(dir);
  write_bytes(dir / "model.safetensors", "stale");                         // a stale single file must go
  write_bytes(dir / "model-00009-of-00009.safetensors", "stale");          // and a stale shard
  write_bytes(dir / "config.json", "{}");                                  // anything else stays
  io::save_safetensors_sharded(dir, tensors, 1000, {{"producer", "unirl"}});
  CHECK_FALSE(fs::exists(dir / "model.safetensors"));
  CHECK_FALSE(fs::exists(dir / "model-00009-of-00009.safetensors"));
  CHECK(fs::exists(dir / "config.json"));

  std::ifstream in(dir / "model.safetensors.index.json");
  const auto index = json::parse(in);
  CHECK(index["metadata"]["total_size"] == 400 + 400 + 200 + 16 + 1200 + 8);
  const std::map<std::string, std::string> want{
      {"a", "model-00001-of-00004.safetensors"}, {"b", "model-00001-of-00004.safetensors"},
      {"c", "model-00001-of-00004.safetensors"}, {"d", "model-00002-of-00004.safetensors"},
      {"big", "model-00003-of-00004.safetensors"}, {"e", "model-00004-of-00004.safetensors"}};
  CHECK(index["weight_map"].get<std::map<std::string, std::string>>() == want);
  for (int i = 1; i <= 4; ++i) {
    const auto shard = dir / ("model-0000" + std::to_string(i) + "-of-00004.safetensors");
    REQUIRE(fs::exists(shard));
    const io::safetensors_file f(shard);
    CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"producer", "unirl"}});
  }

  const io::safetensors_checkpoint ckpt(dir);
  CHECK(ckpt.names().size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    INFO(name);
    CHECK(fs::path(ckpt.file_of(name)).filename() == want.at(name));
    CHECK(hex_bits(ckpt.tensor(name)) == hex_bits(t));
  }

  // Everything fits: one model.safetensors, and the shards and the index of before are gone.
  io::save_safetensors_sharded(dir, tensors, 1 << 20);
  CHECK(fs::exists(dir / "model.safetensors"));
  CHECK_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  for (const auto& e : fs::directory_iterator(dir))
    CHECK((e.path().filename() == "model.safetensors" || e.path().filename() == "config.json"));
  const auto all = io::load_safetensors(dir);
  CHECK(all.size() == tensors.size());
  CHECK(hex_bits(all.at("big")) == hex_bits(tensors[4].second));
}

TEST_CASE("safetensors: every lying header is a format_error naming the file and the problem", "[io][cpu]") {
  temp_dir tmp;
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\0');
  struct lie {
    std::string name, bytes, problem;
  };
  const std::vector<lie> lies{
      {"tiny", std::string("\x01\x02\x03", 3), "too short for the 8-byte header length"},
      {"empty_file", "", "the file is 0 bytes"},
      {"past_eof", st_bytes("{" + ok_entry + "}", eight, 5000), "runs past the end of the file"},
      {"absurd", st_bytes("{}", "", 200'000'000), "exceeds the limit of 100000000 bytes"},
      {"huge", st_bytes("{}", "", std::int64_t{1} << 62), "exceeds the limit"},
      {"not_json", st_bytes("{\"a\": nope}"), "not valid JSON"},
      {"truncated_json", st_bytes("{\"a\":{\"dtype\":"), "not valid JSON"},
      {"trailing_garbage", st_bytes("{}x"), "not valid JSON"},
      {"nul_padding", st_bytes(std::string("{}\0\0", 4)), "not valid JSON"},
      {"not_utf8", st_bytes("{\"a\xff\":{}}"), "not valid UTF-8 (byte 3"},
      {"overlong_utf8", st_bytes("{\"\xc0\xaf\":1}"), "not valid UTF-8"},
      {"surrogate_utf8", st_bytes("{\"\xed\xa0\x80\":1}"), "not valid UTF-8"},
      {"array", st_bytes("[1,2]"), "header is an array, not a JSON object"},
      {"string", st_bytes("\"hello\""), "header is a string, not a JSON object"},
      {"duplicate_tensor", st_bytes("{" + ok_entry + "," + ok_entry + "}", eight), "the tensor name 'a' appears twice"},
      {"duplicate_member",
       st_bytes(R"({"a":{"dtype":"U8","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight),
       "tensor 'a' has the member 'dtype' twice"},
      {"duplicate_metadata_key", st_bytes(R"({"__metadata__":{"k":"1","k":"2"}})"), "__metadata__ has the key 'k' twice"},
      {"duplicate_metadata", st_bytes(R"({"__metadata__":{},"__metadata__":{}})"), "'__metadata__' appears twice"},
      {"unknown_dtype", st_bytes(R"({"a":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", eight),
       "tensor 'a' has the unknown dtype 'F128'"},
      {"dtype_not_string", st_bytes(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", eight),
       "member \"dtype\" is a number"},
      {"negative_dim", st_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       "tensor 'a' shape has the negative dimension -2"},
      {"float_dim", st_bytes(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", eight),
       "tensor 'a' shape holds '2.0'"},
      {"dim_above_int64", st_bytes(R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,8]}})", eight),
       "has the dimension 9223372036854775808"},
      {"size_overflow",
       st_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", eight),
       "shape [4294967296, 4294967296] whose size overflows"},
      {"stride_overflow", st_bytes(R"({"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})"),
       "whose size overflows"},
      {"size_disagrees", st_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       "tensor 'a' of dtype F32 and shape [3] needs 12 bytes but data_offsets [0, 8] span 8"},
      {"out_of_range", st_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight),
       "data_offsets [0, 16] past the end of the data region (8 bytes)"},
      {"offset_2_64", st_bytes(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})"),
       "past the end of the data region"},
      {"end_before_begin", st_bytes(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", eight), "end before begin"},
      {"overlap",
       st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                eight),
       "tensor 'b' data_offsets [4, 8] overlap tensor 'a' [0, 8]"},
      {"hole",
       st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})",
                eight),
       "bytes [4, 6) of the data region belong to no tensor"},
      {"hole_at_start", st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
       "bytes [0, 4) of the data region belong to no tensor"},
      {"trailing_bytes", st_bytes("{" + ok_entry + "}", eight + "xy"), "bytes [8, 10) at the end of the data region"},
      {"data_but_no_tensor", st_bytes("{}", "abc"), "bytes [0, 3) at the end"},
      {"metadata_number", st_bytes(R"({"__metadata__":{"k":1}})"), "__metadata__ value of 'k' is a number: expected a string"},
      {"metadata_nested", st_bytes(R"({"__metadata__":{"k":{"x":"y"}}})"), "__metadata__ value of 'k' is an object"},
      {"metadata_array", st_bytes(R"({"__metadata__":["a"]})"), "__metadata__ is an array: expected an object of string to string"},
      {"metadata_string", st_bytes(R"({"__metadata__":"a"})"), "__metadata__ is a string"},
      {"entry_not_object", st_bytes(R"({"a":[1,2]})"), "the entry of tensor 'a' is an array"},
      {"missing_offsets", st_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", eight), "tensor 'a' has no \"data_offsets\""},
      {"missing_dtype", st_bytes(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", eight), "tensor 'a' has no \"dtype\""},
      {"three_offsets", st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", eight),
       "has more than 2 values"},
      {"one_offset", st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", eight), "has 1 data_offsets"},
      {"negative_offset", st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", eight),
       "has the negative offset -8"},
      {"shape_nested", st_bytes(R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", eight),
       "tensor 'a' shape holds an array"},
      {"control_chars_quoted", st_bytes("{\"a\\u0001\":{\"dtype\":\"X\",\"shape\":[],\"data_offsets\":[0,0]}}"),
       "tensor 'a\\x01' has the unknown dtype 'X'"},
  };
  for (const auto& l : lies) {
    INFO(l.name);
    const auto path = tmp.path / (l.name + ".safetensors");
    write_bytes(path, l.bytes);
    const auto msg = message_of_format_error(path);
    CHECK_THAT(msg, Catch::Contains(path.string()) && Catch::Contains(l.problem));
    // The torch-free parser says the same from bytes.
    try {
      io::parse_safetensors_header(reinterpret_cast<const unsigned char*>(l.bytes.data()), l.bytes.size(),
                                   l.bytes.size(), "src");
      FAIL("parsed");
    } catch (const io::format_error& e) {
      CHECK_THAT(e.what(), Catch::Contains("'src'") && Catch::Contains(l.problem));
    }
  }

  // Accepted as the official reader does: leading whitespace, null metadata, unknown members
  // (ignored), a zero-size tensor at the same offset as another.
  const auto fine = tmp.path / "fine.safetensors";
  write_bytes(fine, st_bytes(R"(  {"__metadata__":null,"z":{"dtype":"F32","shape":[0,2],"data_offsets":[0,0],"extra":{"x":[1,{}]}},)"
                             R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}   )",
                             eight));
  const io::safetensors_file f(fine);
  CHECK(f.names() == std::vector<std::string>{"z", "a"});
  CHECK(f.metadata().empty());

  // Only part of the header available: an error, never a read past `available`.
  const auto bytes = read_bytes(fixtures / "single.safetensors");
  CHECK_THROWS_WITH(io::parse_safetensors_header(reinterpret_cast<const unsigned char*>(bytes.data()), 20,
                                                 bytes.size(), "part"),
                    Catch::Contains("only 20 bytes given"));
  // ... and the header alone is enough.
  const auto header_size = io::safetensors_file(fixtures / "single.safetensors").header().data_offset;
  const auto h = io::parse_safetensors_header(reinterpret_cast<const unsigned char*>(bytes.data()),
                                              static_cast<std::size_t>(header_size), bytes.size(), "x");
  CHECK(h.entries.size() == 15);

  // Bad values and types LibTorch lacks are reported at tensor(), naming file and tensor.
  const auto bools = tmp.path / "bool.safetensors";
  write_bytes(bools, st_bytes(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", std::string("\x01\x00\x02", 3)));
  CHECK_THROWS_WITH(io::safetensors_file(bools).tensor("m"),
                    Catch::Contains(bools.string()) && Catch::Contains("tensor 'm' (BOOL) holds the byte 2 at element 2"));
  const auto u16 = tmp.path / "u16.safetensors";
  write_bytes(u16, st_bytes(R"({"u":{"dtype":"U16","shape":[2],"data_offsets":[0,4]}})", "abcd"));
  const io::safetensors_file fu(u16);
  CHECK(fu.info("u").dtype == io::st_dtype::U16);
  CHECK_THROWS_WITH(fu.tensor("u"), Catch::Contains(u16.string()) && Catch::Contains("tensor 'u' has dtype U16"));

  // Not a file.
  CHECK_THROWS_WITH(io::safetensors_file(tmp.path / "absent.safetensors"), Catch::Contains("cannot open"));
  CHECK_THROWS_WITH(io::safetensors_file(tmp.path), Catch::Contains("not a regular file"));
}

TEST_CASE("safetensors: a lying index or shard is a format_error naming it", "[io][cpu]") {
  temp_dir tmp;
  const auto src = fixtures / "sharded";
  auto make = [&](const std::string& name, const std::string& index_text) {
    const auto d = tmp.path / name;
    fs::create_directories(d);
    for (const auto& e : fs::directory_iterator(src))
      if (e.path().extension() == ".safetensors") fs::copy_file(e.path(), d / e.path().filename());
    write_bytes(d / "model.safetensors.index.json", index_text);
    return d;
  };
  const auto good = read_bytes(src / "model.safetensors.index.json");
  auto with_map = [&](const std::function<void(json&)>& edit) {
    auto j = json::parse(good);
    edit(j);
    return j.dump(2);
  };
  struct lie {
    std::string name, index, problem;
  };
  const std::vector<lie> lies{
      {"not_json", "{", "not valid JSON"},
      {"not_object", "[]", "not a JSON object (it is array)"},
      {"no_weight_map", R"({"metadata":{}})", "no \"weight_map\" object"},
      {"weight_map_number", with_map([](json& j) { j["weight_map"]["lm_head.weight"] = 3; }),
       "weight_map['lm_head.weight'] is number"},
      {"escape", with_map([](json& j) { j["weight_map"]["lm_head.weight"] = "../model-00002-of-00002.safetensors"; }),
       "expected a relative file name inside the index's directory"},
      {"absolute", with_map([](json& j) { j["weight_map"]["lm_head.weight"] = "/etc/passwd"; }),
       "expected a relative file name"},
      {"absent_shard", with_map([](json& j) { j["weight_map"]["lm_head.weight"] = "model-00003-of-00003.safetensors"; }),
       "shard 'model-00003-of-00003.safetensors' (of tensor 'lm_head.weight') is not a file"},
      {"not_in_shard", with_map([](json& j) { j["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"; }),
       "no tensor 'ghost', which the index"},
      {"unlisted", with_map([](json& j) { j["weight_map"].erase("model.norm.weight"); }),
       "holds tensor 'model.norm.weight', which the index"},
      {"misplaced", with_map([](json& j) { j["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"; }),
       "no tensor 'model.norm.weight', which the index"},
      {"duplicate", R"({"weight_map":{"a":"x.safetensors","a":"y.safetensors"}})", "the key 'a' appears twice"},
      {"not_utf8", "{\"weight_map\":{\"\xfe\":\"x\"}}", "not valid UTF-8"},
  };
  for (const auto& l : lies) {
    INFO(l.name);
    const auto d = make(l.name, l.index);
    try {
      io::safetensors_checkpoint c(d);
      FAIL("no error");
    } catch (const io::format_error& e) {
      CHECK_THAT(e.what(), Catch::Contains((d / "model.safetensors.index.json").string()) && Catch::Contains(l.problem));
    }
  }
  // A directory with neither layout.
  CHECK_THROWS_WITH(io::safetensors_checkpoint(tmp.path),
                    Catch::Contains(tmp.path.string()) && Catch::Contains("neither model.safetensors nor"));
}

TEST_CASE("safetensors: load_into converts dtypes and names every mismatch", "[io][cpu]") {
  const auto exp = expected();
  const auto single = fixtures / "single.safetensors";
  const io::safetensors_checkpoint ckpt(single);

  SECTION("bf16 file -> f32 parameter, f16 -> f32, i64 -> i64; the rest ignored by substring") {
    auto bf = torch::zeros({4, 3}, torch::requires_grad());  // a leaf that requires grad: loads under NoGradGuard
    auto half = torch::zeros({2, 3, 2}, torch::kFloat64);
    auto ints = torch::zeros({4}, torch::kInt64);
    const auto report = io::load_into({{"bf16.matrix", bf}, {"f16.t3", half}, {"i64.vec", ints}}, ckpt,
                                      {.ignore_unexpected = {"f32.", "f64.", "i64.scalar", "i32.", "i16.", "i8.", "u8.",
                                                             "bool.", "unicode."}});
    CHECK(report.loaded == std::vector<std::string>{"bf16.matrix", "f16.t3", "i64.vec"});
    CHECK(report.missing.empty());
    CHECK(report.unexpected.size() == 12);
    CHECK(bf.requires_grad());
    // bf16 -> f32 is exact: the f32 bits are the bf16 bits followed by 16 zero bits.
    std::vector<std::string> want;
    for (const auto& b : strings(exp["single"]["tensors"]["bf16.matrix"]["bits"])) want.push_back(b + "0000");
    CHECK(hex_bits(bf.detach()) == want);
    CHECK(torch::equal(half, io::safetensors_file(single).tensor("f16.t3").to(torch::kFloat64)));
    CHECK(hex_bits(ints) == strings(exp["single"]["tensors"]["i64.vec"]["bits"]));
  }

  SECTION("a module's parameters from a sharded checkpoint") {
    const io::safetensors_checkpoint sharded(fixtures / "sharded");
    std::vector<std::pair<std::string, torch::Tensor>> targets;
    for (const auto& name : sharded.names()) {
      const auto& e = sharded.info(name);
      targets.emplace_back(name, torch::full(e.shape, 9, io::st_dtype_is_floating(e.dtype) ? torch::kFloat32 : torch::kInt64));
    }
    const auto report = io::load_into(targets, sharded);
    CHECK(report.loaded.size() == targets.size());
    for (const auto& [name, t] : targets)
      CHECK(torch::equal(t, sharded.tensor(name).to(t.scalar_type())));
  }

  SECTION("errors name the file, the tensor and what was expected; nothing is copied") {
    auto keep = torch::zeros({4, 3});
    auto expect = [&](const std::vector<std::pair<std::string, torch::Tensor>>& targets, const io::load_options& opt,
                      const std::vector<std::string>& parts) {
      try {
        io::load_into(targets, ckpt, opt);
        FAIL("no error");
      } catch (const io::format_error& e) {
        for (const auto& p : parts) CHECK_THAT(e.what(), Catch::Contains(p));
      }
      CHECK(torch::count_nonzero(keep).item<std::int64_t>() == 0);
    };
    const io::load_options all_ignored{.ignore_unexpected = {""}};
    expect({{"bf16.matrix", keep}, {"nope", torch::zeros({2})}}, all_ignored,
           {single.string(), "tensor 'nope': missing from", "shape [2]"});
    expect({{"bf16.matrix", keep}},
           {.ignore_unexpected = {"f32.", "f64.", "f16.", "i64.", "i32.", "i16.", "i8.", "u8.", "bool."}},
           {"tensor 'unicode.名前' in '" + single.string() + "': no target wants it", "1 problem"});
    expect({{"bf16.matrix", keep}, {"f32.matrix", torch::zeros({4, 3})}}, all_ignored,
           {"tensor 'f32.matrix' in '" + single.string() + "'", "shape [3, 4] in the checkpoint", "target has [4, 3]"});
    expect({{"bf16.matrix", keep}, {"i64.vec", torch::zeros({4})}}, all_ignored,
           {"tensor 'i64.vec' in '" + single.string() + "'", "dtype I64 in the checkpoint", "target is Float",
            "expected a floating-point dtype"});
    expect({{"bf16.matrix", keep}, {"u8.vec", torch::zeros({5})}, {"f64.vec", torch::zeros({5}, torch::kInt64)}},
           all_ignored, {"2 problems", "tensor 'u8.vec'", "tensor 'f64.vec'", "target is Long: expected a non-floating-point dtype"});
    CHECK_THROWS_WITH(io::load_into({{"a", keep}, {"a", keep}}, ckpt), Catch::Contains("'a' appears twice"));
  }

  SECTION("allow_missing") {
    auto t = torch::zeros({5}, torch::kUInt8);
    const auto report = io::load_into({{"u8.vec", t}, {"absent", torch::zeros({1})}}, ckpt,
                                      {.allow_missing = true, .ignore_unexpected = {""}});
    CHECK(report.loaded == std::vector<std::string>{"u8.vec"});
    CHECK(report.missing == std::vector<std::string>{"absent"});
    CHECK(t[4].item<int>() == 255);
  }
}

TEST_CASE("safetensors: files for the official reader (check_unirl_written.py)", "[io][cpu][export]") {
  // Writes what tests/fixtures/safetensors/check_unirl_written.py loads with the official library:
  // to $UNIRL_ST_EXPORT_DIR when set (see tests/unit/io/CMakeLists.txt), else to a temp dir.
  temp_dir tmp;
  const char* env = std::getenv("UNIRL_ST_EXPORT_DIR");
  const fs::path out = env != nullptr && *env != '\0' ? fs::path(env) : tmp.path;
  fs::create_directories(out);
  const io::safetensors_file single(fixtures / "single.safetensors");
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& n : single.names()) tensors.emplace_back(n, single.tensor(n));
  const auto m = single.tensor("f32.matrix");
  tensors.emplace_back("f32.matrix.t", m.t());                                                    // non-contiguous
  tensors.emplace_back("i64.vec.strided", single.tensor("i64.vec").index({Slice(0, torch::indexing::None, 2)}));
  io::save_safetensors(out / "single.safetensors", tensors, single.metadata());

  const io::safetensors_checkpoint sharded(fixtures / "sharded");
  std::vector<std::pair<std::string, torch::Tensor>> st;
  for (const auto& n : sharded.names()) st.emplace_back(n, sharded.tensor(n));
  io::save_safetensors_sharded(out / "sharded", st, 100);  // several shards
  CHECK(fs::exists(out / "sharded" / "model.safetensors.index.json"));
  CHECK(io::load_safetensors(out / "sharded").size() == st.size());
  CHECK(io::load_safetensors(out / "single.safetensors").size() == tensors.size());
}

TEST_CASE("safetensors: CUDA tensors are written from the device", "[io][cuda]") {
  if (!torch::cuda::is_available()) {  // CTest excludes [cuda]; this guards a direct run on a CPU build
    WARN("no CUDA device");
    return;
  }
  temp_dir tmp;
  const auto t = torch::randn({3, 4}, torch::kCUDA).t();
  io::save_safetensors(tmp.path / "cuda.safetensors", {{"t", t}});
  CHECK(torch::equal(io::safetensors_file(tmp.path / "cuda.safetensors").tensor("t"), t.cpu()));
  auto target = torch::zeros({4, 3}, torch::kCUDA);
  io::load_into({{"t", target}}, io::safetensors_checkpoint(tmp.path / "cuda.safetensors"));
  CHECK(torch::equal(target.cpu(), t.cpu()));
}
