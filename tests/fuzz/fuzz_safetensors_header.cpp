// libFuzzer target: the safetensors header parser on arbitrary bytes, taken as a whole file.
// Any exception but unirl::error, any crash, leak or undefined behaviour is a finding.
//   bash scripts/fuzz.sh safetensors_header 60
#include <cstddef>
#include <cstdint>

#include <unirl/io/safetensors_header.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto h = unirl::io::parse_safetensors_header(data, size, size, "fuzz.safetensors");
    // A header that parsed must describe bytes inside the input: touch each tensor's first and last byte.
    volatile unsigned char sink = 0;
    for (const auto& e : h.entries) {
      if (e.end > e.begin) sink = sink ^ data[h.data_offset + e.begin] ^ data[h.data_offset + e.end - 1];
      (void)e.numel();
    }
  } catch (const unirl::error&) {
  }
  return 0;
}
