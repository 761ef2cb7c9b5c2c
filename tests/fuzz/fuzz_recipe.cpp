// libFuzzer target: recipes, the text a user (or a downloaded recipe) hands to the trainer.
//   bash scripts/fuzz.sh recipe 60
// The first byte picks the parser, the rest is its input:
//   0: a JSON recipe file      -> unirl::options::read_recipe(".json") -> from_json -> validate
//   1: a YAML recipe file      -> unirl::options::read_recipe(".yaml") -> from_json -> validate
//   2: `key=value` lines       -> unirl::options::apply_overrides (set + validate)
// into an options tree with every member kind options.hpp reflects (bool, integers of several
// widths and signedness, float, double, string, enum, vectors, nested options, a vector of
// nested options). Only unirl::error may leave the parsers.
// unirl-fuzz: links unirl::unirl (yaml-cpp; no LibTorch header is included)
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace fuzz {
enum class mode { fast, slow, off };
}  // namespace fuzz
template <>
inline constexpr std::array unirl::enum_names<fuzz::mode>{std::string_view{"fast"}, std::string_view{"slow"},
                                                          std::string_view{"off"}};
namespace fuzz {
struct inner_options {
  double lr = 1e-3;
  std::int64_t steps = 10;
  std::vector<std::string> stop{};
  void validate(const std::string& prefix) const {
    unirl::options::require(lr > 0 && lr < 1, prefix + "lr", lr, "in (0, 1)");
    unirl::options::require(steps >= 0, prefix + "steps", steps, ">= 0");
  }
};
}  // namespace fuzz
BOOST_HANA_ADAPT_STRUCT(fuzz::inner_options, lr, steps, stop);
namespace fuzz {
struct recipe_options {
  bool flag = false;
  int i32 = 1;
  std::int64_t i64 = 2;
  unsigned u32 = 3;
  std::uint64_t u64 = 4;
  std::uint8_t u8 = 5;
  float f32 = 0.5f;
  double f64 = 0.25;
  std::string name = "x";
  mode m = mode::fast;
  std::vector<int> ints{};
  std::vector<double> reals{};
  std::vector<mode> modes{};
  inner_options inner{};
  inner_options other{};
  std::vector<inner_options> stages{};
};
}  // namespace fuzz
BOOST_HANA_ADAPT_STRUCT(fuzz::recipe_options, flag, i32, i64, u32, u64, u8, f32, f64, name, m, ints, reals, modes,
                        inner, other, stages);

namespace {
std::string recipe_path(const char* ext) {
  static const std::string dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("unirl_fuzz_recipe_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  return dir + "/recipe" + ext;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int which = data[0] % 3;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  fuzz::recipe_options o;
  try {
    if (which == 2) {
      std::vector<std::string> args;
      std::size_t b = 0;
      for (std::size_t e; (e = text.find('\n', b)) != std::string::npos; b = e + 1) args.push_back(text.substr(b, e - b));
      args.push_back(text.substr(b));
      unirl::options::apply_overrides(o, args);
    } else {
      const auto path = recipe_path(which == 0 ? ".json" : ".yaml");
      {
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        out.write(text.data(), static_cast<std::streamsize>(text.size()));
      }
      ::unirl::options::from_json(o, unirl::options::read_recipe(path));
      unirl::options::validate(o);
    }
    // What was accepted prints and round-trips through JSON.
    (void)unirl::options::to_string(o);
    fuzz::recipe_options back;
    ::unirl::options::from_json(back, unirl::options::to_json(o));
  } catch (const unirl::error&) {
  }
  return 0;
}
