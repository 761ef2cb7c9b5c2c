#pragma once
/// \file episodic_env.hpp
/// The episode bookkeeping the classic-control environments (`cartpole`, `pendulum`) share: the
/// time limit (Gym's `TimeLimit`, checked >= 1), `reset(seed)` from a seeded generator,
/// `reset_to(state)`, the step count, the checks before a step (after a reset, not after the end
/// of the episode) and termination / truncation after it. `Derived` provides
/// `state_type draw_state(std::mt19937_64&)` (the initial state of `reset(seed)`) and
/// `observation_type observe() const` (of `state()`), and calls `check_running` and `advance` in
/// its `step`. `save` / `load` (the `unirl::Checkpointable` concept) carry the whole episode state
/// — the state, the step count, the episode flags, the time limit and the generator — through a
/// checkpoint; a `Derived` with state of its own overrides both and calls these.
///
/// ```cpp
/// class coin : public unirl::envs::episodic_env<coin, std::array<double, 1>> {
///   // friend episodic_env<coin, std::array<double, 1>>; draw_state, observe, step as above
/// };
/// ```
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/train/checkpoint.hpp>

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

  /// Writes the environment's name, time limit, state, step count, episode flags and the state of
  /// its generator, so that `load` continues the episode bit for bit.
  void save(torch::serialize::OutputArchive& a) const {
    train::write_scalar(a, "env", std::string(name_));
    train::write_scalar(a, "max_episode_steps", max_steps_);
    auto bytes = torch::empty({static_cast<std::int64_t>(sizeof(State))}, torch::kUInt8);
    std::memcpy(bytes.data_ptr<std::uint8_t>(), &state_, sizeof(State));
    a.write("state", bytes, /*is_buffer=*/true);
    std::ostringstream rng;
    rng << rng_;
    train::write_scalar(a, "rng", rng.str());
    train::write_scalar(a, "elapsed_steps", steps_);
    train::write_scalar(a, "started", started_);
    train::write_scalar(a, "done", done_);
    train::write_scalar(a, "terminated", terminated_);
  }

  /// Restores what `save` wrote. An archive of another environment (its name differs), or with a
  /// missing or malformed entry, throws `unirl::checkpoint_error` and leaves this one unchanged.
  void load(torch::serialize::InputArchive& a) {
    const auto name = train::read_scalar<std::string>(a, "env");
    if (name != name_)
      throw checkpoint_error(std::string(name_) + "::load: the checkpoint holds a '" + name +
                             "' environment; expected '" + name_ + "'");
    const auto max_steps = train::read_scalar<std::int64_t>(a, "max_episode_steps");
    const auto bytes = train::read_tensor(a, "state", name_).contiguous();
    if (bytes.scalar_type() != torch::kUInt8 || bytes.numel() != static_cast<std::int64_t>(sizeof(State)))
      throw checkpoint_error(std::string(name_) + "::load: the stored state has " + std::to_string(bytes.numel()) +
                             " bytes; expected " + std::to_string(sizeof(State)));
    std::mt19937_64 rng;
    std::istringstream text(train::read_scalar<std::string>(a, "rng"));
    text >> rng;
    if (!text) throw checkpoint_error(std::string(name_) + "::load: the stored generator state is malformed");
    const auto steps = train::read_scalar<std::int64_t>(a, "elapsed_steps");
    const bool started = train::read_scalar<bool>(a, "started"), done = train::read_scalar<bool>(a, "done"),
               terminated = train::read_scalar<bool>(a, "terminated");
    if (max_steps < 1 || steps < 0)
      throw checkpoint_error(std::string(name_) + "::load: max_episode_steps = " + std::to_string(max_steps) +
                             ", elapsed_steps = " + std::to_string(steps) + "; expected >= 1 and >= 0");
    std::memcpy(&state_, bytes.data_ptr<std::uint8_t>(), sizeof(State));
    max_steps_ = max_steps;
    rng_ = rng;
    steps_ = steps;
    started_ = started;
    done_ = done;
    terminated_ = terminated;
  }

 protected:
  static_assert(std::is_trivially_copyable_v<State>,
                "unirl::envs::episodic_env: State must be trivially copyable (it is checkpointed as bytes)");

  /// `name` (e.g. "cartpole") prefixes the error for a `max_episode_steps` below 1.
  episodic_env(const char* name, std::int64_t max_episode_steps) : name_(name), max_steps_(max_episode_steps) {
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

  const char* name_;
  std::int64_t max_steps_;
  State state_{};
  std::mt19937_64 rng_{0};
  std::int64_t steps_ = 0;
  bool started_ = false, done_ = false, terminated_ = false;
};

}  // namespace unirl::envs
