#pragma once
// CUDA kernels for the flow samplers' Gaussian log-probability (rollout/flow_samplers.hpp,
// `gaussian_log_prob`): per sample b, over its n elements,
//   lp_b = scale * sum_j [-(x'_bj - mean_bj)^2 / (2 std^2)] - offset
// (scale 1/n, offset log std + log(2 pi)/2 for the mean reduction; scale 1 and offset n (...) for
// the sum), and its gradient in the mean, g_b * scale * (x'_bj - mean_bj) / std^2. Raw pointers;
// instantiated in src/cuda/kernels.cu, the LibTorch glue in rollout/flow_samplers.hpp.
#include <cstdint>

#include <cuda_runtime.h>

#include <unirl/ops/cuda/common.cuh>

namespace unirl::ops::cuda {

#if defined(__CUDACC__) || defined(UNIRL_CUDA_HOST_CHECK)
// One block per sample.
template <class T>
__global__ void gaussian_logprob_forward_kernel(const T* __restrict__ x_next, const T* __restrict__ mean,
                                                std::int64_t n, T inv_two_var, T scale, T offset, T* __restrict__ out) {
  __shared__ T shared[32];
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * n;
  T s = 0;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const T d = x_next[base + j] - mean[base + j];
    s += d * d;
  }
  s = detail::block_reduce<T, false>(s, shared);
  if (threadIdx.x == 0) out[blockIdx.x] = -s * inv_two_var * scale - offset;
}

// One thread per element: g_mean = g_b * scale * (x' - mean) / std^2.
template <class T>
__global__ void gaussian_logprob_backward_kernel(const T* __restrict__ x_next, const T* __restrict__ mean,
                                                 const T* __restrict__ g, std::int64_t n, std::int64_t total,
                                                 T scale_over_var, T* __restrict__ g_mean) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < total) g_mean[i] = g[i / n] * scale_over_var * (x_next[i] - mean[i]);
}
#endif  // __CUDACC__

/// Launchers (defined in src/cuda/kernels.cu for float and double): b samples of n elements each.
template <class T>
cudaError_t gaussian_logprob_forward(const T* x_next, const T* mean, std::int64_t b, std::int64_t n, T inv_two_var,
                                     T scale, T offset, T* out, cudaStream_t stream);
template <class T>
cudaError_t gaussian_logprob_backward(const T* x_next, const T* mean, const T* g, std::int64_t b, std::int64_t n,
                                      T scale_over_var, T* g_mean, cudaStream_t stream);

}  // namespace unirl::ops::cuda
