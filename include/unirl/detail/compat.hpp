#pragma once
/// \file compat.hpp
/// Not API. The one place where unirl's C++ differs between the LibTorch versions it supports
/// (1.13, Debian 12's, through 2.x, Debian 13's 2.6 and the official builds). Everything else
/// calls the helpers here instead of testing versions itself; the CMake side lives in
/// cmake/unirlDependencies.cmake.
///
/// ```cpp
/// #include <unirl/detail/compat.hpp>
/// #if UNIRL_TORCH_VERSION_AT_LEAST(2, 2)
/// ...
/// #endif
/// auto it = opt.state().find(unirl::detail::compat::optimizer_state_key_of(param));
/// ```
#include <string>
#include <type_traits>
#include <utility>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

/// LibTorch's version as one number, e.g. 20600 for 2.6.0 and 11300 for 1.13.0.
#define UNIRL_TORCH_VERSION (TORCH_VERSION_MAJOR * 10000 + TORCH_VERSION_MINOR * 100 + TORCH_VERSION_PATCH)
/// True when the LibTorch being compiled against is at least `major.minor`.
#define UNIRL_TORCH_VERSION_AT_LEAST(major, minor) (UNIRL_TORCH_VERSION >= ((major) * 10000 + (minor) * 100))

/// LibTorch >= 2.2 keys `torch::optim::Optimizer::state()` by the parameter's `TensorImpl*`
/// (as `void*`); 1.13 keys it by that pointer printed into a string (`c10::guts::to_string`,
/// which 2.x removed).
#define UNIRL_TORCH_OPTIMIZER_STATE_BY_POINTER UNIRL_TORCH_VERSION_AT_LEAST(2, 2)

namespace unirl::detail::compat {

/// The key type of `torch::optim::Optimizer::state()` in this LibTorch.
using optimizer_state_key =
    typename std::remove_cvref_t<decltype(std::declval<const torch::optim::Optimizer&>().state())>::key_type;

/// The key under which a LibTorch optimizer keeps the state (moments, step) of parameter `p`.
/// Taking the return type from the map itself makes a wrong version boundary above a compile
/// error here rather than a silent miss at run time.
inline optimizer_state_key optimizer_state_key_of(const torch::Tensor& p) {
#if UNIRL_TORCH_OPTIMIZER_STATE_BY_POINTER
  return static_cast<void*>(p.unsafeGetTensorImpl());
#else
  return c10::guts::to_string(p.unsafeGetTensorImpl());
#endif
}

/// `torch::linear(x, weight, bias)` with x's leading dimensions always folded into one matrix
/// product. LibTorch 1.13's matmul always folds them; 2.x's runs a non-contiguous (..., in) input
/// as a batched product unless the weight requires a gradient, so a frozen copy of trained
/// weights (a LoRA base, a reference model) gives other last bits than the trainable original
/// (up to ~2e-6 relative at width 600). Folded, the result does not depend on `requires_grad`;
/// on 1.13 this is `torch::linear` itself, and on 2.x the same operations in the same order
/// (a contiguous input with a bias: one addmm; otherwise one mm, then the bias added).
inline torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {}) {
#if UNIRL_TORCH_VERSION_AT_LEAST(2, 0)
  if (x.dim() > 2 && !(bias.defined() && x.is_contiguous())) {
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    auto y = torch::matmul(x.reshape({-1, x.size(-1)}), weight.t()).view(sizes);
    if (bias.defined()) y.add_(bias);
    return y;
  }
#endif
  return torch::linear(x, weight, bias);
}

/// `lin.forward(x)` (the C++ frontend's `F::linear`: addmm for a 2-D input with a bias, else a
/// matmul and then `+= bias`) with x's leading dimensions folded, for the reason above; on 1.13
/// `lin.forward(x)` itself.
inline torch::Tensor linear_module(torch::nn::LinearImpl& lin, const torch::Tensor& x) {
#if UNIRL_TORCH_VERSION_AT_LEAST(2, 0)
  if (x.dim() > 2) {
    auto sizes = x.sizes().vec();
    sizes.back() = lin.weight.size(0);
    auto y = x.reshape({-1, x.size(-1)}).matmul(lin.weight.t()).view(sizes);
    if (lin.bias.defined()) y += lin.bias;
    return y;
  }
#endif
  return lin.forward(x);
}

/// Turns LibTorch's autocast for `device` (CPU or CUDA) on with `dtype` as its lower precision, or
/// off. LibTorch >= 2.4 has one call per device type (`set_autocast_enabled(kCPU, ...)`); 1.13
/// has one per backend (`set_cpu_enabled`, `set_enabled` for CUDA), deprecated since.
inline void set_autocast(c10::DeviceType device, bool enabled, at::ScalarType dtype) {
#if UNIRL_TORCH_VERSION_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

/// Whether autocast is on for `device`, and its lower-precision dtype.
inline std::pair<bool, at::ScalarType> autocast_state(c10::DeviceType device) {
#if UNIRL_TORCH_VERSION_AT_LEAST(2, 4)
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
#else
  if (device == c10::DeviceType::CUDA) return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
  return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
#endif
}

/// Whether this LibTorch's CPU autocast takes `dtype` as its lower precision: bfloat16 always,
/// float16 from 2.4 on (1.13 warns and turns autocast off for anything but bfloat16).
inline bool cpu_autocast_supports(at::ScalarType dtype) {
#if UNIRL_TORCH_VERSION_AT_LEAST(2, 4)
  return dtype == at::kBFloat16 || dtype == at::kHalf;
#else
  return dtype == at::kBFloat16;
#endif
}

}  // namespace unirl::detail::compat
