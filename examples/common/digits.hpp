#pragma once
// Loader for examples/data/digits.csv.gz (1797 real 8x8 handwritten digits, UCI / scikit-learn,
// CC BY 4.0): 64 pixel values 0..16 then the label, one row per image. Shared by the examples
// and tests; link ZLIB::ZLIB.
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <zlib.h>

namespace examples {

struct digits {
  torch::Tensor images;  // (N, 1, 8, 8) float in [0, 1]
  torch::Tensor labels;  // (N,) int64 in 0..9
};

/// Reads the gzip'd CSV; throws naming the path and the bad row on malformed input.
inline digits load_digits(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("load_digits: cannot open '" + path + "'");
  std::string text;
  char buf[1 << 15];
  int n = 0;
  while ((n = gzread(f, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(n));
  gzclose(f);
  std::vector<float> pix;
  std::vector<std::int64_t> lab;
  std::size_t pos = 0, row = 0;
  while (pos < text.size()) {
    auto end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty()) continue;
    std::vector<float> vals;
    std::size_t p = 0;
    while (p <= line.size()) {
      auto c = line.find(',', p);
      if (c == std::string::npos) c = line.size();
      vals.push_back(std::stof(line.substr(p, c - p)));
      p = c + 1;
    }
    if (vals.size() != 65)
      throw std::runtime_error("load_digits: row " + std::to_string(row) + " of '" + path + "' has " +
                               std::to_string(vals.size()) + " values, expected 65");
    for (int i = 0; i < 64; ++i) pix.push_back(vals[static_cast<std::size_t>(i)] / 16.0f);
    lab.push_back(static_cast<std::int64_t>(vals[64]));
    ++row;
  }
  const auto count = static_cast<std::int64_t>(lab.size());
  return {torch::from_blob(pix.data(), {count, 1, 8, 8}, torch::kFloat32).clone(),
          torch::from_blob(lab.data(), {count}, torch::kInt64).clone()};
}

}  // namespace examples
