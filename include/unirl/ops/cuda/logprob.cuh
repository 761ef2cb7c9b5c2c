#pragma once
// CUDA kernels for token log-prob + entropy (forward and backward). Raw pointers, sizes and a
// stream; no LibTorch header (nvcc need not parse LibTorch). Instantiated in src/cuda/kernels.cu
// into the unirl::cuda target; the LibTorch glue is in ops/logprob.hpp, which sees only the
// launchers' declarations (the kernels are compiled by nvcc alone: `__CUDACC__`).
#include <cstdint>

#include <cuda_runtime.h>

#include <unirl/ops/cuda/common.cuh>

namespace unirl::ops::cuda {

#if defined(__CUDACC__) || defined(UNIRL_CUDA_HOST_CHECK)
// One block per row: lse, entropy, log p(target).
template <class T>
__global__ void logprob_forward_kernel(const T* __restrict__ logits, const std::int64_t* __restrict__ targets,
                                       std::int64_t v, T* __restrict__ logp, T* __restrict__ entropy,
                                       T* __restrict__ lse_out) {
  __shared__ T shared[32];
  const T* row = logits + blockIdx.x * v;
  T m = row[0];
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) m = row[j] > m ? row[j] : m;
  m = detail::block_reduce<T, true>(m, shared);
  T s = 0, sx = 0;
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const T e = exp(row[j] - m);
    s += e;
    sx += e * row[j];
  }
  s = detail::block_reduce<T, false>(s, shared);
  sx = detail::block_reduce<T, false>(sx, shared);
  if (threadIdx.x == 0) {
    const T lse = m + log(s);
    lse_out[blockIdx.x] = lse;
    entropy[blockIdx.x] = lse - sx / s;
    logp[blockIdx.x] = row[targets[blockIdx.x]] - lse;
  }
}

// One block per row: d logp_t/dx_j = [j = t] - p_j ; dH/dx_j = -p_j (log p_j + H).
template <class T>
__global__ void logprob_backward_kernel(const T* __restrict__ logits, const std::int64_t* __restrict__ targets,
                                        const T* __restrict__ lse, const T* __restrict__ entropy,
                                        const T* __restrict__ g_logp, const T* __restrict__ g_entropy, std::int64_t v,
                                        T* __restrict__ g_logits) {
  const T* row = logits + blockIdx.x * v;
  T* out = g_logits + blockIdx.x * v;
  const T gl = g_logp[blockIdx.x], gh = g_entropy[blockIdx.x], l = lse[blockIdx.x], h = entropy[blockIdx.x];
  const std::int64_t t = targets[blockIdx.x];
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const T logp_j = row[j] - l;
    const T p = exp(logp_j);
    out[j] = -gl * p - gh * p * (logp_j + h) + (j == t ? gl : T(0));
  }
}

#endif  // __CUDACC__

/// Launchers (defined in src/cuda/kernels.cu for float and double).
template <class T>
cudaError_t logprob_forward(const T* logits, const std::int64_t* targets, std::int64_t n, std::int64_t v, T* logp,
                            T* entropy, T* lse, cudaStream_t stream);
template <class T>
cudaError_t logprob_backward(const T* logits, const std::int64_t* targets, const T* lse, const T* entropy,
                             const T* g_logp, const T* g_entropy, std::int64_t n, std::int64_t v, T* g_logits,
                             cudaStream_t stream);

}  // namespace unirl::ops::cuda
