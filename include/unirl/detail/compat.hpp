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

}  // namespace unirl::detail::compat
