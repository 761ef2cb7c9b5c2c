#pragma once
/// \file pendulum.hpp
/// Pendulum-v1 with Gym's dynamics (`classic_control/pendulum.py`): swing a pendulum up and keep
/// it upright with a torque u in [-2, 2]. Observation (cos theta, sin theta, theta_dot); reward
/// -(angle_normalize(theta)^2 + 0.1 theta_dot^2 + 0.001 u^2) computed on the state before the
/// step; semi-implicit Euler with dt = 0.05, angular speed clipped to [-8, 8]; never terminates,
/// truncated after 200 steps.
///
/// ```cpp
/// unirl::envs::pendulum env;
/// auto obs = env.reset(3);                        // theta ~ U[-pi, pi], theta_dot ~ U[-1, 1]
/// auto r = env.step({0.5f});                      // r.reward <= 0
/// ```
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>

#include <unirl/concepts/environment.hpp>
#include <unirl/core/error.hpp>

namespace unirl::envs {

/// Pendulum-v1. The state is kept in double precision and observed as float.
class pendulum {
 public:
  static constexpr std::size_t observation_size = 3;
  using observation_type = std::array<float, 3>;  // cos theta, sin theta, theta_dot
  using action_type = std::array<float, 1>;       // torque
  using action_space_type = box_space<1>;
  using state_type = std::array<double, 2>;       // theta, theta_dot

  static constexpr double max_speed = 8.0;
  static constexpr double max_torque = 2.0;
  static constexpr double dt = 0.05;
  static constexpr double g = 10.0;
  static constexpr double m = 1.0;
  static constexpr double l = 1.0;

  pendulum() : pendulum(200) {}
  /// `max_episode_steps`: the time limit (Gym's `TimeLimit`, 200 for v1); must be >= 1.
  explicit pendulum(std::int64_t max_episode_steps) : max_steps_(max_episode_steps) {
    UNIRL_CHECK(max_episode_steps >= 1, "pendulum: max_episode_steps = ", max_episode_steps, ": expected >= 1");
  }

  action_space_type action_space() const {
    return {{static_cast<float>(-max_torque)}, {static_cast<float>(max_torque)}};
  }

  /// An angle wrapped into [-pi, pi).
  static double angle_normalize(double x) {
    const double two_pi = 2.0 * std::numbers::pi;
    double y = std::fmod(x + std::numbers::pi, two_pi);
    if (y < 0) y += two_pi;
    return y - std::numbers::pi;
  }

  /// Starts an episode: theta ~ U[-pi, pi], theta_dot ~ U[-1, 1] from a generator seeded with `seed`.
  observation_type reset(std::uint64_t seed) {
    rng_.seed(seed);
    std::uniform_real_distribution<double> th(-std::numbers::pi, std::numbers::pi), thdot(-1.0, 1.0);
    state_[0] = th(rng_);
    state_[1] = thdot(rng_);
    return start();
  }

  /// Starts an episode from a given (theta, theta_dot).
  observation_type reset_to(const state_type& s) {
    state_ = s;
    return start();
  }

  /// Applies torque `u` for dt. Throws for a NaN or out-of-range torque and for a step after the end.
  step_result<observation_type> step(const action_type& action) {
    UNIRL_CHECK(started_, "pendulum::step: called before reset()");
    UNIRL_CHECK(!done_, "pendulum::step: the episode was truncated after ", steps_,
                " steps; call reset() before stepping again");
    UNIRL_CHECK(action_space().contains(action), "pendulum::step: torque = ", action[0],
                ": expected a finite value in [", -max_torque, ", ", max_torque, "]");
    const double u = action[0];
    const auto [th, thdot] = state_;
    const double an = angle_normalize(th);
    const double cost = an * an + 0.1 * thdot * thdot + 0.001 * u * u;
    double newthdot = thdot + (3.0 * g / (2.0 * l) * std::sin(th) + 3.0 / (m * l * l) * u) * dt;
    newthdot = std::clamp(newthdot, -max_speed, max_speed);
    const double newth = th + newthdot * dt;
    state_ = {newth, newthdot};
    ++steps_;
    done_ = steps_ >= max_steps_;
    return {observe(), -cost, false, done_};
  }

  const state_type& state() const { return state_; }
  std::int64_t elapsed_steps() const { return steps_; }
  std::int64_t max_episode_steps() const { return max_steps_; }

 private:
  observation_type start() {
    started_ = true;
    done_ = false;
    steps_ = 0;
    return observe();
  }
  observation_type observe() const {
    return {static_cast<float>(std::cos(state_[0])), static_cast<float>(std::sin(state_[0])),
            static_cast<float>(state_[1])};
  }

  std::int64_t max_steps_;
  state_type state_{};
  std::mt19937_64 rng_{0};
  std::int64_t steps_ = 0;
  bool started_ = false, done_ = false;
};
static_assert(ContinuousEnvironment<pendulum>);

}  // namespace unirl::envs
