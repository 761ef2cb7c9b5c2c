#pragma once
// Helpers the benchmark programs share for their own flags (before Google Benchmark's).
#include <sstream>
#include <string>
#include <vector>

namespace unirl_bench {

/// The non-empty fields of `s` separated by `sep`: "1,64" -> {"1", "64"}.
inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, sep);)
    if (!x.empty()) out.push_back(x);
  return out;
}

}  // namespace unirl_bench
