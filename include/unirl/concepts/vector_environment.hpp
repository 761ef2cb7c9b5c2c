#pragma once
/// \file vector_environment.hpp
/// Vectorised environments: N copies of an `Environment` (concepts/environment.hpp) stepped
/// together with auto-reset, as `collect` and PPO on the env track step them.
///
/// ```cpp
/// static_assert(unirl::VectorEnvironment<unirl::envs::vector_env<unirl::envs::cartpole>>);
/// ```
#include <concepts>
#include <cstddef>
#include <cstdint>

#include <torch/torch.h>

namespace unirl {

/// N environment copies stepped together with auto-reset (e.g. `envs::vector_env<E>`).
///
/// Minimal complete definition: `num_envs()`, `observations()` ((N, D) float, current),
/// `dones()` ((N,) float, CleanRL's `next_done`), `step(actions)` returning a struct with
/// `rewards` and `dones` ((N,) float), `env_steps()`, and `episodes()` — a sequence of records
/// with `episode_return` and `length`.
template <class V>
concept VectorEnvironment = requires(V& v, const V& cv, const torch::Tensor& a) {
  { cv.num_envs() } -> std::convertible_to<std::int64_t>;
  { cv.observations() } -> std::convertible_to<torch::Tensor>;
  { cv.dones() } -> std::convertible_to<torch::Tensor>;
  { v.step(a).rewards } -> std::convertible_to<torch::Tensor>;
  { v.step(a).dones } -> std::convertible_to<torch::Tensor>;
  { cv.env_steps() } -> std::convertible_to<std::int64_t>;
  { cv.episodes().size() } -> std::convertible_to<std::size_t>;
  { cv.episodes().back().episode_return } -> std::convertible_to<double>;
  { cv.episodes().back().length } -> std::convertible_to<std::int64_t>;
};

}  // namespace unirl
