// Embedding unirl in a host program: the program brings its own simulator — a 2-D lander with a
// main engine and two side thrusters whose thrust lags the command (a first-order motor model) —
// written to unirl's `Environment` concept, and owns the training loop: it calls
// `agent.collect(venv)` and `agent.update()` itself, between its own work, then flies the trained
// policy with its own code. `ppo_agent` runs on the small-network kernels (exec::automatic picks
// them for this 64 x 64 actor-critic; docs/environments.md).
//
//   embedded_lander [--iterations 120] [--seed 1] [--episodes 100]
//
// Prints one line every 10 iterations (mean episode return, landing rate of the rollout's
// episodes) and, at the end, how many of `--episodes` greedy flights from random starts landed.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <random>
#include <string>

#include <torch/torch.h>

#include <unirl/agent.hpp>
#include <unirl/concepts/environment.hpp>
#include <unirl/core/error.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>

// The host's simulator. State: position (x, y), velocity (vx, vy), and the engines' current
// thrust (main, side), which move a fraction `response` of the way to the command each step.
// Actions: 0 idle, 1 main engine, 2 push left, 3 push right. The episode ends on touchdown
// (landed: |x| < 1.5, |vx| < 1, vy > -1.5; else crashed), when the lander leaves the area, or after
// 300 steps. Reward: the change of a shaping potential (closer, lower, slower is better), -0.03
// per step (time) and -0.01 more per step of main engine (fuel), +20 for a landing, -10 for a
// crash or leaving (hovering out the time limit costs -9 and earns nothing).
class lander {
 public:
  static constexpr std::size_t observation_size = 6;
  using observation_type = std::array<float, 6>;
  using action_type = std::int64_t;
  using action_space_type = unirl::discrete_space;

  static constexpr double dt = 0.1, gravity = 1.6, main_thrust = 3.2, side_thrust = 1.0, response = 0.5;
  static constexpr std::int64_t max_steps = 300;

  action_space_type action_space() const { return {4}; }

  observation_type reset(std::uint64_t seed) {
    std::mt19937_64 g(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    x_ = 3.0 * u(g);
    y_ = 5.0 + u(g);
    vx_ = 0.5 * u(g);
    vy_ = 0.5 * u(g);
    main_ = side_ = 0.0;
    steps_ = 0;
    landed_ = false;
    running_ = true;
    return observe();
  }

  unirl::step_result<observation_type> step(const action_type& a) {
    UNIRL_CHECK(running_, "lander::step: the episode ended; call reset first");
    UNIRL_CHECK(action_space().contains(a), "lander::step: action = ", a, ": expected 0, 1, 2 or 3");
    const double before = potential();
    main_ += response * ((a == 1 ? main_thrust : 0.0) - main_);
    side_ += response * ((a == 2 ? -side_thrust : a == 3 ? side_thrust : 0.0) - side_);
    vx_ += dt * side_;
    vy_ += dt * (main_ - gravity);
    x_ += dt * vx_;
    y_ += dt * vy_;
    ++steps_;
    double reward = potential() - before - 0.03 - (a == 1 ? 0.01 : 0.0);
    bool terminated = false;
    if (y_ <= 0.0) {
      terminated = true;
      landed_ = std::abs(x_) < 1.5 && std::abs(vx_) < 1.0 && vy_ > -1.5;
      reward += landed_ ? 20.0 : -10.0;
    } else if (std::abs(x_) > 10.0 || y_ > 15.0) {
      terminated = true;
      reward -= 10.0;
    }
    const bool truncated = !terminated && steps_ >= max_steps;
    running_ = !(terminated || truncated);
    return {observe(), reward, terminated, truncated};
  }

  bool landed() const { return landed_; }

 private:
  double potential() const {
    return -(std::abs(x_) + 0.3 * y_ + std::abs(vx_) + std::abs(vy_));
  }
  observation_type observe() const {
    return {static_cast<float>(x_ / 5.0),  static_cast<float>(y_ / 10.0),   static_cast<float>(vx_ / 2.0),
            static_cast<float>(vy_ / 2.0), static_cast<float>(main_ / main_thrust), static_cast<float>(side_)};
  }

  double x_ = 0, y_ = 0, vx_ = 0, vy_ = 0, main_ = 0, side_ = 0;
  std::int64_t steps_ = 0;
  bool landed_ = false, running_ = false;
};
static_assert(unirl::DiscreteEnvironment<lander>);

int main(int argc, char** argv) try {
  std::int64_t iterations = 120, seed = 1, episodes = 100;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::cout << "usage: embedded_lander [--iterations N] [--seed S] [--episodes E]\n"
                   "  --iterations  PPO iterations of 128 x 8 steps (default 120)\n"
                   "  --seed        the policy's initial weights and the environments' seeds (default 1)\n"
                   "  --episodes    greedy flights flown after training (default 100)\n";
      return 0;
    }
    if (i + 1 >= argc) throw unirl::config_error(k, "flag without a value");
    const std::string v = argv[++i];
    if (k == "--iterations") iterations = std::stoll(v);
    else if (k == "--seed") seed = std::stoll(v);
    else if (k == "--episodes") episodes = std::stoll(v);
    else throw unirl::config_error(k, "unknown flag: expected --iterations, --seed or --episodes");
  }
  UNIRL_CHECK(iterations >= 1 && episodes >= 1, "embedded_lander: --iterations ", iterations, " and --episodes ",
              episodes, ": expected >= 1 each");
  torch::set_num_threads(1);
  torch::manual_seed(static_cast<std::uint64_t>(seed));  // the policy's initial weights

  using agent_t = unirl::ppo_agent<unirl::models::categorical, lander>;
  agent_t::options o;
  o.algorithm.ent_coef = 0.01;
  o.algorithm.track.rollout_steps = 128;
  o.optim.lr = 1e-3;
  o.optim.eps = 1e-5;
  o.schedule.kind = unirl::train::schedule_kind::linear;
  o.total_steps = iterations;
  o.clip.max_grad_norm = 0.5;
  o.epochs = 4;
  o.minibatches = 4;
  o.seed = seed;
  o.progress = false;
  unirl::envs::vector_env<lander> venv({}, {.num_envs = 8, .seed = seed});
  agent_t agent(unirl::models::categorical_actor_critic(lander::observation_size, 4), o);
  std::cout << "embedded_lander: training on the " << agent.path() << " path" << std::endl;

  // The host's loop: its own work between the agent's calls.
  for (std::int64_t it = 1; it <= iterations; ++it) {
    const std::size_t before = venv.episodes().size();
    agent.collect(venv);
    const auto s = agent.update();
    if (it % 10 == 0 || it == iterations) {
      std::cout << "iteration " << it << "/" << iterations << "  env_steps " << venv.env_steps()
                << "  mean_return(last 20) " << venv.mean_recent_return(20) << "  episodes "
                << venv.episodes().size() - before << "  value_loss " << s.value_loss << std::endl;
    }
  }

  // The host flies the trained policy itself.
  const auto policy = agent.policy();
  torch::NoGradGuard ng;
  std::int64_t landed = 0;
  for (std::int64_t e = 0; e < episodes; ++e) {
    lander sim;
    auto obs = sim.reset(1000003ULL * static_cast<std::uint64_t>(seed) + static_cast<std::uint64_t>(e));
    for (;;) {
      const auto a = policy.greedy(torch::from_blob(obs.data(), {1, 6}).clone()).item<std::int64_t>();
      const auto r = sim.step(a);
      obs = r.observation;
      if (r.terminated || r.truncated) break;
    }
    landed += sim.landed() ? 1 : 0;
  }
  std::cout << "greedy flights: landed " << landed << "/" << episodes << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
