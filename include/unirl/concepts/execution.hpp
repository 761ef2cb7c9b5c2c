#pragma once
/// \file execution.hpp
/// Execution (kernel) policies: which implementation of a hot op runs.
#include <concepts>

#include <torch/torch.h>

namespace unirl {

/// The implementations an op may have.
enum class backend { reference, cpu, cuda };

/// An execution policy.
///
/// Minimal complete definition: `static backend select(const torch::Tensor& t)` — the
/// implementation to use for an op whose main input is `t` (constexpr-free: `automatic`
/// decides from the tensor's device at run time).
template <class E>
concept ExecutionPolicy = requires(const torch::Tensor& t) {
  { E::select(t) } -> std::same_as<backend>;
};

}  // namespace unirl
