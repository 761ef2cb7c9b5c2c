#pragma once
/// \file ssim.hpp
/// SSIM (Wang, Bovik, Sheikh, Simoncelli 2004, "Image quality assessment: from error visibility
/// to structural similarity"): local statistics under an 11x11 Gaussian window (sigma 1.5),
///   SSIM(x, y) = (2 mu_x mu_y + C1)(2 sigma_xy + C2) / ((mu_x^2 + mu_y^2 + C1)(sigma_x^2 + sigma_y^2 + C2)),
/// C1 = (K1 L)^2, C2 = (K2 L)^2 with K1 = 0.01, K2 = 0.03 and L the data range; the map is
/// computed where the window fits (no padding, as the authors' MATLAB code) and averaged over
/// positions and channels. Population (biased) local variances, as in the paper.
///
/// ```cpp
/// torch::Tensor s = unirl::eval::ssim(a, b, {.data_range = 1.0});   // (N,) for (N, C, H, W) inputs
/// ```
#include <cmath>
#include <cstdint>
#include <string>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::eval {

/// Options of SSIM; the defaults are the paper's.
struct ssim_options {
  double data_range = 1.0;      // L: 1 for images in [0, 1], 255 for 8-bit images
  std::int64_t window = 11;     // Gaussian window size (odd)
  double sigma = 1.5;           // Gaussian window standard deviation
  double k1 = 0.01, k2 = 0.03;  // stabilising constants

  void validate(const std::string& prefix) const {
    options::require(data_range > 0, prefix + "data_range", data_range, "> 0");
    options::require(window >= 1 && window % 2 == 1, prefix + "window", window, "an odd size >= 1");
    options::require(sigma > 0, prefix + "sigma", sigma, "> 0");
    options::require(k1 > 0, prefix + "k1", k1, "> 0");
    options::require(k2 > 0, prefix + "k2", k2, "> 0");
  }
};

}  // namespace unirl::eval

BOOST_HANA_ADAPT_STRUCT(unirl::eval::ssim_options, data_range, window, sigma, k1, k2);

namespace unirl::eval {

/// The SSIM map, (N, C, H - w + 1, W - w + 1) float64, of two images of the same shape
/// (N, C, H, W), (C, H, W) or (H, W).
inline torch::Tensor ssim_map(const torch::Tensor& x, const torch::Tensor& y, const ssim_options& o = {}) {
  options::validate(o);
  UNIRL_CHECK(x.defined() && y.defined(), "ssim: undefined image");
  UNIRL_CHECK(x.sizes() == y.sizes(), "ssim: images of shapes ", x.sizes(), " and ", y.sizes(),
              "; expected the same shape");
  UNIRL_CHECK(x.dim() >= 2 && x.dim() <= 4, "ssim: image of shape ", x.sizes(), "; expected (N, C, H, W), (C, H, W) or (H, W)");
  auto as4 = [](const torch::Tensor& t) {
    auto d = t.to(torch::kFloat64);
    while (d.dim() < 4) d = d.unsqueeze(0);
    return d;
  };
  auto a = as4(x), b = as4(y);
  const auto C = a.size(1), H = a.size(2), W = a.size(3), w = o.window;
  UNIRL_CHECK(H >= w && W >= w, "ssim: image of ", H, "x", W, " pixels is smaller than the ", w, "x", w,
              " window; expected at least the window size (or set a smaller window)");
  auto g = torch::arange(w, torch::TensorOptions().dtype(torch::kFloat64).device(a.device())) - static_cast<double>(w / 2);
  g = torch::exp(-(g * g) / (2 * o.sigma * o.sigma));
  g = g / g.sum();
  const auto kh = g.view({1, 1, w, 1}).expand({C, 1, w, 1}).contiguous();
  const auto kw = g.view({1, 1, 1, w}).expand({C, 1, 1, w}).contiguous();
  namespace F = torch::nn::functional;
  auto filt = [&](const torch::Tensor& t) {
    return F::conv2d(F::conv2d(t, kh, F::Conv2dFuncOptions().groups(C)), kw, F::Conv2dFuncOptions().groups(C));
  };
  const double c1 = std::pow(o.k1 * o.data_range, 2), c2 = std::pow(o.k2 * o.data_range, 2);
  const auto mx = filt(a), my = filt(b);
  const auto sxx = filt(a * a) - mx * mx, syy = filt(b * b) - my * my, sxy = filt(a * b) - mx * my;
  return ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2));
}

/// Mean SSIM per image: (N,) float64 (a 0-dim tensor for (C, H, W) or (H, W) inputs).
inline torch::Tensor ssim(const torch::Tensor& x, const torch::Tensor& y, const ssim_options& o = {}) {
  auto m = ssim_map(x, y, o).mean({1, 2, 3});
  return x.dim() == 4 ? m : m.squeeze(0);
}

}  // namespace unirl::eval
