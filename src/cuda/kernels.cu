// Instantiates unirl's CUDA kernels (include/unirl/ops/cuda/*.cuh) into the unirl::cuda target.
#include <unirl/ops/cuda/logprob.cuh>

namespace unirl::ops::cuda {

template <class T>
cudaError_t logprob_forward(const T* logits, const std::int64_t* targets, std::int64_t n, std::int64_t v, T* logp,
                            T* entropy, T* lse, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  logprob_forward_kernel<T><<<static_cast<unsigned>(n), logprob_block, 0, stream>>>(logits, targets, v, logp, entropy, lse);
  return cudaGetLastError();
}

template <class T>
cudaError_t logprob_backward(const T* logits, const std::int64_t* targets, const T* lse, const T* entropy,
                             const T* g_logp, const T* g_entropy, std::int64_t n, std::int64_t v, T* g_logits,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  logprob_backward_kernel<T><<<static_cast<unsigned>(n), logprob_block, 0, stream>>>(logits, targets, lse, entropy,
                                                                                    g_logp, g_entropy, v, g_logits);
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

}  // namespace unirl::ops::cuda
