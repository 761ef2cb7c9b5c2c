#pragma once
/// \file policy.hpp
/// The execution policies: `exec::automatic` (default), `exec::reference`, `exec::cpu`, `exec::cuda`.
///
/// ```cpp
/// auto a = unirl::ops::group_advantage<unirl::exec::reference>(rewards, 8);  // test oracle
/// ```
#include <torch/torch.h>

#include <unirl/concepts/execution.hpp>

namespace unirl::exec {

/// LibTorch composite ops; runs anywhere; the test oracle.
struct reference {
  static backend select(const torch::Tensor&) { return backend::reference; }
};
/// Fused CPU loops where an op has them, else the reference.
struct cpu {
  static backend select(const torch::Tensor&) { return backend::cpu; }
};
/// CUDA kernels where an op has them (needs the unirl::cuda target), else the reference.
struct cuda {
  static backend select(const torch::Tensor&) { return backend::cuda; }
};
/// Picks by the tensor's device: CUDA kernels for CUDA tensors, fused CPU loops otherwise.
struct automatic {
  static backend select(const torch::Tensor& t) { return t.is_cuda() ? backend::cuda : backend::cpu; }
};

static_assert(ExecutionPolicy<reference>);
static_assert(ExecutionPolicy<cpu>);
static_assert(ExecutionPolicy<cuda>);
static_assert(ExecutionPolicy<automatic>);

}  // namespace unirl::exec
