// A small stand-in for libFuzzer's driver, for fuzz targets that cannot be built with clang's
// -fsanitize=fuzzer: those that include LibTorch < 2.1, whose headers clang rejects in C++20
// (see tests/fuzz/cmake/CMakeLists.txt). Linked with a tests/fuzz/fuzz_*.cpp target and built
// with the project's compiler and -fsanitize=address,undefined by scripts/fuzz.sh.
// No coverage feedback: each input is the seed corpus mutated at random (mutator.hpp).
// Deterministic for a given -seed.
// Accepts the libFuzzer flags fuzz.sh passes: -max_total_time=S -runs=N -seed=N -dict=FILE
// -max_len=N -artifact_prefix=P, then corpus directories (files are read, nothing is written
// there). Before a crash (sanitizer report, abort, uncaught exception, signal) the input is
// written to P + "crash-<run>" and the process ends non-zero, as libFuzzer does.
#include <sanitizer/common_interface_defs.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "mutator.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {
std::string g_prefix = "./";
std::string g_current;
long long g_run = 0;

void dump_current() {
  static bool done = false;
  if (done) return;
  done = true;
  const std::string path = g_prefix + "crash-" + std::to_string(g_run);
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(g_current.data(), 1, g_current.size(), f);
    std::fclose(f);
  }
  std::fprintf(stderr, "==mutation_driver== run %lld crashed; Test unit written to %s\n", g_run, path.c_str());
}
void on_signal(int sig) {
  dump_current();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// libFuzzer dictionary: lines `name="value"` or `"value"`, with \\, \" and \xNN escapes.
std::vector<std::string> read_dict(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto b = line.find('"'), e = line.rfind('"');
    if (line.empty() || line[0] == '#' || b == std::string::npos || e <= b) continue;
    std::string v;
    for (std::size_t i = b + 1; i < e; ++i) {
      if (line[i] == '\\' && i + 1 < e) {
        if (line[i + 1] == 'x' && i + 3 < e) {
          v += static_cast<char>(std::stoi(line.substr(i + 2, 2), nullptr, 16));
          i += 3;
        } else {
          v += line[++i];
        }
      } else {
        v += line[i];
      }
    }
    out.push_back(v);
  }
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  double max_time = 60;
  long long runs = -1;
  std::uint64_t seed = 1;
  std::size_t max_len = 16384;
  std::vector<std::string> dict, corpus;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&](const char* k) { return a.rfind(k, 0) == 0 ? a.substr(std::strlen(k)) : std::string(); };
    if (!val("-max_total_time=").empty()) max_time = std::stod(val("-max_total_time="));
    else if (!val("-runs=").empty()) runs = std::stoll(val("-runs="));
    else if (!val("-seed=").empty()) seed = std::stoull(val("-seed="));
    else if (!val("-max_len=").empty()) max_len = std::stoull(val("-max_len="));
    else if (!val("-dict=").empty()) dict = read_dict(val("-dict="));
    else if (!val("-artifact_prefix=").empty()) g_prefix = val("-artifact_prefix=");
    else if (a.rfind("-", 0) == 0) continue;  // other libFuzzer flags: ignored
    else if (std::filesystem::is_directory(a))
      for (const auto& e : std::filesystem::recursive_directory_iterator(a))
        if (e.is_regular_file()) {
          std::ifstream in(e.path(), std::ios::binary);
          corpus.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        }
  }
  if (corpus.empty()) corpus.emplace_back();
  __sanitizer_set_death_callback(dump_current);
  std::set_terminate([] {
    dump_current();
    std::abort();
  });
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(s, on_signal);

  std::printf("INFO: mutation driver (no coverage feedback): %zu seed inputs, %zu dictionary tokens, seed %llu\n",
              corpus.size(), dict.size(), static_cast<unsigned long long>(seed));
  unirl_fuzz::mutator mutate(corpus, dict, seed, max_len);
  const auto start = std::chrono::steady_clock::now();
  for (g_run = 0; runs < 0 || g_run < runs; ++g_run) {
    if ((g_run & 63) == 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > max_time) break;
    const std::string& x = mutate.next();
    g_current = x;
    LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(x.data()), x.size());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("Done %lld runs in %.0f second(s)\nstat::number_of_executed_units: %lld\n", g_run, secs, g_run);
  return 0;
}
