// docs/extending.md, "A new environment": a corridor of cells; the agent starts in cell 0 and
// steps left (action 0) or right (action 1); reaching the last cell pays 1 and ends the episode.
// Then four copies of it train with PPO for one step.
#include <algorithm>
#include <array>
#include <cstdint>
#include <iostream>
#include <random>

#include <torch/torch.h>

#include <unirl/algorithms/ppo_env.hpp>
#include <unirl/concepts/environment.hpp>
#include <unirl/core/error.hpp>
#include <unirl/envs/episodic_env.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/trainer.hpp>

// episodic_env keeps the episode's books: reset(seed), the step count, the time limit, the
// checks before a step and save / load. The state (here the position) must be trivially copyable.
class corridor : public unirl::envs::episodic_env<corridor, std::array<double, 1>> {
  using base = unirl::envs::episodic_env<corridor, std::array<double, 1>>;
  friend base;  // the base calls the private draw_state and observe below

 public:
  static constexpr std::size_t observation_size = 1;  // the position, 0 at the start, 1 at the goal
  using observation_type = std::array<float, observation_size>;
  using action_type = std::int64_t;                    // discrete: 0 = left, 1 = right
  using action_space_type = unirl::discrete_space;     // box_space<D> for continuous actions

  explicit corridor(std::int64_t cells = 5, std::int64_t max_episode_steps = 20)
      : base("corridor", max_episode_steps), cells_(cells) {
    UNIRL_CHECK(cells >= 2, "corridor: cells = ", cells, ": expected >= 2");
  }

  action_space_type action_space() const { return {2}; }

  unirl::step_result<observation_type> step(const action_type& action) {
    check_running("corridor::step");  // throws before reset() and after the episode ended
    UNIRL_CHECK(action_space().contains(action), "corridor::step: action = ", action, ": expected 0 or 1");
    const double x = std::max(0.0, state()[0] + (action == 1 ? 1.0 : -1.0));
    const bool at_goal = x >= static_cast<double>(cells_ - 1);
    const bool truncated = advance({x}, /*terminated=*/at_goal);  // counts the step, applies the time limit
    return {observe(), at_goal ? 1.0 : 0.0, at_goal, truncated};
  }

 private:
  // The start state of reset(seed), from the seeded generator (a corridor always starts in cell 0).
  static state_type draw_state(std::mt19937_64&) { return {0.0}; }
  observation_type observe() const { return {static_cast<float>(state()[0] / static_cast<double>(cells_ - 1))}; }

  std::int64_t cells_;
};
static_assert(unirl::DiscreteEnvironment<corridor>);
static_assert(unirl::Checkpointable<corridor>);  // episodic_env's save / load carry the episode

int main() {
  // On its own: two steps right reach the goal of a 3-cell corridor; a third step is an error.
  corridor env(3);
  env.reset(/*seed=*/0);
  env.step(1);
  const auto last = env.step(1);
  if (!(last.terminated && last.reward == 1.0 && last.observation[0] == 1.0f)) return 1;
  try {
    env.step(1);
    return 1;
  } catch (const unirl::error& e) {
    std::cout << "as expected: " << e.what() << "\n";
  }

  // Four copies stepped together with auto-reset, trained with PPO and the built-in actor-critic.
  torch::manual_seed(0);
  unirl::envs::vector_env<corridor> venv(corridor(5), {.num_envs = 4, .seed = 1});
  using policy = unirl::models::categorical_actor_critic;
  unirl::trainer<policy, unirl::algo::ppo<>, unirl::rewards::environment_reward> t{
      policy(corridor::observation_size, 2), {},
      {.algorithm = {.track = {.rollout_steps = 16}}, .epochs = 2, .minibatches = 2, .progress = false}};
  const auto stats = t.step(venv);  // 16 steps of 4 copies
  std::cout << "corridor: " << stats.samples << " transitions, loss " << stats.loss << "\n";
  return stats.samples == 64 ? 0 : 1;
}
