#pragma once
/// \file cartpole.hpp
/// CartPole-v1 with Gym's dynamics (Barto, Sutton & Anderson 1983; Gym `classic_control/cartpole.py`):
/// a pole on a cart, pushed left (action 0) or right (action 1) with a force of 10 N, integrated
/// with explicit Euler at tau = 0.02 s. Reward 1 per step, the terminating step included; the
/// episode terminates when |x| > 2.4 or |theta| > 12 degrees and is truncated after 500 steps.
///
/// ```cpp
/// unirl::envs::cartpole env;
/// auto obs = env.reset(7);                       // each component uniform in [-0.05, 0.05]
/// auto r = env.step(std::int64_t{1});            // r.reward == 1.0
/// ```
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

/// CartPole-v1. The state is kept in double precision (as Gym does) and observed as float.
class cartpole : public episodic_env<cartpole, std::array<double, 4>> {
  using base = episodic_env<cartpole, std::array<double, 4>>;
  friend base;

 public:
  static constexpr std::size_t observation_size = 4;
  using observation_type = std::array<float, 4>;  // x, x_dot, theta, theta_dot
  using action_type = std::int64_t;
  using action_space_type = discrete_space;
  using state_type = std::array<double, 4>;

  static constexpr double gravity = 9.8;
  static constexpr double masscart = 1.0;
  static constexpr double masspole = 0.1;
  static constexpr double total_mass = masscart + masspole;
  static constexpr double length = 0.5;  // half the pole's length
  static constexpr double polemass_length = masspole * length;
  static constexpr double force_mag = 10.0;
  static constexpr double tau = 0.02;
  static constexpr double theta_threshold = 12.0 * 2.0 * std::numbers::pi / 360.0;
  static constexpr double x_threshold = 2.4;

  cartpole() : cartpole(500) {}
  /// `max_episode_steps`: the time limit (Gym's `TimeLimit`, 500 for v1); must be >= 1.
  explicit cartpole(std::int64_t max_episode_steps) : base("cartpole", max_episode_steps) {}

  action_space_type action_space() const { return {2}; }

  // reset(seed): the state is drawn uniformly from [-0.05, 0.05]^4 by a generator seeded with
  // `seed`; reset_to(state), state(), elapsed_steps(), max_episode_steps(), save / load: see
  // episodic_env.

  /// Advances one tau. Throws for an action other than 0 or 1 and for a step after the end of an episode.
  step_result<observation_type> step(const action_type& action) {
    check_running("cartpole::step");
    UNIRL_CHECK(action_space().contains(action), "cartpole::step: action = ", action,
                ": expected 0 (push left) or 1 (push right)");
    auto [x, x_dot, theta, theta_dot] = state();
    const double force = action == 1 ? force_mag : -force_mag;
    const double costheta = std::cos(theta), sintheta = std::sin(theta);
    const double temp = (force + polemass_length * theta_dot * theta_dot * sintheta) / total_mass;
    const double thetaacc = (gravity * sintheta - costheta * temp) /
                            (length * (4.0 / 3.0 - masspole * costheta * costheta / total_mass));
    const double xacc = temp - polemass_length * thetaacc * costheta / total_mass;
    x += tau * x_dot;
    x_dot += tau * xacc;
    theta += tau * theta_dot;
    theta_dot += tau * thetaacc;
    const bool terminated =
        x < -x_threshold || x > x_threshold || theta < -theta_threshold || theta > theta_threshold;
    const bool truncated = advance({x, x_dot, theta, theta_dot}, terminated);
    return {observe(), 1.0, terminated, truncated};
  }

 private:
  static state_type draw_state(std::mt19937_64& rng) {
    std::uniform_real_distribution<double> u(-0.05, 0.05);
    state_type s{};
    for (auto& v : s) v = u(rng);
    return s;
  }
  observation_type observe() const {
    const auto& s = state();
    return {static_cast<float>(s[0]), static_cast<float>(s[1]), static_cast<float>(s[2]), static_cast<float>(s[3])};
  }
};
static_assert(DiscreteEnvironment<cartpole>);
static_assert(Checkpointable<cartpole>);

}  // namespace unirl::envs
