// libFuzzer target: the parser of a sharded checkpoint's model.safetensors.index.json.
//   bash scripts/fuzz.sh safetensors_index 60
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <unirl/io/safetensors_header.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto idx = unirl::io::parse_safetensors_index(
        std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.index.json");
    for (const auto& [name, file] : idx.weight_map) {  // what the parser accepted must stay inside the directory
      const std::string_view f = file;
      if (f.empty() || f.front() == '/' || f == ".." || f.starts_with("../") || f.ends_with("/..") ||
          f.find("/../") != std::string_view::npos)
        __builtin_trap();
    }
  } catch (const unirl::error&) {
  }
  return 0;
}
