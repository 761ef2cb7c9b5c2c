#pragma once
// What unirl's CUDA kernels share: block-wide reductions and the launch macro. Device code is
// compiled by nvcc alone (`__CUDACC__`); the host compiler's syntax check of the kernels
// (tests/cuda_syntax) defines `UNIRL_CUDA_HOST_CHECK`, under which a launch is a plain call.
#include <cstddef>

#include <cuda_runtime.h>

// `UNIRL_LAUNCH(kernel, grid, block, shared_bytes, stream, args...)` launches `kernel(args...)`;
// in the host check, it calls the kernel with the launch's arguments checked for their types.
#if defined(UNIRL_CUDA_HOST_CHECK)
#define UNIRL_LAUNCH(kernel, grid, block, shared, stream, ...) \
  ::unirl::ops::cuda::detail::host_check_launch(grid, block, shared, stream, kernel, __VA_ARGS__)
#else
#define UNIRL_LAUNCH(kernel, grid, block, shared, stream, ...) kernel<<<grid, block, shared, stream>>>(__VA_ARGS__)
#endif

namespace unirl::ops::cuda {

/// Threads per block of the row kernels (a multiple of the warp, at most 1024).
constexpr int row_block = 256;

#if defined(UNIRL_CUDA_HOST_CHECK)
namespace detail {
template <class... P, class... A>
void host_check_launch(unsigned grid, unsigned block, std::size_t shared, cudaStream_t stream, void (*kernel)(P...),
                       A&&... args) {
  (void)grid, (void)block, (void)shared, (void)stream;
  kernel(static_cast<A&&>(args)...);
}
}  // namespace detail
#endif

#if defined(__CUDACC__) || defined(UNIRL_CUDA_HOST_CHECK)
namespace detail {
template <class T>
__device__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
template <class T>
__device__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) {
    const T other = __shfl_down_sync(0xffffffffu, v, o);
    v = other > v ? other : v;
  }
  return v;
}
// Block-wide reduction (sum, or max when Max); every thread gets the result. `shared` holds 32.
template <class T, bool Max>
__device__ T block_reduce(T v, T* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = Max ? warp_max(v) : warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  T r = static_cast<int>(threadIdx.x) < warps ? shared[threadIdx.x] : (Max ? shared[0] : T(0));
  if (warp == 0) r = Max ? warp_max(r) : warp_sum(r);
  if (threadIdx.x == 0) shared[0] = r;
  __syncthreads();
  r = shared[0];
  __syncthreads();
  return r;
}
}  // namespace detail
#endif  // __CUDACC__

}  // namespace unirl::ops::cuda
