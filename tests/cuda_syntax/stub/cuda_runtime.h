#pragma once
// Stand-in for CUDA's <cuda_runtime.h> in the host compiler's check of unirl's CUDA sources
// (tests/cuda_syntax/CMakeLists.txt), on machines without the CUDA toolkit: the execution-space
// qualifiers expand to nothing, the built-in variables and the intrinsics the kernels use are
// declared with their CUDA signatures, and the runtime types are opaque. Declarations only:
// nothing built with it runs.
#include <cmath>
#include <cstddef>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__

struct unirl_cuda_check_dim3 {
  unsigned x, y, z;
};
extern const unirl_cuda_check_dim3 threadIdx, blockIdx, blockDim, gridDim;
void __syncthreads();
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32);
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32);

// Device code calls the math functions unqualified, with CUDA's float and double overloads.
using std::exp;
using std::log;
using std::sqrt;

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
using cudaStream_t = struct CUstream_st*;
cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t error);
