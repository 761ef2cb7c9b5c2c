#pragma once
/// \file config.hpp
/// Version, namespace macros and the host/device annotation shared by CPU and CUDA code.

#define UNIRL_VERSION_MAJOR 0
#define UNIRL_VERSION_MINOR 1
#define UNIRL_VERSION_PATCH 0

#if defined(__CUDACC__) || defined(__HIPCC__)
#define UNIRL_HOST_DEVICE __host__ __device__
#else
#define UNIRL_HOST_DEVICE
#endif

namespace unirl {
/// The library version as a string, e.g. "0.1.0".
inline constexpr const char* version = "0.1.0";

namespace detail {
/// `static_assert(dependent_false<T>, "...")` in a primary template fails only when instantiated.
template <class...>
inline constexpr bool dependent_false = false;
}  // namespace detail
}  // namespace unirl
