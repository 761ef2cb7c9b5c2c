#pragma once
/// \file paged_attention.hpp
/// Attention over a paged KV cache (`paged_kv`, `paged_batch` in concepts/causal_lm.hpp): writes
/// the new keys and values of a packed batch into their pool slots, then attends each sequence's
/// queries to its own context slots — the decoding sequences (one query each) together, through
/// one gather of their slots padded to the longest context (padding masked with -inf, which adds
/// exact zeros: the result does not depend on what else is decoded), each prefill chunk on its
/// own. The projections around it run on all N packed tokens at once. On the CPU in float and
/// double the decoding sequences run a fused loop that reads their keys and values in the pool
/// (no gather, no padding) with the arithmetic of `ops::attention`'s fused kernel; on CUDA (built
/// with `UNIRL_ENABLE_CUDA`) a kernel that does the same, one block per sequence and head
/// (ops/cuda/paged_attention.cuh). The decode step is dispatched by the execution policy `Exec`
/// (default `exec::automatic`): `exec::reference` gathers the slots and calls `attend`.
///
/// ```cpp
/// // q (N, H, Dh), k and v (N, H_kv, Dh) of the batch's tokens; kv.k[l], kv.v[l] (slots, H_kv, Dh)
/// auto y = unirl::ops::paged_attention(q, k, v, kv.k[l], kv.v[l], batch, scale,
///     [&](auto& q4, auto& k4, auto& v4, auto& bias) { return unirl::ops::attention(q4, k4, v4, bias, scale); });
/// // y (N, H, Dh)
/// ```
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/concepts/execution.hpp>
#include <unirl/core/error.hpp>
#include <unirl/exec/policy.hpp>
#include <unirl/ops/attention.hpp>

#if defined(UNIRL_WITH_CUDA_KERNELS)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <unirl/ops/cuda/paged_attention.cuh>
#endif

namespace unirl::ops {

namespace detail {

// One query per sequence: q (S, H, D); sequence s attends to the first context[s] slots of row s
// of slots (S, C) in the pools (slots, H_kv, D); query head h reads KV head h / (H / H_kv).
// The loops of `fused_attention` (same sums in the same order) without its mask.
inline torch::Tensor paged_decode_cpu(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                      const torch::Tensor& slots, const std::vector<std::int64_t>& context, double scale) {
  const auto S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_pool.size(1), C = slots.size(1);
  const auto groups = H / Hkv;
  const auto qc = q.contiguous();
  const auto sl = slots.contiguous();
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "unirl_paged_decode", [&] {
    const auto* qp = qc.data_ptr<scalar_t>();
    const auto* kp = k_pool.data_ptr<scalar_t>();
    const auto* vp = v_pool.data_ptr<scalar_t>();
    const auto* sp = sl.data_ptr<std::int64_t>();
    auto* op = out.data_ptr<scalar_t>();
    const auto sc = static_cast<scalar_t>(scale);
    at::parallel_for(0, S * H, 1, [&](std::int64_t lo, std::int64_t hi) {
      std::vector<scalar_t> p(static_cast<std::size_t>(C));
      for (std::int64_t sh = lo; sh < hi; ++sh) {
        const auto s = sh / H, h = sh % H, hk = h / groups, n = context[static_cast<std::size_t>(s)];
        const auto* qi = qp + sh * D;
        const auto* row = sp + s * C;
        scalar_t m = -std::numeric_limits<scalar_t>::infinity();
        for (std::int64_t j = 0; j < n; ++j) {
          p[static_cast<std::size_t>(j)] = dot(qi, kp + (row[j] * Hkv + hk) * D, D) * sc;
          m = p[static_cast<std::size_t>(j)] > m ? p[static_cast<std::size_t>(j)] : m;
        }
        scalar_t sum = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          p[static_cast<std::size_t>(j)] = std::exp(p[static_cast<std::size_t>(j)] - m);
          sum += p[static_cast<std::size_t>(j)];
        }
        const scalar_t inv = scalar_t(1) / sum;
        auto* o = op + sh * D;
        for (std::int64_t d = 0; d < D; ++d) o[d] = 0;
        for (std::int64_t j = 0; j < n; ++j) axpy(p[static_cast<std::size_t>(j)] * inv, vp + (row[j] * Hkv + hk) * D, o, D);
      }
    });
  });
  return out;
}

#if defined(UNIRL_WITH_CUDA_KERNELS)
// The same on CUDA tensors (ops/cuda/paged_attention.cuh); the padding is masked by `bias` (S, C).
inline torch::Tensor paged_decode_cuda(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                       const torch::Tensor& slots, const torch::Tensor& bias, double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_pool.size(1), C = slots.size(1);
  const auto qc = q.contiguous();
  const auto sl = slots.contiguous();
  const auto bs = bias.to(q.scalar_type()).reshape({S, C}).contiguous();
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "unirl_paged_decode_cuda", [&] {
    const auto e = ops::cuda::paged_decode<scalar_t>(
        qc.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(), sl.data_ptr<std::int64_t>(),
        bs.data_ptr<scalar_t>(), S, H, Hkv, D, C, static_cast<scalar_t>(scale), out.data_ptr<scalar_t>(),
        at::cuda::getCurrentCUDAStream().stream());
    UNIRL_CHECK(e == cudaSuccess, "paged_attention: CUDA decode kernel failed: ", cudaGetErrorString(e));
  });
  return out;
}
#endif

}  // namespace detail

/// `attend(q (B, H, n, Dh), k (B, H_kv, S, Dh), v, bias (B, 1, n, S)) -> (B, H, n, Dh)` is the
/// model's attention (its grouped-query handling, its precision) with softmax scale `scale`;
/// this function lays the paged batch out for it. q (N, H, Dh), k_new / v_new (N, H_kv, Dh);
/// k_pool / v_pool (slots, H_kv, Dh) receive the new keys and values at `b.write_slots`.
/// Returns (N, H, Dh). Without gradients. `Exec` picks the decode step's implementation.
template <ExecutionPolicy Exec = exec::automatic, class Attend>
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                              torch::Tensor& k_pool, torch::Tensor& v_pool, const paged_batch& b, double scale,
                              Attend&& attend) {
  UNIRL_CHECK(q.dim() == 3 && k_new.dim() == 3 && k_new.sizes() == v_new.sizes() && k_new.size(0) == q.size(0),
              "paged_attention: q ", q.sizes(), ", k ", k_new.sizes(), ", v ", v_new.sizes(),
              ": expected (N, H, Dh) and (N, H_kv, Dh)");
  UNIRL_CHECK(b.write_slots.defined() && b.write_slots.numel() == q.size(0), "paged_attention: ",
              b.write_slots.defined() ? b.write_slots.numel() : 0, " write slots for ", q.size(0), " tokens");
  UNIRL_CHECK(k_pool.dim() == 3 && k_pool.size(1) == k_new.size(1) && k_pool.size(2) == k_new.size(2),
              "paged_attention: the pool ", k_pool.sizes(), " does not hold keys of sizes ", k_new.sizes());
  torch::NoGradGuard ng;
  k_pool.index_copy_(0, b.write_slots, k_new.to(k_pool.scalar_type()));
  v_pool.index_copy_(0, b.write_slots, v_new.to(v_pool.scalar_type()));
  const auto H = q.size(1), Hkv = k_new.size(1), D = q.size(2);
  auto out = torch::empty_like(q);
  const auto st = q.scalar_type();
  const bool has_decode = b.decode_rows.defined() && b.decode_rows.numel() > 0;
  // The fused loops need float or double pools of the queries' dtype, whole KV-head groups, and
  // (CPU) the context lengths on the host or (CUDA) the scores in one block's shared memory.
  const bool fusable = (st == torch::kFloat || st == torch::kDouble) && k_pool.scalar_type() == st &&
                       v_pool.scalar_type() == st && k_pool.is_contiguous() && v_pool.is_contiguous() && H % Hkv == 0;
  if (has_decode) {
    const auto S = b.decode_slots.size(0), C = b.decode_slots.size(1);
    const auto qd = q.index_select(0, b.decode_rows);  // (S, H, Dh)
    auto gathered = [&] {
      const auto flat = b.decode_slots.reshape({-1});
      const auto k = k_pool.index_select(0, flat).view({S, C, Hkv, D}).permute({0, 2, 1, 3});  // (S, H_kv, C, Dh)
      const auto v = v_pool.index_select(0, flat).view({S, C, Hkv, D}).permute({0, 2, 1, 3});
      auto q4 = qd.unsqueeze(2);                                                              // (S, H, 1, Dh)
      return attend(q4, k, v, b.decode_bias).view({S, H, D});
    };
    const auto y = exec::dispatch<Exec>(
        qd, gathered,
        [&] {
          if (fusable && b.decode_context.size() == static_cast<std::size_t>(S))
            return detail::paged_decode_cpu(qd, k_pool, v_pool, b.decode_slots, b.decode_context, scale);
          return gathered();
        }
#if defined(UNIRL_WITH_CUDA_KERNELS)
        ,
        [&] {
          const auto shared = st == torch::kDouble ? ops::cuda::paged_decode_shared_bytes<double>(C, D)
                                                   : ops::cuda::paged_decode_shared_bytes<float>(C, D);
          if (fusable && b.decode_bias.defined() && shared <= ops::cuda::paged_decode_max_shared_bytes)
            return detail::paged_decode_cuda(qd, k_pool, v_pool, b.decode_slots, b.decode_bias, scale);
          return gathered();
        }
#endif
    );
    out.index_copy_(0, b.decode_rows, y);
  }
  for (const auto& c : b.chunks) {
    const auto k = k_pool.index_select(0, c.context_slots).permute({1, 0, 2}).unsqueeze(0);  // (1, H_kv, ctx, Dh)
    const auto v = v_pool.index_select(0, c.context_slots).permute({1, 0, 2}).unsqueeze(0);
    const auto qc = q.slice(0, c.row, c.row + c.n).permute({1, 0, 2}).unsqueeze(0);          // (1, H, n, Dh)
    out.slice(0, c.row, c.row + c.n).copy_(attend(qc, k, v, c.bias).squeeze(0).permute({1, 0, 2}));
  }
  return out;
}

}  // namespace unirl::ops
