// Environment track: CartPole / Pendulum dynamics against Gym's formulas, the vectorised runner
// (auto-reset, episode statistics, action clipping, normalisation), the actor-critic policies,
// rollout collection, PPO's env-track stages, a short CartPole training run, and checkpoints that
// carry the environments with the model (bit-identical resume).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <numbers>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/advantage.hpp>
#include <unirl/algorithms/ppo_env.hpp>
#include <unirl/concepts/environment.hpp>
#include <unirl/data/canvas.hpp>
#include <unirl/envs/canvas_click.hpp>
#include <unirl/envs/cartpole.hpp>
#include <unirl/envs/pendulum.hpp>
#include <unirl/envs/vector_env.hpp>
#include <unirl/models/actor_critic.hpp>
#include <unirl/rewards/environment.hpp>
#include <unirl/rollout/env.hpp>
#include <unirl/trainer.hpp>

#include <common/digits.hpp>

using Catch::Matchers::Contains;
using unirl::envs::cartpole;
using unirl::envs::pendulum;
using unirl::envs::vector_env;
// PPO for the env track: the family ppo<> bound to env_track (its options nest rollout_steps under .track).
using env_ppo = unirl::algo::ppo<>::for_track<unirl::env_track>;

// PPO trains the built-in actor-critics on the built-in environments (asserted here, where they
// are included: algorithms/ppo_env.hpp names no concrete model or environment).
static_assert(unirl::VectorEnvironment<vector_env<cartpole>>);
static_assert(unirl::VectorEnvironment<vector_env<pendulum>>);
static_assert(unirl::AlgorithmFor<unirl::algo::ppo<>, unirl::models::categorical_actor_critic>);
static_assert(unirl::AlgorithmFor<unirl::algo::ppo<>, unirl::models::gaussian_actor_critic>);
static_assert(unirl::SamplesFrom<unirl::algo::ppo<>, unirl::models::categorical_actor_critic, vector_env<cartpole>>);
static_assert(unirl::SamplesFrom<unirl::algo::ppo<>, unirl::models::gaussian_actor_critic, vector_env<pendulum>>);

namespace {

// Gym's CartPole step, written out independently of the library (cartpole.py, euler).
std::array<double, 4> gym_cartpole_step(std::array<double, 4> s, int action) {
  const double g = 9.8, mc = 1.0, mp = 0.1, l = 0.5, tau = 0.02, total = mc + mp, pml = mp * l;
  const double f = action == 1 ? 10.0 : -10.0;
  const double c = std::cos(s[2]), si = std::sin(s[2]);
  const double temp = (f + pml * s[3] * s[3] * si) / total;
  const double thacc = (g * si - c * temp) / (l * (4.0 / 3.0 - mp * c * c / total));
  const double xacc = temp - pml * thacc * c / total;
  return {s[0] + tau * s[1], s[1] + tau * xacc, s[2] + tau * s[3], s[3] + tau * thacc};
}

// Gym's Pendulum step: (new state, reward).
std::pair<std::array<double, 2>, double> gym_pendulum_step(std::array<double, 2> s, double u) {
  u = std::clamp(u, -2.0, 2.0);
  const double an = std::remainder(s[0], 2 * std::numbers::pi);
  const double cost = an * an + 0.1 * s[1] * s[1] + 0.001 * u * u;
  double thd = s[1] + (3 * 10.0 / 2.0 * std::sin(s[0]) + 3.0 * u) * 0.05;
  thd = std::clamp(thd, -8.0, 8.0);
  return {{s[0] + thd * 0.05, thd}, -cost};
}

// PPO on `venv` with the settings both training tests share (Adam eps 1e-5 at `lr` annealed
// linearly over `total_steps`, max grad norm 0.5, seed 1) for `iterations` steps, `on_step`
// called with each step's statistics. Returns the mean return of the last 20 episodes after the
// first iteration and after the last.
template <class Policy, class Env, class OnStep>
std::pair<double, double> train_ppo(vector_env<Env>& venv, Policy policy, const env_ppo::options& algo,
                                    double lr, std::int64_t epochs, std::int64_t minibatches, std::int64_t total_steps,
                                    std::int64_t iterations, OnStep&& on_step) {
  using trainer_t = unirl::trainer<Policy, unirl::algo::ppo<>, unirl::rewards::environment_reward>;
  trainer_t t{std::move(policy),
              {},
              {.algorithm = algo,
               .optim = {.lr = lr, .eps = 1e-5},
               .schedule = {.kind = unirl::train::schedule_kind::linear},
               .clip = {.max_grad_norm = 0.5},
               .epochs = epochs,
               .minibatches = minibatches,
               .seed = 1,
               .progress = false,
               .total_steps = total_steps}};
  double first_return = 0;
  for (std::int64_t it = 0; it < iterations; ++it) {
    on_step(t.step(venv));
    if (it == 0) first_return = venv.mean_recent_return(20);
  }
  return {first_return, venv.mean_recent_return(20)};
}

}  // namespace

TEST_CASE("cartpole follows Gym's dynamics on a known trajectory", "[cpu][env]") {
  cartpole env;
  const auto obs0 = env.reset_to({0.01, -0.02, 0.03, 0.04});
  CHECK(obs0[0] == Approx(0.01f));
  // Gym CartPole-v1 from (0.01, -0.02, 0.03, 0.04) with actions 1, 0, 1, 1, 0 (float64 trajectory).
  const std::array<std::array<double, 4>, 5> expected{{
      {0.009600000000000001, 0.17467919574755525, 0.030799999999999998, -0.24306871796000815},
      {0.013093583914951107, -0.020868848948191993, 0.025938625640799833, 0.05916799993941654},
      {0.012676206935987267, 0.1738717748734813, 0.027121985639588165, -0.22521957255967331},
      {0.016153642433456895, 0.36859581150093934, 0.0226175941883947, -0.5092253183122191},
      {0.023525558663475683, 0.17316263692575581, 0.012433087822150319, -0.2095015286811472},
  }};
  const int actions[] = {1, 0, 1, 1, 0};
  for (int t = 0; t < 5; ++t) {
    const auto r = env.step(actions[t]);
    CHECK(r.reward == 1.0);
    CHECK_FALSE(r.terminated);
    CHECK_FALSE(r.truncated);
    for (int i = 0; i < 4; ++i) {
      CHECK(env.state()[i] == Approx(expected[t][i]).epsilon(1e-12).margin(1e-15));
      CHECK(r.observation[i] == static_cast<float>(env.state()[i]));
    }
  }
  // Longer: 200 steps of a fixed action pattern, against the formula above.
  std::array<double, 4> s{0.0, 0.0, 0.001, 0.0};
  env.reset_to(s);
  for (int t = 0; t < 30; ++t) {
    const int a = (t % 3 == 0) ? 1 : 0;
    s = gym_cartpole_step(s, a);
    const auto r = env.step(a);
    for (int i = 0; i < 4; ++i) REQUIRE(env.state()[i] == Approx(s[i]).epsilon(1e-12).margin(1e-15));
    if (r.terminated) break;
  }
}

TEST_CASE("cartpole terminates past 12 degrees, pays the last step, then refuses to step", "[cpu][env]") {
  cartpole env;
  env.reset_to({0.0, 0.0, 0.0, 0.0});
  // Pushing right from rest tips the pole left: theta = -0.21519 < -12 deg at the 9th step.
  for (int t = 1; t <= 9; ++t) {
    const auto r = env.step(1);
    CHECK(r.reward == 1.0);
    CHECK(r.terminated == (t == 9));
    CHECK_FALSE(r.truncated);
  }
  CHECK(env.state()[2] == Approx(-0.21518604988500967).epsilon(1e-12));
  CHECK(env.state()[2] < -cartpole::theta_threshold);
  CHECK(cartpole::theta_threshold == Approx(0.20943951023931953));
  CHECK_THROWS_WITH(env.step(0), Contains("reset()") && Contains("terminated after 9 steps"));
  env.reset(3);
  CHECK_NOTHROW(env.step(0));

  // The cart leaving |x| <= 2.4 terminates too.
  env.reset_to({2.39, 1.0, 0.0, 0.0});
  CHECK(env.step(1).terminated);
  env.reset_to({-2.39, -1.0, 0.0, 0.0});
  CHECK(env.step(0).terminated);
}

TEST_CASE("cartpole truncates at its time limit and resets deterministically", "[cpu][env]") {
  CHECK(cartpole{}.max_episode_steps() == 500);
  cartpole env(5);
  env.reset_to({0.0, 0.0, 0.0, 0.0});
  for (int t = 1; t <= 5; ++t) {
    const auto r = env.step(t % 2);  // alternate: stays upright
    CHECK_FALSE(r.terminated);
    CHECK(r.truncated == (t == 5));
  }
  CHECK_THROWS_WITH(env.step(0), Contains("truncated after 5 steps"));

  cartpole a, b;
  const auto oa = a.reset(42), ob = b.reset(42), oc = b.reset(43);
  CHECK(oa == ob);
  CHECK(oa != oc);
  for (float v : oa) CHECK(std::abs(v) <= 0.05f);
  CHECK_THROWS_WITH(cartpole(0), Contains("max_episode_steps = 0"));
}

TEST_CASE("cartpole rejects actions outside {0, 1} and stepping before reset", "[cpu][env]") {
  cartpole env;
  CHECK_THROWS_WITH(env.step(1), Contains("before reset"));
  env.reset(0);
  CHECK_THROWS_WITH(env.step(2), Contains("action = 2") && Contains("expected 0"));
  CHECK_THROWS_WITH(env.step(-1), Contains("action = -1"));
  CHECK_NOTHROW(env.step(1));
}

TEST_CASE("pendulum follows Gym's dynamics and reward", "[cpu][env]") {
  pendulum env;
  env.reset_to({1.0, 0.5});
  auto r = env.step({1.0f});
  // By hand: cost = 1 + 0.1 * 0.25 + 0.001 = 1.026; thdot' = 0.5 + (15 sin 1 + 3) 0.05; th' = 1 + 0.05 thdot'.
  CHECK(r.reward == Approx(-1.026).epsilon(1e-12));
  const double thd = 0.5 + (15.0 * std::sin(1.0) + 3.0) * 0.05;
  CHECK(env.state()[1] == Approx(thd).epsilon(1e-12));
  CHECK(env.state()[0] == Approx(1.0 + 0.05 * thd).epsilon(1e-12));
  CHECK(r.observation[0] == Approx(std::cos(1.0 + 0.05 * thd)));
  CHECK(r.observation[1] == Approx(std::sin(1.0 + 0.05 * thd)));
  CHECK_FALSE(r.terminated);

  // Angular speed is clipped to 8; the angle in the cost is wrapped into [-pi, pi).
  env.reset_to({std::numbers::pi / 2, 7.9});
  r = env.step({2.0f});
  CHECK(env.state()[1] == 8.0);
  env.reset_to({3 * std::numbers::pi / 2, 0.0});
  r = env.step({0.0f});
  CHECK(r.reward == Approx(-(std::numbers::pi / 2) * (std::numbers::pi / 2)).epsilon(1e-12));
  CHECK(pendulum::angle_normalize(3 * std::numbers::pi / 2) == Approx(-std::numbers::pi / 2));
  CHECK(pendulum::angle_normalize(-0.5) == Approx(-0.5));

  // 60 steps of varying torque against the formula.
  std::array<double, 2> s{-2.5, 0.3};
  env.reset_to(s);
  for (int t = 0; t < 60; ++t) {
    const double u = 2.0 * std::sin(0.37 * t);
    const auto [ns, rew] = gym_pendulum_step(s, static_cast<float>(u));
    s = ns;
    const auto rr = env.step({static_cast<float>(u)});
    REQUIRE(rr.reward == Approx(rew).epsilon(1e-9));
    REQUIRE(env.state()[0] == Approx(s[0]).epsilon(1e-12));
    REQUIRE(env.state()[1] == Approx(s[1]).epsilon(1e-12));
  }
}

TEST_CASE("pendulum truncates at 200 steps and rejects NaN or out-of-range torque", "[cpu][env]") {
  pendulum env;
  const auto o = env.reset(9);
  CHECK(o[0] * o[0] + o[1] * o[1] == Approx(1.0f));
  CHECK(std::abs(o[2]) <= 1.0f);
  CHECK_THROWS_WITH(env.step({std::numeric_limits<float>::quiet_NaN()}), Contains("torque = nan"));
  CHECK_THROWS_WITH(env.step({2.5f}), Contains("torque = 2.5") && Contains("[-2, 2]"));
  CHECK_THROWS_WITH(env.step({-3.0f}), Contains("torque = -3"));
  for (int t = 1; t <= 200; ++t) {
    const auto r = env.step({0.0f});
    CHECK_FALSE(r.terminated);
    REQUIRE(r.truncated == (t == 200));
  }
  CHECK_THROWS_WITH(env.step({0.0f}), Contains("truncated after 200 steps"));
}

TEST_CASE("vector_env auto-resets, records episodes and checks action shapes", "[cpu][env]") {
  vector_env<cartpole> venv(cartpole(3), {.num_envs = 2, .seed = 5});
  CHECK(venv.observations().sizes() == torch::IntArrayRef({2, 4}));
  CHECK(venv.dones().sum().item<float>() == 0.0f);
  // Copy i starts from seed + i, like a fresh environment reset with that seed.
  cartpole ref;
  const auto o6 = ref.reset(6);
  for (int i = 0; i < 4; ++i) CHECK(venv.observations()[1][i].item<float>() == o6[i]);
  CHECK(std::isnan(venv.mean_recent_return(20)));

  const auto push = torch::ones({2}, torch::kLong);
  for (int t = 1; t <= 7; ++t) {
    const auto out = venv.step(push);
    CHECK(out.rewards.sizes() == torch::IntArrayRef({2}));
    CHECK(out.rewards.sum().item<float>() == 2.0f);
    const float expect_done = (t % 3 == 0) ? 1.0f : 0.0f;
    CHECK(out.dones[0].item<float>() == expect_done);
    CHECK(out.truncated[1].item<bool>() == (t % 3 == 0));
    CHECK(venv.dones().equal(out.dones));
    if (t % 3 == 0)  // already the first observation of the next episode
      CHECK(out.observations.abs().max().item<float>() <= 0.05f);
    else
      CHECK(out.observations.select(1, 1).abs().max().item<float>() > 0.1f);  // x_dot after pushes
  }
  REQUIRE(venv.episodes().size() == 4);
  for (const auto& e : venv.episodes()) {
    CHECK(e.episode_return == 3.0);
    CHECK(e.length == 3);
  }
  CHECK(venv.env_steps() == 14);
  CHECK(venv.mean_recent_return(20) == 3.0);
  CHECK(venv.mean_recent_length(1) == 3.0);

  CHECK_THROWS_WITH(venv.step(torch::ones({3}, torch::kLong)), Contains("expected (2,) integers"));
  CHECK_THROWS_WITH(venv.step(torch::ones({2})), Contains("expected (2,) integers"));
  CHECK_THROWS_WITH(venv.step(torch::full({2}, 7, torch::kLong)), Contains("action = 7"));
  CHECK_THROWS_AS((vector_env<cartpole>({}, {.num_envs = 0})), unirl::config_error);
  CHECK_THROWS_WITH((vector_env<cartpole>({}, {.num_envs = 0})), Contains("num_envs") && Contains("value 0"));
}

TEST_CASE("vector_env clips box actions like ClipAction, but never a NaN", "[cpu][env]") {
  vector_env<pendulum> clipped({}, {.num_envs = 1, .seed = 2});
  pendulum ref;
  auto s0 = ref.reset(2);
  (void)s0;
  const auto out = clipped.step(torch::full({1, 1}, 5.0f));
  const auto r = ref.step({2.0f});  // 5 clipped to the bound 2
  CHECK(out.rewards[0].item<float>() == Approx(static_cast<float>(r.reward)));
  CHECK(out.observations[0][2].item<float>() == r.observation[2]);
  CHECK_THROWS_WITH(clipped.step(torch::full({1, 1}, std::numeric_limits<float>::quiet_NaN())), Contains("nan"));
  CHECK_THROWS_WITH(clipped.step(torch::zeros({1, 2})), Contains("expected (1, 1) floats"));

  vector_env<pendulum> strict({}, {.num_envs = 1, .seed = 2, .clip_actions = false});
  CHECK_THROWS_WITH(strict.step(torch::full({1, 1}, 5.0f)), Contains("torque = 5"));
}

TEST_CASE("running_mean_std matches the statistics of all data seen", "[cpu][env]") {
  torch::manual_seed(0);
  unirl::envs::running_mean_std rms(3);
  const auto a = torch::randn({50, 3}, torch::kDouble) * 2 + 1, b = torch::randn({70, 3}, torch::kDouble) - 3;
  rms.update(a);
  rms.update(b);
  const auto all = torch::cat({a, b});
  // The prior (mean 0, var 1, count 1e-4) weighs 1e-4 / 120 of the result.
  CHECK(torch::allclose(rms.mean, all.mean(0), 1e-4, 1e-4));
  CHECK(torch::allclose(rms.var, all.var(0, /*unbiased=*/false), 1e-4, 1e-4));
}

TEST_CASE("vector_env normalises rewards by the running std of the discounted return", "[cpu][env]") {
  vector_env<cartpole> venv({}, {.num_envs = 1, .seed = 1, .normalize_reward = true, .reward_gamma = 0.9,
                                 .reward_clip = 1e9});
  // Reference: Gym's NormalizeReward with RunningMeanStd over the discounted return.
  double mean = 0, var = 1, count = 1e-4, ret = 0;
  for (int t = 0; t < 40; ++t) {
    const auto out = venv.step(torch::tensor({static_cast<std::int64_t>(t % 2)}));
    ret = ret * 0.9 + 1.0;
    const double delta = ret - mean, tot = count + 1;
    mean += delta / tot;
    var = (var * count + delta * delta * count / tot) / tot;
    count = tot;
    REQUIRE(out.rewards[0].item<float>() == Approx(1.0 / std::sqrt(var + 1e-8)).epsilon(1e-5));
    if (out.dones[0].item<float>() != 0) ret = 0;
  }
  // With the default clip of 10 the first normalised reward (1 / sqrt(~2e-4) = 70) is clipped.
  vector_env<cartpole> clipped({}, {.num_envs = 1, .normalize_reward = true});
  CHECK(clipped.step(torch::tensor({std::int64_t{0}})).rewards[0].item<float>() == 10.0f);
}

TEST_CASE("vector_env normalises observations with running statistics", "[cpu][env]") {
  vector_env<pendulum> venv({}, {.num_envs = 8, .seed = 3, .normalize_observation = true});
  for (int t = 0; t < 300; ++t) venv.step(torch::zeros({8, 1}));
  const auto& st = venv.observation_statistics();
  const auto raw = (venv.observations().to(torch::kDouble) * torch::sqrt(st.var + 1e-8) + st.mean);
  CHECK(venv.observations().abs().max().item<float>() <= 10.0f);
  // Un-normalised, the first two components are cos / sin of an angle: on the unit circle.
  const auto radius = raw.select(1, 0).square() + raw.select(1, 1).square();
  CHECK(torch::allclose(radius, torch::ones_like(radius), 1e-4, 1e-4));
}

TEST_CASE("actor_critic uses CleanRL's orthogonal initialisation", "[cpu][env]") {
  torch::manual_seed(0);
  unirl::models::categorical_actor_critic pi(4, 2);
  const auto& net = pi.net();
  auto linear = [](torch::nn::Sequential s, std::size_t i) { return s[i]->as<torch::nn::Linear>(); };
  const auto w0 = linear(net->actor, 0)->weight;  // (64, 4): orthonormal columns times sqrt(2)
  CHECK(torch::allclose(w0.t().mm(w0), 2.0 * torch::eye(4), 1e-4, 1e-4));
  const auto w1 = linear(net->actor, 2)->weight;  // (64, 64)
  CHECK(torch::allclose(w1.mm(w1.t()), 2.0 * torch::eye(64), 1e-4, 1e-4));
  const auto head = linear(net->actor, 4)->weight;  // (2, 64): rows of norm 0.01, orthogonal
  CHECK(torch::allclose(head.mm(head.t()), 1e-4 * torch::eye(2), 1e-7, 1e-8));
  const auto vhead = linear(net->critic, 4)->weight;  // (1, 64): norm 1
  CHECK(vhead.norm().item<double>() == Approx(1.0).epsilon(1e-5));
  for (const auto& [name, p] : pi.named_parameters())
    if (name.ends_with("bias")) CHECK(p.abs().max().item<double>() == 0.0);
  CHECK(pi.named_parameters().size() == 12);

  unirl::models::gaussian_actor_critic mu(3, 1, {.init_log_std = -0.5});
  CHECK(mu.net()->log_std.sizes() == torch::IntArrayRef({1, 1}));
  CHECK(mu.net()->log_std.item<float>() == -0.5f);
  CHECK(mu.named_parameters().size() == 13);
  CHECK_THROWS_WITH(unirl::models::categorical_actor_critic(4, 1), Contains("action_dim = 1"));
  CHECK_THROWS_AS(unirl::models::categorical_actor_critic(4, 2, {.hidden = {64, 0}}), unirl::config_error);
  CHECK_THROWS_WITH(pi.act(torch::zeros({2, 3})), Contains("expected (B, 4)"));
}

TEST_CASE("categorical policy: log-probs, entropy and sampling frequencies", "[cpu][env]") {
  torch::manual_seed(1);
  unirl::models::categorical_actor_critic pi(4, 3, {.actor_gain = 1.0});
  const auto obs = torch::randn({5, 4});
  const auto actions = torch::tensor({0, 2, 1, 1, 0}, torch::kLong);
  const auto e = pi.evaluate(obs, actions);
  const auto logits = pi.net()->actor->forward(obs);
  const auto p = torch::softmax(logits.to(torch::kDouble), -1);
  for (int i = 0; i < 5; ++i) {
    CHECK(e.logp[i].item<double>() == Approx(std::log(p[i][actions[i].item<std::int64_t>()].item<double>())).epsilon(1e-5));
    double h = 0;
    for (int k = 0; k < 3; ++k) h -= p[i][k].item<double>() * std::log(p[i][k].item<double>());
    CHECK(e.entropy[i].item<double>() == Approx(h).epsilon(1e-5));
  }
  CHECK(torch::allclose(e.value, pi.value(obs)));
  CHECK_THROWS_WITH(pi.evaluate(obs, torch::zeros({5})), Contains("integers"));

  // The sampled actions follow the distribution, and act()'s log-prob is evaluate()'s.
  const auto one = obs.slice(0, 0, 1).expand({20000, 4}).contiguous();
  const auto a = pi.act(one);
  CHECK(torch::allclose(a.logp, pi.evaluate(one, a.action).logp));
  for (int k = 0; k < 3; ++k) {
    const double freq = (a.action == k).to(torch::kDouble).mean().item<double>();
    const double pk = p[0][k].item<double>();
    CHECK(std::abs(freq - pk) < 4.5 * std::sqrt(pk * (1 - pk) / 20000) + 1e-9);
  }
  CHECK(pi.greedy(obs.slice(0, 0, 1)).item<std::int64_t>() == logits[0].argmax().item<std::int64_t>());
}

TEST_CASE("diagonal-Gaussian policy: log-prob, entropy, gradient and sampling", "[cpu][env]") {
  torch::manual_seed(2);
  unirl::models::gaussian_actor_critic pi(3, 2, {.init_log_std = 0.3, .actor_gain = 1.0});
  const auto obs = torch::randn({4, 3});
  const auto actions = torch::randn({4, 2});
  const auto e = pi.evaluate(obs, actions);
  const auto mean = pi.net()->actor->forward(obs).detach().to(torch::kDouble);
  const double ls = 0.3, sd = std::exp(0.3);
  for (int i = 0; i < 4; ++i) {
    double lp = 0;
    for (int k = 0; k < 2; ++k) {
      const double z = (actions[i][k].item<double>() - mean[i][k].item<double>()) / sd;
      lp += -0.5 * z * z - ls - 0.5 * std::log(2 * std::numbers::pi);
    }
    CHECK(e.logp[i].item<double>() == Approx(lp).epsilon(1e-5));
    CHECK(e.entropy[i].item<double>() == Approx(2 * (0.5 + 0.5 * std::log(2 * std::numbers::pi) + ls)).epsilon(1e-6));
  }
  // d logp / d log_std against a central finite difference (float64 copy of the model).
  auto pd = pi.clone();
  pd.net()->to(torch::kDouble);
  auto logp_sum = [&] { return pd.evaluate(obs.to(torch::kDouble), actions.to(torch::kDouble)).logp.sum(); };
  pd.net()->log_std.mutable_grad() = torch::Tensor();
  logp_sum().backward();
  const auto g = pd.net()->log_std.grad().clone();
  for (int k = 0; k < 2; ++k) {
    torch::NoGradGuard ng;
    const double h = 1e-6;
    pd.net()->log_std[0][k] += h;
    const double up = logp_sum().item<double>();
    pd.net()->log_std[0][k] -= 2 * h;
    const double down = logp_sum().item<double>();
    pd.net()->log_std[0][k] += h;
    CHECK(g[0][k].item<double>() == Approx((up - down) / (2 * h)).epsilon(1e-6));
  }
  // Samples: mean and std of N(mean, exp(0.3)^2), and act()'s log-prob is evaluate()'s.
  const auto one = obs.slice(0, 0, 1).expand({20000, 3}).contiguous();
  const auto a = pi.act(one);
  CHECK(torch::allclose(a.logp, pi.evaluate(one, a.action).logp, 1e-5, 1e-5));
  const auto m = a.action.mean(0).to(torch::kDouble), s = a.action.std(0).to(torch::kDouble);
  for (int k = 0; k < 2; ++k) {
    CHECK(std::abs(m[k].item<double>() - mean[0][k].item<double>()) < 4.5 * sd / std::sqrt(20000.0));
    CHECK(s[k].item<double>() == Approx(sd).epsilon(0.03));
  }
  CHECK(torch::allclose(pi.greedy(obs), pi.net()->actor->forward(obs)));
}

TEST_CASE("collect lays out (T, N) rows with CleanRL's done convention", "[cpu][env]") {
  torch::manual_seed(3);
  unirl::models::categorical_actor_critic pi(4, 2);
  vector_env<cartpole> venv(cartpole(3), {.num_envs = 2, .seed = 1});
  std::map<std::string, double> extra;
  const unirl::step_info info{0, 1, torch::kCPU, &extra};
  const auto first_obs = venv.observations().clone();
  const auto r = unirl::collect(pi, venv, 10, &info);
  CHECK(r.size() == 20);
  CHECK(r.num_steps == 10);
  CHECK(r.num_envs == 2);
  CHECK(r.obs.sizes() == torch::IntArrayRef({20, 4}));
  CHECK(r.actions.scalar_type() == torch::kLong);
  CHECK(torch::equal(r.obs.slice(0, 0, 2), first_obs));
  // Episodes of 3 steps end at steps 2, 5, 8: observations 3, 6, 9 start new ones.
  const auto d = r.dones.view({10, 2});
  for (int t = 0; t < 10; ++t) CHECK(d[t].sum().item<float>() == ((t == 3 || t == 6 || t == 9) ? 2.0f : 0.0f));
  CHECK(r.next_done.sum().item<float>() == 0.0f);
  CHECK(torch::allclose(r.next_value, pi.value(venv.observations())));
  CHECK(torch::allclose(r.values, pi.value(r.obs)));
  CHECK(torch::allclose(r.logprobs, pi.evaluate(r.obs, r.actions).logp));
  CHECK(r.rewards.sum().item<float>() == 20.0f);
  CHECK(extra.at("episodes") == 6.0);
  CHECK(extra.at("episode_return") == 3.0);
  CHECK(extra.at("env_steps") == 20.0);

  const auto mb = r.select(torch::tensor({5, 0}, torch::kLong));
  CHECK(mb.size() == 2);
  CHECK(torch::equal(mb.obs[1], r.obs[0]));
  CHECK(mb.num_steps == 0);
  CHECK_FALSE(mb.next_value.defined());
  CHECK(torch::equal(unirl::rewards::environment_reward{}(r), r.rewards));
}

TEST_CASE("PPO on the env track: GAE over (T, N) and an on-policy ratio of exactly 1", "[cpu][env]") {
  torch::manual_seed(4);
  using policy_t = unirl::models::categorical_actor_critic;
  unirl::model_set<policy_t> models{policy_t(4, 2)};
  vector_env<cartpole> venv(cartpole(4), {.num_envs = 3, .seed = 2});
  env_ppo algo({.gamma = 0.9, .lambda = 0.8, .track = {.rollout_steps = 6}});
  std::map<std::string, double> extra;
  const unirl::step_info info{0, 1, torch::kCPU, &extra};
  auto batch = algo.sample(models, venv, info);
  const auto rewards = unirl::rewards::environment_reward{}(batch);
  const auto adv = algo.advantage(models, batch, rewards, info);

  // GAE by hand (CleanRL's loop) over the (6, 3) layout.
  const auto v = batch.values.view({6, 3}), dn = batch.dones.view({6, 3}), rw = rewards.view({6, 3});
  for (int n = 0; n < 3; ++n) {
    double last = 0;
    for (int t = 5; t >= 0; --t) {
      const double nv = t == 5 ? batch.next_value[n].item<double>() : v[t + 1][n].item<double>();
      const double nd = t == 5 ? batch.next_done[n].item<double>() : dn[t + 1][n].item<double>();
      const double delta = rw[t][n].item<double>() + 0.9 * nv * (1 - nd) - v[t][n].item<double>();
      last = delta + 0.9 * 0.8 * (1 - nd) * last;
      CHECK(adv[t * 3 + n].item<double>() == Approx(last).epsilon(1e-5).margin(1e-6));
    }
  }
  CHECK(torch::allclose(batch.returns, batch.advantages + batch.values));

  const auto mb = batch.select(torch::randperm(18, torch::kLong).slice(0, 0, 9));
  const auto terms = algo.loss(models, mb, info);
  CHECK(terms.ratio_mean == Approx(1.0).epsilon(1e-6));
  CHECK(terms.clip_fraction == 0.0);
  CHECK(terms.entropy > 0.0);
  CHECK(terms.total.requires_grad());
  // Policy part on-policy = -mean(normalised A) = 0; value part = 0.5 mean((V - R)^2) = 0.5 mean(A^2).
  CHECK(terms.policy == Approx(0.0).margin(1e-6));
  CHECK(terms.value == Approx(0.5 * mb.advantages.square().mean().item<double>()).epsilon(1e-4));
  auto partial = batch.select(torch::arange(4, torch::kLong));
  CHECK_THROWS_WITH(algo.advantage(models, partial, rewards.slice(0, 0, 4), info), Contains("(T, N) layout"));
}

TEST_CASE("PPO trains CartPole far above a random policy", "[cpu][env][slow]") {
  torch::set_num_threads(1);
  const std::int64_t iterations = 100;  // 51,200 environment steps
  vector_env<cartpole> venv({}, {.num_envs = 4, .seed = 1});
  torch::manual_seed(1);  // the policy's initial weights: the same whatever ran before
  const auto [first_return, final_return] =
      train_ppo(venv, unirl::models::categorical_actor_critic(4, 2), {.ent_coef = 0.01, .track = {.rollout_steps = 128}}, 2.5e-4,
                4, 4, iterations, iterations, [](const unirl::step_stats& s) {
                  CHECK(s.samples == 512);
                  CHECK(s.optimizer_steps == 16);
                });
  INFO("first iteration " << first_return << ", last 20 episodes " << final_return);
  CHECK(first_return < 50.0);   // a random policy balances ~22 steps
  CHECK(final_return > 100.0);  // learned
}

TEST_CASE("PPO with the Gaussian policy learns to swing Pendulum up", "[cpu][env][slow]") {
  // 4 copies x 512 steps, gamma 0.9, lr 1e-3 (annealed over a 195-iteration run), 10 epochs x
  // 32 minibatches, normalised observations and rewards: 30 iterations = 61,440 steps.
  torch::set_num_threads(1);
  vector_env<pendulum> venv({}, {.num_envs = 4, .seed = 1, .normalize_observation = true,
                                 .normalize_reward = true, .reward_gamma = 0.9});
  torch::manual_seed(1);  // the policy's initial weights: the same whatever ran before
  const auto [first_return, final_return] =
      train_ppo(venv, unirl::models::gaussian_actor_critic(3, 1), {.ent_coef = 0.0, .gamma = 0.9, .track = {.rollout_steps = 512}},
                1e-3, 10, 32, 195, 30, [](const unirl::step_stats&) {});
  INFO("first iteration " << first_return << ", last 20 episodes " << final_return);
  CHECK(first_return < -900.0);   // a random policy loses ~1200 per episode
  CHECK(final_return > -700.0);   // swings up and holds most of the time (example seeds 1-3: -375, -321, -574)
}

// ---- Checkpoints of the environments -------------------------------------------------------

namespace {

namespace fs = std::filesystem;

// A fresh directory under the system's temporary directory, removed at the end of the scope.
struct temp_dir {
  fs::path path = fs::temp_directory_path() / ("unirl-env-ckpt-" + std::to_string(std::random_device{}()));
  temp_dir() { fs::create_directories(path); }
  ~temp_dir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// Largest |a - b| over two tensors of the same shape (as double); +inf when the shapes differ.
double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  if (a.numel() == 0) return 0.0;
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

template <class E>
void require_same_state(const vector_env<E>& a, const vector_env<E>& b) {
  CHECK(max_diff(a.observations(), b.observations()) == 0.0);
  CHECK(max_diff(a.dones(), b.dones()) == 0.0);
  CHECK(a.env_steps() == b.env_steps());
  REQUIRE(a.episodes().size() == b.episodes().size());
  for (std::size_t i = 0; i < a.episodes().size(); ++i) {
    CHECK(a.episodes()[i].episode_return == b.episodes()[i].episode_return);
    CHECK(a.episodes()[i].length == b.episodes()[i].length);
    CHECK(a.episodes()[i].env_index == b.episodes()[i].env_index);
  }
  CHECK(max_diff(a.observation_statistics().mean, b.observation_statistics().mean) == 0.0);
  CHECK(max_diff(a.observation_statistics().var, b.observation_statistics().var) == 0.0);
  CHECK(a.observation_statistics().count == b.observation_statistics().count);
  CHECK(max_diff(a.return_statistics().mean, b.return_statistics().mean) == 0.0);
  CHECK(max_diff(a.return_statistics().var, b.return_statistics().var) == 0.0);
  CHECK(a.return_statistics().count == b.return_statistics().count);
}

// Largest difference between the parameters and buffers of two trainers' policies.
template <class Trainer>
double max_weight_diff(const Trainer& a, const Trainer& b) {
  const auto pa = a.models().policy.named_parameters(), pb = b.models().policy.named_parameters();
  const auto ba = a.models().policy.named_buffers(), bb = b.models().policy.named_buffers();
  REQUIRE(pa.size() == pb.size());
  REQUIRE(ba.size() == bb.size());
  double d = 0;
  for (std::size_t i = 0; i < pa.size(); ++i) d = std::max(d, max_diff(pa[i].second, pb[i].second));
  for (std::size_t i = 0; i < ba.size(); ++i) d = std::max(d, max_diff(ba[i].second, bb[i].second));
  return d;
}

// Runs PPO for n + m iterations uninterrupted, and for n iterations, then save(path, venv), then a
// fresh trainer (other initial weights) and a fresh vector_env (`resume_env`: another seed) that
// load(path, venv) and run m more; everything after the resume must be bit for bit the same.
template <class Policy, class E>
void check_resume(const std::function<Policy()>& make_policy, const env_ppo::options& algo,
                  const unirl::envs::vector_env_options& env_opts, const unirl::envs::vector_env_options& resume_env,
                  std::int64_t n, std::int64_t m) {
  torch::set_num_threads(1);
  using trainer_t = unirl::trainer<Policy, unirl::algo::ppo<>, unirl::rewards::environment_reward>;
  const typename trainer_t::options opts{.algorithm = algo,
                                         .optim = {.lr = 1e-3, .eps = 1e-5},
                                         .schedule = {.kind = unirl::train::schedule_kind::linear},
                                         .clip = {.max_grad_norm = 0.5},
                                         .epochs = 2,
                                         .minibatches = 2,
                                         .seed = 1,
                                         .progress = false,
                                         .total_steps = n + m};
  temp_dir dir;
  const auto path = dir.file("ckpt.pt");

  torch::manual_seed(5);
  vector_env<E> venv_a({}, env_opts);
  trainer_t a{make_policy(), {}, opts};
  std::vector<unirl::step_stats> stats_a;
  for (std::int64_t i = 0; i < n + m; ++i) stats_a.push_back(a.step(venv_a));

  torch::manual_seed(5);
  {
    vector_env<E> venv_b({}, env_opts);
    trainer_t b{make_policy(), {}, opts};
    for (std::int64_t i = 0; i < n; ++i) b.step(venv_b);
    b.save(path, venv_b);
  }  // the first process ends here

  torch::manual_seed(999);  // other initial weights and another global generator state
  vector_env<E> venv_c({}, resume_env);
  trainer_t c{make_policy(), {}, opts};
  REQUIRE(max_weight_diff(a, c) > 0.0);  // the load has something to do
  c.load(path, venv_c);
  CHECK(c.step_count() == n);
  CHECK(venv_c.options().seed == env_opts.seed);
  CHECK(venv_c.num_envs() == env_opts.num_envs);
  std::vector<unirl::step_stats> stats_c;
  for (std::int64_t i = 0; i < m; ++i) stats_c.push_back(c.step(venv_c));

  const double weights = max_weight_diff(a, c);
  INFO("max |weight difference| after resume: " << weights);
  CHECK(weights == 0.0);
  for (std::int64_t i = 0; i < m; ++i) {
    const auto& sa = stats_a[static_cast<std::size_t>(n + i)];
    const auto& sc = stats_c[static_cast<std::size_t>(i)];
    INFO("iteration " << n + i);
    CHECK(sa.reward_mean == sc.reward_mean);
    CHECK(sa.loss == sc.loss);
    CHECK(sa.value_loss == sc.value_loss);
    CHECK(sa.learning_rate == sc.learning_rate);
  }
  require_same_state(venv_a, venv_c);
  CHECK(!venv_a.episodes().empty());
}

}  // namespace

static_assert(unirl::Checkpointable<vector_env<cartpole>>);
static_assert(unirl::Checkpointable<vector_env<pendulum>>);
static_assert(unirl::Checkpointable<cartpole>);
static_assert(!unirl::Checkpointable<unirl::envs::running_mean_std>);

TEST_CASE("an environment's save / load continues its episode bit for bit", "[cpu][env]") {
  pendulum a(50);
  a.reset(11);
  for (int t = 0; t < 7; ++t) a.step({0.3f});
  torch::serialize::OutputArchive out;
  a.save(out);
  temp_dir dir;
  out.save_to(dir.file("env.pt"));
  torch::serialize::InputArchive in;
  in.load_from(dir.file("env.pt"));
  pendulum b;  // other time limit, never reset
  b.load(in);
  CHECK(b.elapsed_steps() == 7);
  CHECK(b.max_episode_steps() == 50);
  CHECK(b.state() == a.state());
  for (int t = 7; t < 50; ++t) {
    const auto ra = a.step({-0.7f}), rb = b.step({-0.7f});
    REQUIRE(ra.observation == rb.observation);
    REQUIRE(ra.reward == rb.reward);
    REQUIRE(ra.truncated == rb.truncated);
  }
  CHECK_THROWS_WITH(b.step({0.0f}), Contains("the episode ended"));  // the flags came too
  // A cartpole refuses a pendulum's archive.
  torch::serialize::InputArchive again;
  again.load_from(dir.file("env.pt"));
  cartpole c;
  CHECK_THROWS_AS(c.load(again), unirl::checkpoint_error);
  torch::serialize::InputArchive third;
  third.load_from(dir.file("env.pt"));
  CHECK_THROWS_WITH(c.load(third), Contains("'pendulum' environment; expected 'cartpole'"));
}

TEST_CASE("vector_env save / load restores options, copies, episodes and running statistics", "[cpu][env]") {
  const unirl::envs::vector_env_options o{.num_envs = 3, .seed = 4, .normalize_observation = true,
                                          .normalize_reward = true, .reward_gamma = 0.9};
  vector_env<pendulum> a(pendulum(30), o);  // short episodes: several end before and after the save
  torch::manual_seed(3);
  for (int t = 0; t < 75; ++t) a.step(torch::rand({3, 1}) * 4 - 2);
  temp_dir dir;
  unirl::train::write_checkpoint(dir.file("venv.pt"), [&](torch::serialize::OutputArchive& ar) { a.save(ar); });
  vector_env<pendulum> b(pendulum(30), {.num_envs = 5, .seed = 100});  // other count, seed, no normalisation
  unirl::train::read_checkpoint(dir.file("venv.pt"), [&](torch::serialize::InputArchive& ar) { b.load(ar); });
  CHECK(b.num_envs() == 3);
  CHECK(b.options().normalize_reward);
  require_same_state(a, b);
  for (int t = 0; t < 80; ++t) {
    const auto act = torch::rand({3, 1}) * 4 - 2;
    const auto ra = a.step(act), rb = b.step(act);
    REQUIRE(max_diff(ra.observations, rb.observations) == 0.0);
    REQUIRE(max_diff(ra.rewards, rb.rewards) == 0.0);
    REQUIRE(max_diff(ra.dones, rb.dones) == 0.0);
  }
  require_same_state(a, b);
  CHECK(a.episodes().size() >= 6);

  // A vector of another environment is refused, and left as it was.
  vector_env<cartpole> other({}, {.num_envs = 2, .seed = 1});
  const auto before = other.observations().clone();
  CHECK_THROWS_WITH(
      unirl::train::read_checkpoint(dir.file("venv.pt"), [&](torch::serialize::InputArchive& ar) { other.load(ar); }),
      Contains("3 components; this environment's have 4"));
  CHECK(other.num_envs() == 2);
  CHECK(max_diff(other.observations(), before) == 0.0);
}

TEST_CASE("PPO on Pendulum with normalisation resumes from trainer.save(path, venv) bit for bit",
          "[cpu][env][slow]") {
  // 2 copies x 64 steps per iteration; the save falls mid-episode (192 of 200 steps), so the
  // episode accumulators and the discounted returns of the reward normaliser cross the resume.
  check_resume<unirl::models::gaussian_actor_critic, pendulum>(
      [] { return unirl::models::gaussian_actor_critic(3, 1); }, {.ent_coef = 0.0, .gamma = 0.9, .track = {.rollout_steps = 64}},
      {.num_envs = 2, .seed = 1, .normalize_observation = true, .normalize_reward = true, .reward_gamma = 0.9},
      {.num_envs = 3, .seed = 42}, 3, 3);
}

TEST_CASE("PPO on CartPole resumes from trainer.save(path, venv) bit for bit", "[cpu][env][slow]") {
  check_resume<unirl::models::categorical_actor_critic, cartpole>(
      [] { return unirl::models::categorical_actor_critic(4, 2); }, {.ent_coef = 0.01, .track = {.rollout_steps = 64}},
      {.num_envs = 4, .seed = 3}, {.num_envs = 4, .seed = 17}, 3, 3);
}

TEST_CASE("trainer.load refuses a checkpoint saved with another number of extras", "[cpu][env]") {
  torch::set_num_threads(1);
  using trainer_t = unirl::trainer<unirl::models::categorical_actor_critic, unirl::algo::ppo<>,
                                   unirl::rewards::environment_reward>;
  const trainer_t::options opts{.algorithm = {.track = {.rollout_steps = 8}}, .progress = false};
  vector_env<cartpole> venv({}, {.num_envs = 2, .seed = 1}), venv2({}, {.num_envs = 2, .seed = 2});
  trainer_t t{unirl::models::categorical_actor_critic(4, 2), {}, opts};
  t.step(venv);
  temp_dir dir;
  t.save(dir.file("with.pt"), venv);
  t.save(dir.file("without.pt"));
  trainer_t u{unirl::models::categorical_actor_critic(4, 2), {}, opts};
  CHECK_THROWS_AS(u.load(dir.file("with.pt")), unirl::checkpoint_error);
  CHECK_THROWS_WITH(u.load(dir.file("with.pt")), Contains("holds 1 extra state(s)") && Contains("extra.0"));
  CHECK_THROWS_WITH(u.load(dir.file("with.pt"), venv, venv2), Contains("extra.1 is missing from the checkpoint"));
  CHECK_THROWS_WITH(u.load(dir.file("without.pt"), venv2), Contains("extra.0 is missing from the checkpoint"));
  CHECK(u.step_count() == 0);  // nothing was loaded
  u.load(dir.file("without.pt"));
  CHECK(u.step_count() == 1);
  u.load(dir.file("with.pt"), venv2);
  CHECK(venv2.options().seed == 1);
  require_same_state(venv, venv2);
}

TEST_CASE("float64 end to end: a PPO step on a float64 actor-critic keeps float64 and gives the hand-computed loss",
          "[cpu][env][f64]") {
  torch::manual_seed(11);
  using policy_t = unirl::models::categorical_actor_critic;
  policy_t pi(4, 2);
  pi.net()->to(torch::kDouble);
  unirl::model_set<policy_t> models{std::move(pi)};
  vector_env<cartpole> venv(cartpole(4), {.num_envs = 2, .seed = 3});
  // Defaults otherwise: clip 0.2, value_clip 0.2, vf_coef 0.5, ent_coef 0.01, norm_adv, token_mean.
  env_ppo algo({.gamma = 0.9, .lambda = 0.8, .track = {.rollout_steps = 5}});
  const unirl::step_info info{0, 1};
  auto batch = algo.sample(models, venv, info);
  REQUIRE(batch.logprobs.scalar_type() == torch::kDouble);
  REQUIRE(batch.values.scalar_type() == torch::kDouble);
  REQUIRE(batch.next_value.scalar_type() == torch::kDouble);
  const auto rewards = unirl::rewards::environment_reward{}(batch);  // float32, from the environment
  const auto adv = algo.advantage(models, batch, rewards, info);
  REQUIRE(adv.scalar_type() == torch::kDouble);
  REQUIRE(batch.returns.scalar_type() == torch::kDouble);

  // GAE by hand (CleanRL's loop) in doubles over the (5, 2) layout.
  std::vector<double> a_hand(10), ret_hand(10);
  for (int n = 0; n < 2; ++n) {
    double last = 0;
    for (int t = 4; t >= 0; --t) {
      const double nv = t == 4 ? batch.next_value[n].item<double>() : batch.values[(t + 1) * 2 + n].item<double>();
      const double nd = t == 4 ? batch.next_done[n].item<double>() : batch.dones[(t + 1) * 2 + n].item<double>();
      const double v = batch.values[t * 2 + n].item<double>();
      last = rewards[t * 2 + n].item<double>() + 0.9 * nv * (1 - nd) - v + 0.9 * 0.8 * (1 - nd) * last;
      a_hand[static_cast<std::size_t>(t * 2 + n)] = last;
      ret_hand[static_cast<std::size_t>(t * 2 + n)] = last + v;
    }
  }
  CHECK((adv - torch::tensor(a_hand, torch::kDouble)).abs().max().item<double>() <= 1e-12);
  CHECK((batch.returns - torch::tensor(ret_hand, torch::kDouble)).abs().max().item<double>() <= 1e-12);

  {  // move the policy off pi_old so that the clips matter
    torch::NoGradGuard ng;
    for (auto& p : models.policy.parameters()) p.add_(0.3 * torch::randn_like(p));
  }
  const auto terms = algo.loss(models, batch, info);
  REQUIRE(terms.total.scalar_type() == torch::kDouble);
  {
    // The loss by hand: log-probs, values and entropies under the new weights from the model, then
    // whitening, the clipped surrogate, the clipped value loss and the entropy bonus in plain doubles.
    torch::NoGradGuard ng;
    const auto e = models.policy.evaluate(batch.obs, batch.actions);
    REQUIRE(e.logp.scalar_type() == torch::kDouble);
    double mean = 0, var = 0;
    for (double a : a_hand) mean += a / 10;
    for (double a : a_hand) var += (a - mean) * (a - mean) / 9;
    double pg = 0, vl = 0, ent = 0;
    for (std::int64_t i = 0; i < 10; ++i) {
      const double A = (a_hand[static_cast<std::size_t>(i)] - mean) / (std::sqrt(var) + 1e-8);
      const double rho = std::exp(e.logp[i].item<double>() - batch.logprobs[i].item<double>());
      pg += std::max(-A * rho, -A * std::clamp(rho, 0.8, 1.2)) / 10;
      const double V = e.value[i].item<double>(), Vo = batch.values[i].item<double>();
      const double R = ret_hand[static_cast<std::size_t>(i)];
      const double Vc = Vo + std::clamp(V - Vo, -0.2, 0.2);
      vl += 0.5 * std::max((V - R) * (V - R), (Vc - R) * (Vc - R)) / 10;
      ent += e.entropy[i].item<double>() / 10;
    }
    CHECK(terms.policy == Approx(pg).margin(1e-12));
    CHECK(terms.value == Approx(vl).margin(1e-12));
    CHECK(terms.entropy == Approx(ent).margin(1e-12));
    CHECK(terms.total.item<double>() == Approx(pg + 0.5 * vl - 0.01 * ent).margin(1e-12));
    CHECK(terms.clip_fraction > 0.0);
  }

  // A whole trainer step on a float64 actor-critic: the weights stay float64, the figures are finite.
  torch::manual_seed(12);
  policy_t pi2(4, 2);
  pi2.net()->to(torch::kDouble);
  vector_env<cartpole> venv2({}, {.num_envs = 2, .seed = 4});
  unirl::trainer<policy_t, unirl::algo::ppo<>, unirl::rewards::environment_reward> tr{
      std::move(pi2), {}, {.algorithm = {.track = {.rollout_steps = 8}}, .minibatches = 2, .seed = 1, .progress = false}};
  const auto s = tr.step(venv2);
  CHECK(std::isfinite(s.loss));
  CHECK(s.optimizer_steps == 2);
  for (const auto& p : tr.models().policy.parameters()) CHECK(p.scalar_type() == torch::kDouble);
}

TEST_CASE("PPO on the env track: exec::reference through a whole step gives the default policy's losses",
          "[cpu][env][exec]") {
  // The same seeds draw the same rollouts; every op the algorithm calls (GAE, the losses) then
  // runs its reference implementation and must give the default's figures.
  auto run = [](auto algorithm) {
    using algo_t = typename decltype(algorithm)::type;
    using policy_t = unirl::models::categorical_actor_critic;
    torch::manual_seed(12);
    vector_env<cartpole> venv(cartpole(4), {.num_envs = 3, .seed = 5});
    unirl::trainer<policy_t, algo_t, unirl::rewards::environment_reward> t{
        policy_t(4, 2),
        {},
        {.algorithm = {.ent_coef = 0.01, .track = {.rollout_steps = 8}}, .epochs = 2, .minibatches = 2, .seed = 12,
         .progress = false}};
    return t.step(venv);
  };
  const auto def = run(std::type_identity<unirl::algo::ppo<>>{});
  const auto ref = run(std::type_identity<unirl::algo::ppo<unirl::exec::reference>>{});
  CHECK(ref.reward_mean == def.reward_mean);
  CHECK(ref.optimizer_steps == 4);
  CHECK(ref.loss == Approx(def.loss).margin(1e-6));
  CHECK(ref.policy_loss == Approx(def.policy_loss).margin(1e-6));
  CHECK(ref.value_loss == Approx(def.value_loss).margin(1e-6));
  CHECK(ref.entropy == Approx(def.entropy).margin(1e-6));
  CHECK(ref.advantage_mean == Approx(def.advantage_mean).margin(1e-6));
  CHECK(def.value_loss > 0.0);
  CHECK(def.entropy > 0.0);
}

TEST_CASE("gradient accumulation and bf16 on the env track: PPO micro-batches give the whole minibatch's update",
          "[cpu][env][accumulation][precision]") {
  torch::set_num_threads(1);
  using policy_t = unirl::models::categorical_actor_critic;
  using trainer_t = unirl::trainer<policy_t, unirl::algo::ppo<>, unirl::rewards::environment_reward>;
  torch::manual_seed(12);
  const policy_t init(4, 2);
  auto weights = [](const policy_t& m) {
    std::vector<torch::Tensor> w;
    for (const auto& p : m.parameters()) w.push_back(p.detach().clone());
    return w;
  };
  auto diff = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    double d = 0;
    for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
    return d;
  };
  // 16 steps x 4 envs = 64 transitions; advantages whitened over the minibatch (norm_adv).
  auto run = [&](std::int64_t micro, unirl::precision p) {
    vector_env<cartpole> venv({}, {.num_envs = 4, .seed = 3});
    trainer_t t{init.clone(), {},
                {.algorithm = {.track = {.rollout_steps = 16}}, .optim = {.lr = 1e6, .eps = 1e6}, .precision = p,
                 .micro_batch_size = micro, .seed = 1, .progress = false}};
    const auto s = t.step(venv);
    for (const auto& q : t.models().policy.parameters()) CHECK(q.scalar_type() == torch::kFloat);
    return std::pair{s, weights(t.models().policy)};
  };
  const auto [full, w_full] = run(0, unirl::precision::fp32);
  const double moved = diff(w_full, weights(init));
  REQUIRE(moved > 1e-4);
  for (const std::int64_t micro : {1, 10}) {  // 64 = 6 x 10 + 4: unequal micro-batches
    const auto [acc, w_acc] = run(micro, unirl::precision::fp32);
    CHECK(acc.loss == Approx(full.loss).epsilon(1e-5).margin(1e-7));
    CHECK(acc.value_loss == Approx(full.value_loss).epsilon(1e-5).margin(1e-7));
    CHECK(acc.grad_norm == Approx(full.grad_norm).epsilon(1e-5));
    CHECK(diff(w_acc, w_full) <= 1e-4 * moved);
  }
  // bf16: the same rollout up to the actions bf16 logits draw; the loss stays close and finite.
  const auto [half, w_half] = run(0, unirl::precision::bf16);
  CHECK(std::isfinite(half.loss));
  CHECK(half.optimizer_steps == 1);
}

// ---- Mixed actions (a discrete type and a point) and the click task on canvases ----------------

namespace {

using unirl::models::mixed_actor_critic;
using click_env = unirl::envs::canvas_click<unirl::data::digit_canvas, 32>;
static_assert(unirl::ContinuousEnvironment<click_env>);
static_assert(unirl::VectorEnvironment<vector_env<click_env>>);
static_assert(unirl::AlgorithmFor<unirl::algo::ppo<>, mixed_actor_critic>);
static_assert(unirl::SamplesFrom<unirl::algo::ppo<>, mixed_actor_critic, vector_env<click_env>>);
static_assert(unirl::options::reflects_every_member<unirl::envs::canvas_click_options>);

// One step per episode: reward exp(-|p - (0.3, -0.2)|^2 / (2 * 0.2^2)) when the type is 1, else 0.
struct point_task {
  static constexpr std::size_t observation_size = 2;
  using observation_type = std::array<float, 2>;
  using action_type = std::array<float, 3>;
  using action_space_type = unirl::box_space<3>;
  action_space_type action_space() const { return {{0.0f, -1.0f, -1.0f}, {2.0f, 1.0f, 1.0f}}; }
  observation_type reset(std::uint64_t) { return {1.0f, -1.0f}; }
  unirl::step_result<observation_type> step(const action_type& a) {
    const double dx = a[1] - 0.3, dy = a[2] + 0.2;
    const double r = std::lround(a[0]) == 1 ? std::exp(-(dx * dx + dy * dy) / (2 * 0.2 * 0.2)) : 0.0;
    return {{1.0f, -1.0f}, r, true, false};
  }
};
static_assert(unirl::ContinuousEnvironment<point_task>);

const examples::digits& real_digits() {
  static const auto d = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  return d;
}

}  // namespace

TEST_CASE("mixed distribution: log-prob and entropy are the sums of the hand formulas", "[cpu][env][vlm]") {
  const auto logits = torch::tensor({{1.0, 2.0, 0.5}, {0.0, -1.0, 3.0}}, torch::kDouble);
  const auto mean = torch::tensor({{0.1, -0.3}, {0.5, 0.25}}, torch::kDouble);
  const auto log_std = torch::tensor({{-0.5, 0.2}}, torch::kDouble);
  const auto actions = torch::tensor({{2.0, 0.4, 0.1}, {0.0, -1.0, 0.0}}, torch::kDouble);
  const unirl::models::mixed_distribution d{logits, mean, log_std};
  const auto lp = d.log_prob(actions), h = d.entropy();
  const double L[2][3] = {{1.0, 2.0, 0.5}, {0.0, -1.0, 3.0}}, M[2][2] = {{0.1, -0.3}, {0.5, 0.25}}, S[2] = {-0.5, 0.2};
  const double A[2][3] = {{2.0, 0.4, 0.1}, {0.0, -1.0, 0.0}};
  for (int i = 0; i < 2; ++i) {
    const double z = std::exp(L[i][0]) + std::exp(L[i][1]) + std::exp(L[i][2]);
    double want = L[i][static_cast<int>(A[i][0])] - std::log(z), ent = 0;
    for (int k = 0; k < 3; ++k) ent -= std::exp(L[i][k]) / z * (L[i][k] - std::log(z));
    for (int c = 0; c < 2; ++c) {
      const double u = (A[i][1 + c] - M[i][c]) / std::exp(S[c]);
      want += -0.5 * u * u - S[c] - 0.5 * std::log(2 * std::numbers::pi);
      ent += S[c] + 0.5 * (1 + std::log(2 * std::numbers::pi));
    }
    CHECK(lp[i].item<double>() == Approx(want).epsilon(1e-12));
    CHECK(h[i].item<double>() == Approx(ent).epsilon(1e-12));
  }
  CHECK(torch::equal(d.mode(), torch::tensor({{1.0, 0.1, -0.3}, {2.0, 0.5, 0.25}}, torch::kDouble)));
  // A type that is not an integer in [0, K) is refused.
  CHECK_THROWS_WITH(d.log_prob(torch::tensor({{3.0, 0.0, 0.0}, {0.0, 0.0, 0.0}}, torch::kDouble)),
                    Catch::Contains("expected integers in [0, 3)"));
  CHECK_THROWS_WITH(d.log_prob(torch::tensor({{0.5, 0.0, 0.0}, {0.0, 0.0, 0.0}}, torch::kDouble)),
                    Catch::Contains("expected integers"));
  CHECK_THROWS_WITH(d.log_prob(actions.narrow(1, 0, 2)), Catch::Contains("expected (2, 3)"));
  // Samples: type frequencies are the softmax, coordinates N(mean, exp(log_std)^2).
  torch::manual_seed(3);
  const unirl::models::mixed_distribution one{logits.slice(0, 0, 1).expand({20000, 3}),
                                              mean.slice(0, 0, 1).expand({20000, 2}), log_std};
  const auto s = one.sample();
  CHECK(s.sizes() == torch::IntArrayRef({20000, 3}));
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(0.5);
  for (int k = 0; k < 3; ++k) {
    const double p = std::exp(L[0][k]) / z;
    CHECK(std::abs((s.select(1, 0) == k).to(torch::kDouble).mean().item<double>() - p) < 4.5 * std::sqrt(p * (1 - p) / 20000));
  }
  for (int c = 0; c < 2; ++c) {
    CHECK(std::abs(s.select(1, 1 + c).mean().item<double>() - M[0][c]) < 4.5 * std::exp(S[c]) / std::sqrt(20000.0));
    CHECK(s.select(1, 1 + c).std().item<double>() == Approx(std::exp(S[c])).epsilon(0.03));
  }
}

TEST_CASE("mixed actor-critic: logits then means from one head, act's log-prob is evaluate's", "[cpu][env][vlm]") {
  torch::manual_seed(4);
  mixed_actor_critic pi(5, 3, {.init_log_std = -0.4, .actor_gain = 1.0});
  CHECK(pi.net()->log_std.sizes() == torch::IntArrayRef({1, 2}));
  const auto obs = torch::randn({6, 5});
  const auto a = pi.act(obs);
  REQUIRE(a.action.sizes() == torch::IntArrayRef({6, 3}));
  CHECK(a.action.is_floating_point());
  const auto e = pi.evaluate(obs, a.action);
  CHECK(torch::allclose(a.logp, e.logp, 1e-5, 1e-5));
  // By hand from the actor's output: columns 0..2 the type logits, 3..4 the means.
  const auto head = pi.net()->actor->forward(obs).detach().to(torch::kDouble);
  for (int i = 0; i < 6; ++i) {
    const auto k = static_cast<std::int64_t>(a.action[i][0].item<double>());
    REQUIRE((k >= 0 && k < 3));
    double z = 0;
    for (int j = 0; j < 3; ++j) z += std::exp(head[i][j].item<double>());
    double want = head[i][k].item<double>() - std::log(z);
    for (int c = 0; c < 2; ++c) {
      const double u = (a.action[i][1 + c].item<double>() - head[i][3 + c].item<double>()) / std::exp(-0.4);
      want += -0.5 * u * u + 0.4 - 0.5 * std::log(2 * std::numbers::pi);
    }
    CHECK(e.logp[i].item<double>() == Approx(want).epsilon(1e-5));
  }
  const auto g = pi.greedy(obs);
  CHECK(torch::equal(g.select(1, 0), head.narrow(1, 0, 3).argmax(1).to(g.scalar_type())));
  CHECK(torch::allclose(g.narrow(1, 1, 2), head.narrow(1, 3, 2).to(g.scalar_type())));
  // The gradient reaches the logits, the means and the log-std.
  pi.evaluate(obs, a.action).logp.sum().backward();
  CHECK(pi.net()->log_std.grad().abs().sum().item<double>() > 0);
}

TEST_CASE("PPO with a mixed action learns to choose type 1 and point at (0.3, -0.2)", "[cpu][env][vlm]") {
  torch::set_num_threads(1);
  const auto t0 = std::chrono::steady_clock::now();
  vector_env<point_task> venv({}, {.num_envs = 8, .seed = 1});
  torch::manual_seed(1);
  // 100 iterations x 8 copies x 32 steps = 25,600 one-step episodes, 16 Adam steps per iteration
  // at lr 1e-2 annealed linearly (measured: ~2.3 s, last 20 episodes 0.98).
  const std::int64_t iterations = 100;
  const auto [first_return, final_return] =
      train_ppo(venv, mixed_actor_critic(2, 3), {.ent_coef = 0.0, .track = {.rollout_steps = 32}}, 1e-2, 4, 4,
                iterations, iterations, [](const unirl::step_stats& s) { CHECK(s.samples == 256); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("first iteration " << first_return << ", last 20 episodes " << final_return << ", " << seconds << " s");
  CHECK(first_return < 0.2);  // a random policy: type 1 a third of the time, the point far off (~0.01)
  CHECK(final_return > 0.8);  // type 1 and within ~0.1 of the point
  CHECK(seconds < 30.0);
}

TEST_CASE("canvas_click: observations, rewards, ends and resets on hand cases with real digits", "[cpu][env][vlm]") {
  const auto& d = real_digits();
  const unirl::data::digit_canvas canvases(d.images, d.labels, {.size = 32, .min_digits = 2, .max_digits = 3});
  click_env env(canvases, {.max_episode_steps = 3});
  CHECK_THROWS_WITH(env.step({0.0f, 0.0f, 0.0f}), Catch::Contains("before reset"));
  const auto obs = env.reset(7);
  // The observation: the canvas pixels, then the one-hot of the target, a digit of the canvas.
  const auto label = env.target_label();
  const auto box = env.target_box();
  CHECK(box[2] - box[0] == 8.0);
  CHECK(box[3] - box[1] == 8.0);
  for (int k = 0; k < 10; ++k) CHECK(obs[32 * 32 + k] == (k == label ? 1.0f : 0.0f));
  {
    std::mt19937_64 rng(7);  // the documented draw: canvases(first output of a generator seeded with the seed)
    const auto c = canvases(rng());
    const torch::Tensor flat = c.image.contiguous().view({-1});
    const auto px = flat.accessor<float, 1>();
    for (std::int64_t i = 0; i < 32 * 32; ++i) REQUIRE(obs[static_cast<std::size_t>(i)] == px[i]);
    bool on_canvas = false;
    for (std::size_t i = 0; i < c.labels.size(); ++i)
      if (c.labels[i] == label && c.boxes[i].x1 == box[0] && c.boxes[i].y1 == box[1]) on_canvas = true;
    CHECK(on_canvas);
  }
  // A click at the box's centre pixel: x = px / 16 - 1 on a 32-pixel canvas.
  const float cx = static_cast<float>((box[0] + 4.0) / 16.0 - 1.0), cy = static_cast<float>((box[1] + 4.0) / 16.0 - 1.0);
  auto r = env.step({0.0f, cx, cy});
  CHECK(r.reward == 1.0);
  CHECK(r.terminated);
  CHECK_FALSE(r.truncated);
  CHECK_THROWS_WITH(env.step({0.0f, cx, cy}), Catch::Contains("episode ended"));
  // The same seed, the same episode; a type of 0.4 rounds to a click; corners are inclusive at
  // (x1, y1) and exclusive at (x2, y2).
  CHECK(env.reset(7) == obs);
  r = env.step({0.4f, static_cast<float>(box[0] / 16.0 - 1.0), static_cast<float>(box[1] / 16.0 - 1.0)});
  CHECK((r.reward == 1.0 && r.terminated));
  env.reset(7);
  r = env.step({0.0f, static_cast<float>(box[2] / 16.0 - 1.0), cy});
  CHECK((r.reward == 0.0 && r.terminated));  // a miss ends the episode too
  // Scroll (0.6 rounds to 1) and type do nothing inside the box; truncated after 3 steps.
  env.reset(7);
  r = env.step({0.6f, cx, cy});
  CHECK((r.reward == 0.0 && !r.terminated && !r.truncated));
  r = env.step({2.0f, cx, cy});
  CHECK((r.reward == 0.0 && !r.terminated && !r.truncated));
  r = env.step({1.0f, cx, cy});
  CHECK((r.reward == 0.0 && !r.terminated && r.truncated));
  // Actions outside the space are refused.
  env.reset(8);
  CHECK_THROWS_WITH(env.step({0.0f, 1.5f, 0.0f}), Catch::Contains("expected type in [0, 2]"));
  CHECK_THROWS_WITH(env.step({std::nanf(""), 0.0f, 0.0f}), Catch::Contains("all finite"));
  // Other seeds: other canvases and targets, every target on its canvas.
  std::set<std::int64_t> labels;
  for (std::uint64_t s = 0; s < 50; ++s) {
    env.reset(s);
    labels.insert(env.target_label());
  }
  CHECK(labels.size() >= 8);
  // Vectorised with the mixed policy: (T*N, 3) actions, rewards 0 or 1, every episode one click at most.
  vector_env<click_env> venv(env, {.num_envs = 4, .seed = 3});
  torch::manual_seed(5);
  mixed_actor_critic pi(click_env::observation_size, 3);
  const auto roll = unirl::collect(pi, venv, 16);
  CHECK(roll.actions.sizes() == torch::IntArrayRef({64, 3}));
  CHECK(((roll.rewards == 0) | (roll.rewards == 1)).all().item<bool>());
  CHECK(venv.episodes().size() > 4);
}
