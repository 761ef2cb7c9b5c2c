#pragma once
/// \file episodic_env.hpp
/// The episode bookkeeping the classic-control environments (`cartpole`, `pendulum`) share: the
/// time limit (Gym's `TimeLimit`, checked >= 1), `reset(seed)` from a seeded generator,
/// `reset_to(state)`, the step count, the checks before a step (after a reset, not after the end
/// of the episode) and termination / truncation after it. `Derived` provides
/// `state_type draw_state(std::mt19937_64&)` (the initial state of `reset(seed)`) and
/// `observation_type observe() const` (of `state()`), and calls `check_running` and `advance` in
/// its `step`.
///
/// ```cpp
/// class coin : public unirl::envs::episodic_env<coin, std::array<double, 1>> {
///   // friend episodic_env<coin, std::array<double, 1>>; draw_state, observe, step as above
/// };
/// ```
#include <cstdint>
#include <random>

#include <unirl/core/error.hpp>

namespace unirl::envs {

/// CRTP base: episode bookkeeping of an environment `Derived` whose state is `State`.
template <class Derived, class State>
class episodic_env {
 public:
  using state_type = State;

  /// Starts an episode from `Derived::draw_state` of a generator seeded with `seed`.
  auto reset(std::uint64_t seed) {
    rng_.seed(seed);
    state_ = derived().draw_state(rng_);
    return start();
  }

  /// Starts an episode from a given state (tests, demonstrations).
  auto reset_to(const State& s) {
    state_ = s;
    return start();
  }

  const State& state() const { return state_; }
  std::int64_t elapsed_steps() const { return steps_; }
  std::int64_t max_episode_steps() const { return max_steps_; }

 protected:
  /// `name` (e.g. "cartpole") prefixes the error for a `max_episode_steps` below 1.
  episodic_env(const char* name, std::int64_t max_episode_steps) : max_steps_(max_episode_steps) {
    UNIRL_CHECK(max_episode_steps >= 1, name, ": max_episode_steps = ", max_episode_steps, ": expected >= 1");
  }

  /// Throws unless an episode is running; `where` (e.g. "cartpole::step") prefixes the error.
  void check_running(const char* where) const {
    UNIRL_CHECK(started_, where, ": called before reset()");
    UNIRL_CHECK(!done_, where, ": the episode ended (", terminated_ ? "terminated" : "truncated", " after ", steps_,
                " steps); call reset() before stepping again");
  }

  /// Moves to `next` and counts the step; the episode ends if `terminated`, or else is truncated at
  /// the time limit. Returns whether it was truncated.
  bool advance(const State& next, bool terminated) {
    state_ = next;
    ++steps_;
    terminated_ = terminated;
    const bool truncated = !terminated && steps_ >= max_steps_;
    done_ = terminated || truncated;
    return truncated;
  }

 private:
  Derived& derived() { return static_cast<Derived&>(*this); }
  auto start() {
    started_ = true;
    done_ = terminated_ = false;
    steps_ = 0;
    return static_cast<const Derived&>(*this).observe();
  }

  std::int64_t max_steps_;
  State state_{};
  std::mt19937_64 rng_{0};
  std::int64_t steps_ = 0;
  bool started_ = false, done_ = false, terminated_ = false;
};

}  // namespace unirl::envs
