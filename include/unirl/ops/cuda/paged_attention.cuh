#pragma once
// CUDA kernel for the decoding step of paged attention (ops/paged_attention.hpp): sequence s's
// one query attends to the C slots of row s of `slots` (S, C) in the KV pools (slots, H_kv, D),
// with the additive mask `bias` (S, C) (0 for real keys, -inf for padding, which adds exact
// zeros); query head h reads KV head h / (H / H_kv). No gather of the keys and values, no
// padding copy: the pool is read where it is. Instantiated in src/cuda/kernels.cu.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include <unirl/ops/cuda/common.cuh>

namespace unirl::ops::cuda {

#if defined(__CUDACC__) || defined(UNIRL_CUDA_HOST_CHECK)
// One block per (sequence, head); dynamic shared memory: C scores and the D query values.
template <class T>
__global__ void paged_decode_kernel(const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                                    const std::int64_t* __restrict__ slots, const T* __restrict__ bias, std::int64_t H,
                                    std::int64_t Hkv, std::int64_t D, std::int64_t C, T scale, T* __restrict__ out) {
  extern __shared__ unsigned char raw[];
  T* p = reinterpret_cast<T*>(raw);
  T* qs = p + C;
  __shared__ T shared[32];
  const std::int64_t sh = blockIdx.x, s = sh / H, h = sh % H, hk = h / (H / Hkv);
  const std::int64_t* row = slots + s * C;
  const T* bs = bias + s * C;
  for (std::int64_t d = threadIdx.x; d < D; d += blockDim.x) qs[d] = q[sh * D + d];
  __syncthreads();
  T m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const T* k = k_pool + (row[j] * Hkv + hk) * D;
    T dot = 0;
    for (std::int64_t d = 0; d < D; ++d) dot += qs[d] * k[d];
    const T score = dot * scale + bs[j];
    p[j] = score;
    m = score > m ? score : m;
  }
  m = detail::block_reduce<T, true>(m, shared);
  T sum = 0;
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const T e = exp(p[j] - m);
    p[j] = e;
    sum += e;
  }
  sum = detail::block_reduce<T, false>(sum, shared);  // its barriers also publish every p[j]
  const T inv = T(1) / sum;
  for (std::int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    T acc = 0;
    for (std::int64_t j = 0; j < C; ++j) acc += p[j] * v_pool[(row[j] * Hkv + hk) * D + d];
    out[sh * D + d] = acc * inv;
  }
}
#endif  // __CUDACC__

/// The dynamic shared memory `paged_decode` needs for C slots and head size D, in bytes.
template <class T>
constexpr std::size_t paged_decode_shared_bytes(std::int64_t C, std::int64_t D) {
  return static_cast<std::size_t>(C + D) * sizeof(T);
}
/// The most dynamic shared memory `paged_decode` asks for (the default per-block limit).
constexpr std::size_t paged_decode_max_shared_bytes = 48 * 1024;

/// Launcher (defined in src/cuda/kernels.cu for float and double): q (S, H, D), out (S, H, D).
template <class T>
cudaError_t paged_decode(const T* q, const T* k_pool, const T* v_pool, const std::int64_t* slots, const T* bias,
                         std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, std::int64_t C, T scale,
                         T* out, cudaStream_t stream);

}  // namespace unirl::ops::cuda
