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
#include <unirl/envs/episodic_env.hpp>
#include <unirl/train/checkpoint.hpp>

namespace unirl::envs {

/// Pendulum-v1. The state is kept in double precision and observed as float.
class pendulum : public episodic_env<pendulum, std::array<double, 2>> {
  using base = episodic_env<pendulum, std::array<double, 2>>;
  friend base;

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
  explicit pendulum(std::int64_t max_episode_steps) : base("pendulum", max_episode_steps) {}

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

  // reset(seed): theta ~ U[-pi, pi], theta_dot ~ U[-1, 1] from a generator seeded with `seed`;
  // reset_to({theta, theta_dot}), state(), elapsed_steps(), max_episode_steps(), save / load: see
  // episodic_env.

  /// Applies torque `u` for dt. Throws for a NaN or out-of-range torque and for a step after the end.
  step_result<observation_type> step(const action_type& action) {
    check_running("pendulum::step");
    UNIRL_CHECK(action_space().contains(action), "pendulum::step: torque = ", action[0],
                ": expected a finite value in [", -max_torque, ", ", max_torque, "]");
    const double u = action[0];
    const auto [th, thdot] = state();
    const double an = angle_normalize(th);
    const double cost = an * an + 0.1 * thdot * thdot + 0.001 * u * u;
    double newthdot = thdot + (3.0 * g / (2.0 * l) * std::sin(th) + 3.0 / (m * l * l) * u) * dt;
    newthdot = std::clamp(newthdot, -max_speed, max_speed);
    const double newth = th + newthdot * dt;
    const bool truncated = advance({newth, newthdot}, false);
    return {observe(), -cost, false, truncated};
  }

 private:
  static state_type draw_state(std::mt19937_64& rng) {
    std::uniform_real_distribution<double> th(-std::numbers::pi, std::numbers::pi), thdot(-1.0, 1.0);
    const double theta = th(rng);
    return {theta, thdot(rng)};
  }
  observation_type observe() const {
    const auto& s = state();
    return {static_cast<float>(std::cos(s[0])), static_cast<float>(std::sin(s[0])), static_cast<float>(s[1])};
  }
};
static_assert(ContinuousEnvironment<pendulum>);
static_assert(Checkpointable<pendulum>);

}  // namespace unirl::envs
