#pragma once
// Shared by the flow-track examples (20_digits_flow, 21_video_flow): a small digit classifier
// (the reward model and the feature extractor of the Fréchet distance) and PNG grids of
// samples. Include <unirl/train/plot.hpp> before this header: it brings stb_image_write.
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <stb_image_write.h>
#include <torch/torch.h>

#include <unirl/core/error.hpp>

#include "common/digits.hpp"

namespace examples {

/// An MLP on 8x8 digits in [-1, 1]: 64 -> 128 -> 64 (features) -> 10.
class digit_classifierImpl : public torch::nn::Module {
 public:
  digit_classifierImpl()
      : l1_(register_module("l1", torch::nn::Linear(64, 128))),
        l2_(register_module("l2", torch::nn::Linear(128, 64))),
        l3_(register_module("l3", torch::nn::Linear(64, 10))) {}
  /// Penultimate features (N, 64): what the Fréchet distance compares.
  torch::Tensor features(const torch::Tensor& x) {
    return torch::silu(l2_(torch::silu(l1_(x.reshape({x.size(0), 64})))));
  }
  torch::Tensor forward(const torch::Tensor& x) { return l3_(features(x)); }

 private:
  torch::nn::Linear l1_, l2_, l3_;
};
TORCH_MODULE(digit_classifier);

/// Trains the classifier on (N, 1, 8, 8) images in [-1, 1]; returns the held-out accuracy.
inline double train_classifier(digit_classifier& clf, const torch::Tensor& x, const torch::Tensor& y,
                               const torch::Tensor& test_x, const torch::Tensor& test_y, int iterations = 600) {
  torch::optim::Adam opt(clf->parameters(), torch::optim::AdamOptions(2e-3).weight_decay(1e-4));
  const auto n = x.size(0);
  for (int i = 0; i < iterations; ++i) {
    const auto idx = torch::randint(0, n, {128}, torch::kInt64);
    // Light noise makes the classifier less brittle on generated samples.
    const auto xb = x.index_select(0, idx) + 0.1 * torch::randn({128, 1, 8, 8});
    const auto loss = torch::cross_entropy_loss(clf->forward(xb), y.index_select(0, idx));
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  torch::NoGradGuard ng;
  clf->eval();
  return (clf->forward(test_x).argmax(1) == test_y).to(torch::kFloat64).mean().item<double>();
}

/// The digits in [-1, 1], a classifier trained on a fixed split (the first `n_train` of a seed-0
/// permutation; the rest is held out), and the classifier's features of every real image — the
/// reference statistics of the Fréchet distance.
struct digit_setup {
  torch::Tensor images;         // (N, 1, 8, 8) in [-1, 1]
  torch::Tensor labels;         // (N,) int64
  torch::Tensor perm;           // (N,) the split's permutation
  std::int64_t n_train = 1500;  // perm[0, n_train) trains the classifier
  digit_classifier clf;
  double accuracy = 0.0;        // the classifier's held-out accuracy
  torch::Tensor real_features;  // (N, F)
};

inline digit_setup prepare_digits(const std::string& csv_gz_path) {
  digit_setup s;
  const auto data = load_digits(csv_gz_path);
  s.images = data.images * 2 - 1;
  s.labels = data.labels;
  torch::manual_seed(0);
  s.perm = torch::randperm(s.images.size(0), torch::kInt64);
  const auto x = s.images.index_select(0, s.perm), y = s.labels.index_select(0, s.perm);
  s.accuracy = train_classifier(s.clf, x.slice(0, 0, s.n_train), y.slice(0, 0, s.n_train), x.slice(0, s.n_train),
                                y.slice(0, s.n_train));
  std::cout << "classifier held-out accuracy: " << s.accuracy << "\n";
  torch::NoGradGuard ng;
  s.real_features = s.clf->features(s.images);
  return s;
}

/// Writes (rows * cols) gray images (N, H, W) in [-1, 1] as one PNG, each pixel `scale` pixels wide,
/// with a 1-pixel gap between tiles.
inline void write_grid_png(const std::string& path, const torch::Tensor& images, std::int64_t rows, std::int64_t cols,
                           int scale = 4) {
  const auto img = ((images.detach().to(torch::kCPU, torch::kFloat32).clamp(-1, 1) + 1) * 127.5)
                       .round()
                       .to(torch::kUInt8)
                       .contiguous();
  UNIRL_CHECK(img.dim() == 3 && img.size(0) >= rows * cols, "write_grid_png: got ", img.sizes(), " for a ", rows,
              " x ", cols, " grid");
  const auto h = img.size(1), w = img.size(2);
  const auto tile_h = h * scale + 1, tile_w = w * scale + 1;
  const auto H = rows * tile_h + 1, W = cols * tile_w + 1;
  std::vector<std::uint8_t> px(static_cast<std::size_t>(H * W), 64);
  const auto* p = img.data_ptr<std::uint8_t>();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      for (std::int64_t y = 0; y < h * scale; ++y)
        for (std::int64_t x = 0; x < w * scale; ++x)
          px[static_cast<std::size_t>((1 + r * tile_h + y) * W + 1 + c * tile_w + x)] =
              p[((r * cols + c) * h + y / scale) * w + x / scale];
  const std::filesystem::path fp(path);
  if (fp.has_parent_path()) std::filesystem::create_directories(fp.parent_path());
  UNIRL_CHECK(stbi_write_png(path.c_str(), static_cast<int>(W), static_cast<int>(H), 1, px.data(),
                             static_cast<int>(W)) != 0,
              "write_grid_png: cannot write '", path, "'");
}

}  // namespace examples
