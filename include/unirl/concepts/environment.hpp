#pragma once
/// \file environment.hpp
/// Environments for the agent (env) track: reset / step with an observation, a reward and the
/// terminated / truncated flags, over a discrete or a continuous (box) action space.
///
/// ```cpp
/// unirl::envs::cartpole env;
/// auto obs = env.reset(42);                       // std::array<float, 4>
/// auto r = env.step(std::int64_t{1});             // push right
/// if (r.terminated || r.truncated) obs = env.reset(43);
/// ```
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <unirl/core/error.hpp>

namespace unirl {

/// A discrete action space {0, 1, ..., n-1}; actions are `std::int64_t`.
struct discrete_space {
  std::int64_t n = 2;

  /// True when `a` is one of the space's actions.
  bool contains(std::int64_t a) const { return a >= 0 && a < n; }
};

/// A continuous box [low, high]^Dim; actions are `std::array<float, Dim>`.
template <std::size_t Dim>
struct box_space {
  std::array<float, Dim> low{};
  std::array<float, Dim> high{};
  static constexpr std::size_t dim = Dim;

  /// True when every component of `a` is finite and within [low, high].
  bool contains(const std::array<float, Dim>& a) const {
    for (std::size_t i = 0; i < Dim; ++i)
      if (!std::isfinite(a[i]) || a[i] < low[i] || a[i] > high[i]) return false;
    return true;
  }
  /// `a` clipped into the box component-wise (Gym's `ClipAction`); NaN stays NaN.
  std::array<float, Dim> clip(std::array<float, Dim> a) const {
    for (std::size_t i = 0; i < Dim; ++i) a[i] = a[i] < low[i] ? low[i] : (a[i] > high[i] ? high[i] : a[i]);
    return a;
  }
};

namespace detail {
template <class S>
struct is_box_space : std::false_type {};
template <std::size_t D>
struct is_box_space<box_space<D>> : std::true_type {};
}  // namespace detail

/// What `step` returns: the next observation, the reward, and whether the episode ended by
/// reaching a terminal state (`terminated`) or by a time limit (`truncated`).
template <class Observation>
struct step_result {
  Observation observation{};
  double reward = 0.0;
  bool terminated = false;
  bool truncated = false;
};

/// An environment with a fixed-size float observation.
///
/// Minimal complete definition:
/// - `static constexpr std::size_t observation_size` and
///   `using observation_type = std::array<float, observation_size>`;
/// - `using action_space_type` — `discrete_space` or `box_space<D>`;
///   `using action_type` — `std::int64_t` (discrete) or `std::array<float, D>` (box);
/// - `action_space_type action_space() const`;
/// - `observation_type reset(std::uint64_t seed)` — a new episode from a seeded start state;
/// - `step_result<observation_type> step(const action_type&)` — throws `unirl::error` for an
///   action outside the space (NaN included) and for a step after the episode ended without a
///   `reset`.
template <class E>
concept Environment = std::copy_constructible<E> && requires(E& e, const E& ce, std::uint64_t seed,
                                                              const typename E::action_type& a) {
  typename E::observation_type;
  typename E::action_type;
  typename E::action_space_type;
  { E::observation_size } -> std::convertible_to<std::size_t>;
  requires std::same_as<typename E::observation_type, std::array<float, E::observation_size>>;
  { ce.action_space() } -> std::same_as<typename E::action_space_type>;
  { e.reset(seed) } -> std::same_as<typename E::observation_type>;
  { e.step(a) } -> std::same_as<step_result<typename E::observation_type>>;
};

/// An environment with a discrete action space.
template <class E>
concept DiscreteEnvironment = Environment<E> && std::same_as<typename E::action_space_type, discrete_space> &&
                              std::same_as<typename E::action_type, std::int64_t>;

/// An environment with a continuous (box) action space.
template <class E>
concept ContinuousEnvironment =
    Environment<E> && detail::is_box_space<typename E::action_space_type>::value &&
    std::same_as<typename E::action_type, std::array<float, E::action_space_type::dim>>;

}  // namespace unirl
