// Instantiates unirl's CUDA kernels (include/unirl/ops/cuda/*.cuh) into the unirl::cuda target.
#include <unirl/ops/cuda/gaussian.cuh>
#include <unirl/ops/cuda/logprob.cuh>
#include <unirl/ops/cuda/paged_attention.cuh>

namespace unirl::ops::cuda {

template <class T>
cudaError_t logprob_forward(const T* logits, const std::int64_t* targets, std::int64_t n, std::int64_t v, T* logp,
                            T* entropy, T* lse, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  UNIRL_LAUNCH(logprob_forward_kernel<T>, static_cast<unsigned>(n), row_block, 0, stream, logits, targets, v, logp,
               entropy, lse);
  return cudaGetLastError();
}

template <class T>
cudaError_t logprob_backward(const T* logits, const std::int64_t* targets, const T* lse, const T* entropy,
                             const T* g_logp, const T* g_entropy, std::int64_t n, std::int64_t v, T* g_logits,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  UNIRL_LAUNCH(logprob_backward_kernel<T>, static_cast<unsigned>(n), row_block, 0, stream, logits, targets, lse,
               entropy, g_logp, g_entropy, v, g_logits);
  return cudaGetLastError();
}

template cudaError_t logprob_forward<float>(const float*, const std::int64_t*, std::int64_t, std::int64_t, float*,
                                            float*, float*, cudaStream_t);
template cudaError_t logprob_forward<double>(const double*, const std::int64_t*, std::int64_t, std::int64_t, double*,
                                             double*, double*, cudaStream_t);
template cudaError_t logprob_backward<float>(const float*, const std::int64_t*, const float*, const float*,
                                             const float*, const float*, std::int64_t, std::int64_t, float*,
                                             cudaStream_t);
template cudaError_t logprob_backward<double>(const double*, const std::int64_t*, const double*, const double*,
                                              const double*, const double*, std::int64_t, std::int64_t, double*,
                                              cudaStream_t);

template <class T>
cudaError_t gaussian_logprob_forward(const T* x_next, const T* mean, std::int64_t b, std::int64_t n, T inv_two_var,
                                     T scale, T offset, T* out, cudaStream_t stream) {
  if (b == 0) return cudaSuccess;
  UNIRL_LAUNCH(gaussian_logprob_forward_kernel<T>, static_cast<unsigned>(b), row_block, 0, stream, x_next, mean, n,
               inv_two_var, scale, offset, out);
  return cudaGetLastError();
}

template <class T>
cudaError_t gaussian_logprob_backward(const T* x_next, const T* mean, const T* g, std::int64_t b, std::int64_t n,
                                      T scale_over_var, T* g_mean, cudaStream_t stream) {
  const std::int64_t total = b * n;
  if (total == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((total + row_block - 1) / row_block);
  UNIRL_LAUNCH(gaussian_logprob_backward_kernel<T>, blocks, row_block, 0, stream, x_next, mean, g, n, total,
               scale_over_var, g_mean);
  return cudaGetLastError();
}

template <class T>
cudaError_t paged_decode(const T* q, const T* k_pool, const T* v_pool, const std::int64_t* slots, const T* bias,
                         std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, std::int64_t C, T scale,
                         T* out, cudaStream_t stream) {
  if (S * H == 0) return cudaSuccess;
  if (Hkv <= 0 || H % Hkv != 0 || paged_decode_shared_bytes<T>(C, D) > paged_decode_max_shared_bytes)
    return cudaErrorInvalidValue;
  // Threads: one per slot up to a block, at least a warp (the reductions use whole warps).
  const int threads = C >= row_block ? row_block : (C <= 32 ? 32 : static_cast<int>((C + 31) / 32 * 32));
  UNIRL_LAUNCH(paged_decode_kernel<T>, static_cast<unsigned>(S * H), threads, paged_decode_shared_bytes<T>(C, D),
               stream, q, k_pool, v_pool, slots, bias, H, Hkv, D, C, scale, out);
  return cudaGetLastError();
}

#define UNIRL_INSTANTIATE(T)                                                                                         \
  template cudaError_t gaussian_logprob_forward<T>(const T*, const T*, std::int64_t, std::int64_t, T, T, T, T*,      \
                                                   cudaStream_t);                                                    \
  template cudaError_t gaussian_logprob_backward<T>(const T*, const T*, const T*, std::int64_t, std::int64_t, T, T*, \
                                                    cudaStream_t);                                                   \
  template cudaError_t paged_decode<T>(const T*, const T*, const T*, const std::int64_t*, const T*, std::int64_t,    \
                                       std::int64_t, std::int64_t, std::int64_t, std::int64_t, T, T*, cudaStream_t);
UNIRL_INSTANTIATE(float)
UNIRL_INSTANTIATE(double)
#undef UNIRL_INSTANTIATE

}  // namespace unirl::ops::cuda
