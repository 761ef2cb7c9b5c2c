// The rollout engine's fuzz input (tests/fuzz/engine_request_input.hpp: engine options, requests,
// pauses and resumes read from bytes, every invariant of fuzz_engine_request.cpp) as a bounded
// property in CI: the seed corpus tests/fuzz/corpus/engine_request/ and 2 000 mutations of it
// (tests/fuzz/support/mutator.hpp, seed 1; UNIRL_FUZZ_ENGINE_INPUTS to change the count). The
// long run, under ASan + UBSan: bash scripts/fuzz.sh engine_request 600 (docs/reliability.md).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "../../fuzz/engine_request_input.hpp"
#include "../../fuzz/support/mutator.hpp"

TEST_CASE("engine fuzz: mutated option and request programs are refused or run to the end, invariants kept",
          "[rollout][cpu][fuzz]") {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(fs::path(UNIRL_SOURCE_DIR) / "tests/fuzz/corpus/engine_request"))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() >= 4);
  std::vector<std::string> corpus;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    corpus.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::int64_t inputs = 2000;
  if (const char* n = std::getenv("UNIRL_FUZZ_ENGINE_INPUTS")) inputs = std::stoll(n);
  unirl_fuzz::mutator mutate(corpus, {}, /*seed=*/1, /*max_len=*/4096);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < inputs; ++i) {
    const std::string& x = mutate.next();
    try {
      unirl_fuzz::engine_request::one_input(reinterpret_cast<const std::uint8_t*>(x.data()), x.size());
    } catch (const std::exception& e) {  // a broken invariant, or an error from an accepted request's step
      std::ostringstream hex;
      for (const unsigned char c : x) hex << "\\x" << "0123456789abcdef"[c >> 4] << "0123456789abcdef"[c & 15];
      FAIL("input " << i << " (" << x.size() << " bytes: \"" << hex.str() << "\"): " << e.what());
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WARN(inputs << " engine fuzz inputs in " << secs << " s");
}
