#pragma once
/// \file gaussian.hpp
/// The per-sample Gaussian log-density of the flow samplers' steps — evaluated at every step of
/// a rollout and again at every replayed step of the update (rollout/flow_samplers.hpp,
/// `gaussian_log_prob`).
///
/// ```cpp
/// // x_next, mean (B, S...); std > 0: the (B,) mean (or sum) over each sample's elements of
/// // -(x_next - mean)^2 / (2 std^2) - log std - log(2 pi) / 2, differentiable in the mean
/// auto lp = unirl::ops::gaussian_logprob<unirl::exec::automatic>(x_next, mean, 0.3, /*mean_reduction=*/true);
/// ```
/// `exec::reference` composes LibTorch ops (a (B, S...) temporary per term); `exec::cpu` is one
/// pass per sample accumulating the squared deviations (float32 in float64), and `exec::cuda` one
/// block per sample (ops/cuda/gaussian.cuh), both with a one-pass backward. Float32 and float64
/// take them; other dtypes (bfloat16, float16) take the reference.
#include <cmath>
#include <cstdint>

#include <ATen/AccumulateType.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <unirl/concepts/execution.hpp>
#include <unirl/core/error.hpp>
#include <unirl/exec/policy.hpp>

#if defined(UNIRL_WITH_CUDA_KERNELS)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <unirl/ops/cuda/gaussian.cuh>
#endif

namespace unirl::ops {

namespace detail {

inline constexpr double gaussian_log_two_pi = 1.8378770664093454835606594728112;  // log(2 pi)

inline torch::Tensor gaussian_logprob_reference(const torch::Tensor& x_next, const torch::Tensor& mean, double std,
                                                bool mean_reduction) {
  const auto d = x_next - mean;
  const auto lp = -d.square() / (2.0 * std * std) - (std::log(std) + 0.5 * gaussian_log_two_pi);
  const auto flat = lp.flatten(1);
  return mean_reduction ? flat.mean(1) : flat.sum(1);
}

// lp_b = -scale * sum_j d_bj^2 / (2 std^2) - offset; d lp_b / d mean_bj = scale * d_bj / std^2.
struct gaussian_terms {
  double inv_two_var, scale, offset;
};
inline gaussian_terms gaussian_terms_for(double std, std::int64_t n, bool mean_reduction) {
  const double c = std::log(std) + 0.5 * gaussian_log_two_pi;
  return {1.0 / (2.0 * std * std), mean_reduction ? 1.0 / static_cast<double>(n) : 1.0,
          mean_reduction ? c : c * static_cast<double>(n)};
}

// The fused forward and backward; `OnCuda` takes the kernels of ops/cuda/gaussian.cuh.
template <bool OnCuda>
struct fused_gaussian_logprob : torch::autograd::Function<fused_gaussian_logprob<OnCuda>> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor x_next,
                                                torch::Tensor mean, double std, bool mean_reduction) {
    const auto x = x_next.contiguous(), m = mean.contiguous();
    const auto b = m.size(0), n = b > 0 ? m.numel() / b : 0;
    const auto k = gaussian_terms_for(std, n, mean_reduction);
    auto out = torch::empty({b}, m.options());
    AT_DISPATCH_FLOATING_TYPES(m.scalar_type(), "unirl_gaussian_logprob", [&] {
      const auto* xp = x.data_ptr<scalar_t>();
      const auto* mp = m.data_ptr<scalar_t>();
      auto* op = out.data_ptr<scalar_t>();
      if constexpr (OnCuda) {
#if defined(UNIRL_WITH_CUDA_KERNELS)
        const c10::cuda::CUDAGuard guard(m.device());
        check_cuda(ops::cuda::gaussian_logprob_forward<scalar_t>(
            xp, mp, b, n, static_cast<scalar_t>(k.inv_two_var), static_cast<scalar_t>(k.scale),
            static_cast<scalar_t>(k.offset), op, at::cuda::getCurrentCUDAStream().stream()));
#endif
      } else {
        using acc_t = at::acc_type<scalar_t, false>;  // float64 on the CPU
        at::parallel_for(0, b, 1, [&](std::int64_t lo, std::int64_t hi) {
          for (std::int64_t i = lo; i < hi; ++i) {
            acc_t s = 0;
            for (std::int64_t j = i * n; j < (i + 1) * n; ++j) {
              const acc_t d = static_cast<acc_t>(xp[j]) - static_cast<acc_t>(mp[j]);
              s += d * d;
            }
            op[i] = static_cast<scalar_t>(-s * k.inv_two_var * k.scale - k.offset);
          }
        });
      }
    });
    ctx->save_for_backward({x, m});
    ctx->saved_data["scale_over_var"] = 2.0 * k.inv_two_var * k.scale;
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &m = saved[1];
    const double c = ctx->saved_data["scale_over_var"].toDouble();
    const auto g = grads[0].contiguous();
    const auto b = m.size(0), n = b > 0 ? m.numel() / b : 0;
    torch::Tensor g_mean;
    if constexpr (OnCuda) {
#if defined(UNIRL_WITH_CUDA_KERNELS)
      const c10::cuda::CUDAGuard guard(m.device());
      g_mean = torch::empty_like(m);
      AT_DISPATCH_FLOATING_TYPES(m.scalar_type(), "unirl_gaussian_logprob_backward", [&] {
        check_cuda(ops::cuda::gaussian_logprob_backward<scalar_t>(
            x.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), b, n, static_cast<scalar_t>(c),
            g_mean.data_ptr<scalar_t>(), at::cuda::getCurrentCUDAStream().stream()));
      });
#endif
    } else {
      g_mean = ((x - m).view({b, n}) * (g.view({b, 1}) * c)).view(m.sizes());
    }
    return {torch::Tensor(), g_mean, torch::Tensor(), torch::Tensor()};
  }

#if defined(UNIRL_WITH_CUDA_KERNELS)
  static void check_cuda(cudaError_t e) {
    UNIRL_CHECK(e == cudaSuccess, "gaussian_logprob: CUDA kernel launch failed: ", cudaGetErrorString(e));
  }
#endif
};

}  // namespace detail

/// The (B,) Gaussian log-density of `x_next` under N(`mean`, `std`^2) per sample, reduced over
/// its elements (the mean when `mean_reduction`, else the sum); differentiable in `mean`
/// (`x_next` is a constant), computed in the mean's dtype. `std` must be > 0.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor gaussian_logprob(const torch::Tensor& x_next, const torch::Tensor& mean, double std,
                               bool mean_reduction) {
  UNIRL_CHECK(x_next.defined() && mean.defined() && x_next.sizes() == mean.sizes(), "gaussian_logprob: x_next sizes ",
              x_next.defined() ? x_next.sizes() : c10::IntArrayRef{}, " differ from the mean's ",
              mean.defined() ? mean.sizes() : c10::IntArrayRef{});
  UNIRL_CHECK(mean.dim() >= 1 && mean.is_floating_point(),
              "gaussian_logprob: the mean must be a floating (B, S...) "
              "tensor, got ",
              mean.sizes(), " ", mean.dtype());
  UNIRL_CHECK(std > 0.0 && std::isfinite(std), "gaussian_logprob: std = ", std, ": expected a finite value > 0");
  const auto x = x_next.detach().to(mean.device(), mean.scalar_type());
  const auto st = mean.scalar_type();
  const bool fused_type = st == torch::kFloat || st == torch::kDouble;
  auto reference = [&] { return detail::gaussian_logprob_reference(x, mean, std, mean_reduction); };
  return exec::dispatch<Exec>(
      mean, reference,
      [&] {
        return fused_type ? detail::fused_gaussian_logprob<false>::apply(x, mean, std, mean_reduction)[0] : reference();
      }
#if defined(UNIRL_WITH_CUDA_KERNELS)
      ,
      [&] {
        return fused_type ? detail::fused_gaussian_logprob<true>::apply(x, mean, std, mean_reduction)[0] : reference();
      }
#endif
  );
}

}  // namespace unirl::ops
