#pragma once
/// \file frechet.hpp
/// Fréchet distance between the Gaussian statistics of two feature sets (FID-style):
/// `d^2 = |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^{1/2})`.
/// The trace of the matrix square root is taken in float64 through Eigen as
/// `tr sqrt(sqrt(S1) S2 sqrt(S1))` — a symmetric PSD matrix, so two `SelfAdjointEigenSolver`s
/// suffice and no complex arithmetic appears (negative round-off eigenvalues clamp to 0).
///
/// ```cpp
/// double fd = unirl::eval::frechet_distance(features_real, features_generated);   // (N, D) each
/// auto s = unirl::eval::feature_statistics(features_real);                        // reuse the reference
/// double fd2 = unirl::eval::frechet_distance(s, unirl::eval::feature_statistics(other));
/// ```
#include <cstdint>

#include <Eigen/Dense>
#include <torch/torch.h>

#include <unirl/core/error.hpp>

namespace unirl::eval {

/// Mean and (unbiased) covariance of a feature set, in float64.
struct gaussian_statistics {
  Eigen::VectorXd mean;
  Eigen::MatrixXd cov;
};

/// Statistics of (N, D) features; N >= 2.
inline gaussian_statistics feature_statistics(const torch::Tensor& features) {
  UNIRL_CHECK(features.defined() && features.dim() == 2, "feature_statistics: features must be (N, D), got ",
              features.defined() ? features.sizes() : c10::IntArrayRef{});
  UNIRL_CHECK(features.size(0) >= 2, "feature_statistics: N = ", features.size(0), ": expected >= 2 samples");
  const auto f = features.detach().to(torch::kCPU, torch::kFloat64).contiguous();
  const auto n = f.size(0), d = f.size(1);
  // Row-major (N, D) in memory is column-major (D, N).
  const Eigen::Map<const Eigen::MatrixXd> x(f.data_ptr<double>(), d, n);
  gaussian_statistics s;
  s.mean = x.rowwise().mean();
  const Eigen::MatrixXd c = x.colwise() - s.mean;
  s.cov = (c * c.transpose()) / static_cast<double>(n - 1);
  return s;
}

/// Symmetric PSD square root through an eigendecomposition (negative eigenvalues clamp to 0).
inline Eigen::MatrixXd sqrt_psd(const Eigen::MatrixXd& s) {
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(0.5 * (s + s.transpose()));
  UNIRL_CHECK(es.info() == Eigen::Success, "sqrt_psd: eigendecomposition failed");
  return es.eigenvectors() * es.eigenvalues().cwiseMax(0.0).cwiseSqrt().asDiagonal() * es.eigenvectors().transpose();
}

/// Fréchet distance (squared, as FID reports it) between two Gaussians.
inline double frechet_distance(const gaussian_statistics& a, const gaussian_statistics& b) {
  UNIRL_CHECK(a.mean.size() == b.mean.size() && a.cov.rows() == a.mean.size() && b.cov.rows() == b.mean.size(),
              "frechet_distance: feature dimensions differ: ", a.mean.size(), " vs ", b.mean.size());
  const Eigen::MatrixXd r = sqrt_psd(a.cov);
  const Eigen::MatrixXd m = r * b.cov * r;
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(0.5 * (m + m.transpose()), Eigen::EigenvaluesOnly);
  UNIRL_CHECK(es.info() == Eigen::Success, "frechet_distance: eigendecomposition failed");
  const double tr_sqrt = es.eigenvalues().cwiseMax(0.0).cwiseSqrt().sum();
  return (a.mean - b.mean).squaredNorm() + a.cov.trace() + b.cov.trace() - 2.0 * tr_sqrt;
}

/// Fréchet distance between the statistics of two (N, D) feature sets.
inline double frechet_distance(const torch::Tensor& features_a, const torch::Tensor& features_b) {
  return frechet_distance(feature_statistics(features_a), feature_statistics(features_b));
}

}  // namespace unirl::eval
