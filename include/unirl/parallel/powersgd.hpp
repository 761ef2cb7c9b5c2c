#pragma once
/// \file powersgd.hpp
/// PowerSGD gradient compression with error feedback (Vogels, Karimireddy and Jaggi, "PowerSGD:
/// Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019,
/// Algorithm 1 with error feedback and warm start): each gradient matrix M (a parameter's
/// gradient reshaped to size(0) x rest, plus the error left over from the last step) travels as
/// two thin factors P = M Q (n x r) and Q = M^T P (m x r) instead of n x m numbers.
///
/// ```cpp
/// // inside a data-parallel strategy (parallel/data_parallel.hpp does this):
/// unirl::parallel::powersgd c({.rank = 2, .start_iter = 10});
/// c.reduce(params, world_size, [&](torch::Tensor& flat) { /* all-reduce (sum) in place */ });
/// ```
/// Per step, for the compressed parameters: M_i = grad_i + e_i; P_i = M_i Q_i; all-reduce (sum)
/// of every P_i in one flat buffer; P_i orthonormalised (Gram-Schmidt); Q_i = M_i^T P_i;
/// all-reduce of every Q_i, divided by the world size; the applied gradient P_i Q_i^T (the same
/// on every rank); the new error e_i = M_i - P_i (M_i^T P_i)^T (this rank's own part that the
/// low-rank approximation missed, the paper's "decompress of the local compressed"); the
/// averaged Q_i is the next step's warm start. Parameters of one dimension (biases, norms) and
/// matrices that would not shrink (n m <= (n + m) r) are averaged uncompressed in one flat
/// all-reduce. Because the errors carry what was not sent, the sum of the applied gradients
/// over T steps differs from the sum of the true means by the mean of the current errors only.
#include <algorithm>
#include <array>
#include <cmath>
#include <string_view>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::parallel {

/// Gradient compression of a data-parallel strategy.
enum class gradient_compression { none, powersgd };
}  // namespace unirl::parallel

template <>
inline constexpr std::array unirl::enum_names<unirl::parallel::gradient_compression>{std::string_view{"none"},
                                                                                     std::string_view{"powersgd"}};

namespace unirl::parallel {

/// PowerSGD settings.
struct powersgd_options {
  std::int64_t rank = 1;          // columns of the factors P and Q (the compression rank r)
  std::int64_t start_iter = 10;   // plain (uncompressed) all-reduces before this many calls
  std::int64_t seed = 0;          // the initial Q (same on every rank)

  void validate(const std::string& prefix) const {
    options::require(rank >= 1, prefix + "rank", rank, ">= 1");
    options::require(start_iter >= 0, prefix + "start_iter", start_iter, ">= 0");
  }
};

/// The PowerSGD state of one rank: an error-feedback buffer and a warm-start Q per compressed
/// parameter (every rank must pass the same parameter list, with the same shapes, every call).
class powersgd {
 public:
  /// Sums `flat` over ranks in place.
  using all_reduce_sum = std::function<void(torch::Tensor& flat)>;

  explicit powersgd(powersgd_options o = {}) : o_(o) { o_.validate("powersgd."); }

  const powersgd_options& options() const { return o_; }
  /// Calls of `reduce` so far (compression starts at `start_iter`).
  std::int64_t calls() const { return calls_; }

  /// True when a parameter of this shape travels compressed.
  bool compresses(const torch::Tensor& p) const {
    if (p.dim() < 2) return false;
    const std::int64_t n = p.size(0), m = p.numel() / std::max<std::int64_t>(n, 1);
    return n * m > (n + m) * o_.rank;
  }

  /// The L2 norm of all error-feedback buffers together (0 before compression starts).
  double error_norm() const {
    double sq = 0;
    for (const auto& e : errors_)
      if (e.defined()) sq += std::pow(e.norm().item<double>(), 2);
    return std::sqrt(sq);
  }

  /// Replaces every `.grad()` of `params` by the (approximate) mean over `world` ranks. A
  /// parameter without a gradient contributes zeros. Before `start_iter` calls: the exact mean.
  void reduce(const std::vector<torch::Tensor>& params, int world, const all_reduce_sum& sum) {
    torch::NoGradGuard no_grad;
    const bool compress = calls_++ >= o_.start_iter;
    if (errors_.empty()) {
      errors_.resize(params.size());
      qs_.resize(params.size());
    }
    UNIRL_CHECK(errors_.size() == params.size(), "powersgd: ", params.size(),
                " parameters given; expected the same ", errors_.size(), " parameters on every call");
    auto grad_of = [](const torch::Tensor& p) {
      return p.grad().defined() ? p.grad().detach() : torch::zeros_like(p);
    };
    std::vector<std::size_t> dense, low_rank;
    for (std::size_t i = 0; i < params.size(); ++i) (compress && compresses(params[i]) ? low_rank : dense).push_back(i);

    // Uncompressed: one flat all-reduce.
    if (!dense.empty()) {
      std::vector<torch::Tensor> flats;
      for (auto i : dense) flats.push_back(grad_of(params[i]).reshape({-1}));
      auto flat = torch::cat(flats);
      sum(flat);
      flat.div_(world);
      std::int64_t off = 0;
      for (auto i : dense) {
        set_grad(params[i], flat.slice(0, off, off + params[i].numel()).view(params[i].sizes()));
        off += params[i].numel();
      }
    }
    if (low_rank.empty()) return;

    const std::int64_t r = o_.rank;
    std::vector<torch::Tensor> ms, ps;
    for (auto i : low_rank) {
      const auto& p = params[i];
      const std::int64_t n = p.size(0), m = p.numel() / n;
      auto mat = grad_of(p).reshape({n, m}).to(torch::kFloat32).clone();
      if (errors_[i].defined()) mat.add_(errors_[i]);
      if (!qs_[i].defined()) {  // the same Q on every rank: a generator seeded by (seed, index)
        auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(o_.seed * 1000003 + static_cast<std::int64_t>(i)));
        qs_[i] = at::randn({m, r}, gen, torch::TensorOptions().dtype(torch::kFloat32)).to(mat.device());
        orthonormalise(qs_[i]);
      }
      ps.push_back(torch::matmul(mat, qs_[i]));
      ms.push_back(std::move(mat));
    }
    auto pflat = flatten(ps);
    sum(pflat);
    unflatten(pflat, ps);
    std::vector<torch::Tensor> qs;
    for (std::size_t k = 0; k < low_rank.size(); ++k) {
      orthonormalise(ps[k]);
      qs.push_back(torch::matmul(ms[k].t(), ps[k]));
    }
    // The error keeps what this rank's own low-rank part missed.
    for (std::size_t k = 0; k < low_rank.size(); ++k) errors_[low_rank[k]] = ms[k] - torch::matmul(ps[k], qs[k].t());
    auto qflat = flatten(qs);
    sum(qflat);
    qflat.div_(world);
    unflatten(qflat, qs);
    for (std::size_t k = 0; k < low_rank.size(); ++k) {
      const auto& p = params[low_rank[k]];
      qs_[low_rank[k]] = qs[k];  // warm start
      set_grad(p, torch::matmul(ps[k], qs[k].t()).to(p.scalar_type()).view(p.sizes()));
    }
  }

 private:
  static void set_grad(const torch::Tensor& p, const torch::Tensor& g) {
    if (p.grad().defined()) p.mutable_grad().copy_(g);
    else p.mutable_grad() = g.clone();
  }
  static torch::Tensor flatten(const std::vector<torch::Tensor>& ts) {
    std::vector<torch::Tensor> flats;
    for (const auto& t : ts) flats.push_back(t.reshape({-1}));
    return torch::cat(flats);
  }
  static void unflatten(const torch::Tensor& flat, std::vector<torch::Tensor>& ts) {
    std::int64_t off = 0;
    for (auto& t : ts) {
      t = flat.slice(0, off, off + t.numel()).view(t.sizes()).clone();
      off += t.numel();
    }
  }
  // Modified Gram-Schmidt on the columns, in place; a (numerically) zero column stays zero.
  static void orthonormalise(torch::Tensor& a) {
    const std::int64_t cols = a.size(1);
    for (std::int64_t j = 0; j < cols; ++j) {
      auto c = a.select(1, j);
      for (std::int64_t k = 0; k < j; ++k) {
        const auto prev = a.select(1, k);
        c.sub_(prev * (prev * c).sum());
      }
      const auto n = c.norm();
      c.div_(n.clamp_min(1e-12));
    }
  }

  powersgd_options o_;
  std::int64_t calls_ = 0;
  std::vector<torch::Tensor> errors_{}, qs_{};
};

}  // namespace unirl::parallel

BOOST_HANA_ADAPT_STRUCT(unirl::parallel::powersgd_options, rank, start_iter, seed);
