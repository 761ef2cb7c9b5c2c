#pragma once
/// \file attention.hpp
/// Scaled dot-product attention with an additive mask — the op every transformer forward and
/// every decoding step of the token track runs.
///
/// ```cpp
/// // q (B, H, n, Dh), k / v (B, H, S, Dh), bias broadcastable to (B, H, n, S) (0 or -inf)
/// auto y = unirl::ops::attention<unirl::exec::automatic>(q, k, v, bias, 1.0 / std::sqrt(Dh));  // (B, H, n, Dh)
/// ```
/// `exec::reference` is softmax(q k^T * scale + bias) v with LibTorch's batched matmuls: for the
/// small heads of RL-sized models on CPU those loop over B*H tiny matrices, and the loop costs
/// more than the arithmetic. `exec::cpu` is one fused pass per (batch, head) — scores, softmax,
/// weighted values — and a fused backward from the saved probabilities, with vectorisable inner
/// loops; `exec::automatic` takes it on CPU for decoding steps and up to
/// `fused_attention_max_work` multiply-adds per head (n * S * Dh), where it measured faster, and
/// the reference beyond (BLAS wins on long sequences). The mask gets no
/// gradient. A query row whose keys are all masked gives NaN, as the reference does.
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <unirl/concepts/execution.hpp>
#include <unirl/core/error.hpp>
#include <unirl/exec/policy.hpp>

namespace unirl::ops {

/// Largest per-head work n * S * Dh for which `exec::automatic` runs the fused CPU attention on
/// a forward of several queries; one query (a decoding step) always runs fused. Measured by
/// benchmarks/ops `BM_attention_*`: at 1.6k the fused op is 5.6x the reference forward + backward,
/// about even at 16k, 0.6x at 131k; a decoding step is 1.5-2x faster fused up to S * Dh = 131k.
inline constexpr std::int64_t fused_attention_max_work = std::int64_t{1} << 14;

namespace detail {

inline void check_attention_args(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const torch::Tensor& bias) {
  UNIRL_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k, v must be (B, H, n|S, Dh), got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  UNIRL_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "attention: k ", k.sizes(), " and v ", v.sizes(), " must be (B, H, S, Dh) matching q ", q.sizes());
  UNIRL_CHECK(!bias.defined() || bias.dim() == 4, "attention: bias must be 4-D, broadcastable to (B, H, n, S), got ",
              bias.sizes());
}

inline torch::Tensor attention_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const torch::Tensor& bias, double scale) {
  auto s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (bias.defined()) s = s + bias;
  return torch::matmul(torch::softmax(s, -1), v);
}

// Dot product with eight independent partial sums (vectorises without reassociating a single sum).
template <class T>
inline T dot(const T* __restrict a, const T* __restrict b, std::int64_t n) {
  T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int r = 0; r < 8; ++r) acc[r] += a[d + r] * b[d + r];
  T s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}
// y += a x
template <class T>
inline void axpy(T a, const T* __restrict x, T* __restrict y, std::int64_t n) {
  for (std::int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

// Fused forward and backward on CPU, one (batch, head) at a time. No mask: an empty `bias`.
struct fused_attention : torch::autograd::Function<fused_attention> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor q, torch::Tensor k,
                                                torch::Tensor v, torch::Tensor bias, double scale) {
    const auto B = q.size(0), H = q.size(1), n = q.size(2), S = k.size(2), D = q.size(3);
    const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    // The mask is read through its broadcast strides (batch and head strides may be 0).
    const auto bx = bias.numel() > 0 ? bias.to(q.scalar_type()).expand({B, H, n, S}) : torch::Tensor();
    const std::int64_t sb = bx.defined() ? bx.stride(0) : 0, sh = bx.defined() ? bx.stride(1) : 0,
                       si = bx.defined() ? bx.stride(2) : 0, sj = bx.defined() ? bx.stride(3) : 0;
    auto out = torch::empty({B, H, n, D}, q.options());
    auto probs = torch::empty({B, H, n, S}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "unirl_fused_attention", [&] {
      const auto* qp = qc.data_ptr<scalar_t>();
      const auto* kp = kc.data_ptr<scalar_t>();
      const auto* vp = vc.data_ptr<scalar_t>();
      const scalar_t* bp = bx.defined() ? bx.data_ptr<scalar_t>() : nullptr;
      auto* op = out.data_ptr<scalar_t>();
      auto* pp = probs.data_ptr<scalar_t>();
      const auto sc = static_cast<scalar_t>(scale);
      at::parallel_for(0, B * H, 1, [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t bh = lo; bh < hi; ++bh) {
          const auto* kh = kp + bh * S * D;
          const auto* vh = vp + bh * S * D;
          for (std::int64_t i = 0; i < n; ++i) {
            const auto* qi = qp + (bh * n + i) * D;
            auto* p = pp + (bh * n + i) * S;
            const scalar_t* b = bp ? bp + (bh / H) * sb + (bh % H) * sh + i * si : nullptr;
            scalar_t m = -std::numeric_limits<scalar_t>::infinity();
            for (std::int64_t j = 0; j < S; ++j) {
              p[j] = dot(qi, kh + j * D, D) * sc + (b ? b[j * sj] : scalar_t(0));
              m = p[j] > m ? p[j] : m;
            }
            scalar_t sum = 0;
            for (std::int64_t j = 0; j < S; ++j) {
              p[j] = std::exp(p[j] - m);  // exp(-inf - m) = 0 for masked keys
              sum += p[j];
            }
            const scalar_t inv = scalar_t(1) / sum;  // all keys masked: m = -inf, p = NaN (as softmax)
            auto* o = op + (bh * n + i) * D;
            for (std::int64_t d = 0; d < D; ++d) o[d] = 0;
            for (std::int64_t j = 0; j < S; ++j) {
              p[j] *= inv;
              axpy(p[j], vh + j * D, o, D);
            }
          }
        }
      });
    });
    ctx->save_for_backward({qc, kc, vc, probs});
    ctx->saved_data["scale"] = scale;
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &probs = saved[3];
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto B = q.size(0), H = q.size(1), n = q.size(2), S = k.size(2), D = q.size(3);
    const auto go = grads[0].contiguous();
    auto gq = torch::zeros_like(q), gk = torch::zeros_like(k), gv = torch::zeros_like(v);
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "unirl_fused_attention_backward", [&] {
      const auto* qp = q.data_ptr<scalar_t>();
      const auto* kp = k.data_ptr<scalar_t>();
      const auto* vp = v.data_ptr<scalar_t>();
      const auto* pp = probs.data_ptr<scalar_t>();
      const auto* gop = go.data_ptr<scalar_t>();
      auto* gqp = gq.data_ptr<scalar_t>();
      auto* gkp = gk.data_ptr<scalar_t>();
      auto* gvp = gv.data_ptr<scalar_t>();
      const auto sc = static_cast<scalar_t>(scale);
      at::parallel_for(0, B * H, 1, [&](std::int64_t lo, std::int64_t hi) {
        std::vector<scalar_t> ds(static_cast<std::size_t>(S));
        for (std::int64_t bh = lo; bh < hi; ++bh) {
          const auto* kh = kp + bh * S * D;
          const auto* vh = vp + bh * S * D;
          auto* gkh = gkp + bh * S * D;
          auto* gvh = gvp + bh * S * D;
          for (std::int64_t i = 0; i < n; ++i) {
            const auto* p = pp + (bh * n + i) * S;
            const auto* g = gop + (bh * n + i) * D;
            const auto* qi = qp + (bh * n + i) * D;
            auto* gqi = gqp + (bh * n + i) * D;
            // dP_ij = <dO_i, v_j>;  dS_ij = p_ij (dP_ij - sum_j' p_ij' dP_ij')
            scalar_t delta = 0;
            for (std::int64_t j = 0; j < S; ++j) {
              ds[static_cast<std::size_t>(j)] = p[j] == 0 ? scalar_t(0) : dot(g, vh + j * D, D);
              delta += p[j] * ds[static_cast<std::size_t>(j)];
            }
            for (std::int64_t j = 0; j < S; ++j) {
              const scalar_t pj = p[j];
              if (pj == 0) continue;  // masked key: no gradient flows
              const scalar_t dsj = pj * (ds[static_cast<std::size_t>(j)] - delta) * sc;
              axpy(dsj, kh + j * D, gqi, D);
              axpy(dsj, qi, gkh + j * D, D);
              axpy(pj, g, gvh + j * D, D);
            }
          }
        }
      });
    });
    return {gq, gk, gv, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace detail

/// softmax(q k^T * scale + bias) v, with the implementation chosen by the execution policy (see
/// the file comment). q (B, H, n, Dh), k and v (B, H, S, Dh), bias broadcastable to (B, H, n, S)
/// or undefined -> (B, H, n, Dh). Differentiable in q, k and v.
template <ExecutionPolicy Exec = exec::automatic>
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& bias, double scale) {
  detail::check_attention_args(q, k, v, bias);
  auto reference = [&] { return detail::attention_reference(q, k, v, bias, scale); };
  return exec::dispatch<Exec>(q, reference, [&] {
    // The fused loops take float / double without a mask gradient; `automatic` keeps the
    // reference where BLAS measured faster (long sequences), an explicit `exec::cpu` does not.
    const bool supported = (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kDouble) &&
                           k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                           (!bias.defined() || !bias.requires_grad());
    const bool small = q.size(2) == 1 || q.size(2) * k.size(2) * q.size(3) <= fused_attention_max_work;
    if (!supported || (exec::decides_by_size<Exec> && !small)) return reference();
    return detail::fused_attention::apply(q, k, v, bias.defined() ? bias : torch::empty({0}, q.options()), scale)[0];
  });
}

}  // namespace unirl::ops
