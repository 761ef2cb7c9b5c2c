// Joint training: joint::multitask (several tasks of any track in one run, chosen per step by
// fixed or progress-driven weights; per-task statistics; one checkpoint for every trainer).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/algorithms/grpo.hpp>
#include <unirl/joint/chain.hpp>
#include <unirl/joint/link.hpp>
#include <unirl/joint/multitask.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/flow_nets.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/trainer.hpp>

#include "config_errors.hpp"
#include "weights.hpp"

using namespace unirl;

// Everything in this file lives in its own namespace: the suite is built as one translation unit
// (unity build) with the other files of tests/unit/joint, whose helpers may carry the same names.
namespace multitask_tests {

// A 1-token bandit: reward 1 when the model's single new token is 3.
struct bandit {
  torch::Tensor operator()(const token_rollout& b) const {
    return (b.completion_ids.select(1, 0) == 3).to(torch::kFloat);
  }
};
// Mean brightness of a 4x4 sample.
struct brightness {
  torch::Tensor operator()(const flow_rollout& b) const { return b.samples().flatten(1).mean(1); }
};

using flow_t = models::flow_model<models::mlp_velocity_net>;
using lm_trainer = trainer<models::gpt, algo::grpo<>, bandit>;
using flow_trainer = trainer<flow_t, algo::flow_grpo<>, brightness>;

lm_trainer make_lm(std::uint64_t seed) {
  torch::manual_seed(seed);
  models::gpt m(models::gpt_options{.vocab_size = 8, .max_len = 8, .n_layer = 1, .n_head = 2, .d_model = 16});
  return lm_trainer{m,
                    bandit{},
                    {.algorithm = {.sampling = {.max_new_tokens = 1}},
                     .optim = {.lr = 1e-2},
                     .group_size = 4,
                     .seed = static_cast<std::int64_t>(seed),
                     .progress = false}};
}
flow_trainer make_flow(std::uint64_t seed) {
  torch::manual_seed(seed);
  flow_t m{models::mlp_velocity_net(models::flow_net_options{
               .shape = {1, 4, 4}, .num_classes = 4, .hidden = 16, .depth = 2, .embed_dim = 8}),
           {1, 4, 4}};
  return flow_trainer{m,
                      brightness{},
                      {.algorithm = {.beta = 0.0, .sampler = {.steps = 3}},
                       .optim = {.lr = 1e-3},
                       .group_size = 4,
                       .seed = static_cast<std::int64_t>(seed),
                       .progress = false}};
}
prompt_batch prompts(std::int64_t k) { return prompt_batch{.tokens = {{1 + k % 3}, {2}}}; }
torch::Tensor labels(std::int64_t k) { return torch::tensor(std::vector<std::int64_t>{k % 4, (k + 1) % 4}); }


// A task that is not a trainer: its mean reward is scripted, its position checkpointable.
struct scripted {
  std::vector<double> rewards;
  std::int64_t at = 0;
  step_stats step(std::int64_t k) {
    CHECK(k == at);  // the multitask hands each task its own step index
    step_stats s;
    s.step = at;
    s.reward_mean = rewards[static_cast<std::size_t>(at) % rewards.size()];
    ++at;
    return s;
  }
  void save(torch::serialize::OutputArchive& a) const { a.write("at", torch::tensor(at)); }
  void load(torch::serialize::InputArchive& a) {
    torch::Tensor t;
    a.read("at", t);
    at = t.item<std::int64_t>();
  }
};
struct no_checkpoint {
  step_stats step(std::int64_t) { return {}; }
};
auto identity = [](std::int64_t k) { return k; };

static_assert(SteppedTrainer<lm_trainer, prompt_batch>);
static_assert(SteppedTrainer<flow_trainer, torch::Tensor>);
static_assert(SteppedTrainer<scripted, std::int64_t>);
static_assert(!SteppedTrainer<no_checkpoint, std::int64_t>);  // what multitask's static_assert names
static_assert(Checkpointable<joint::multitask<joint::task<scripted, decltype(identity)>>>);
static_assert(options::reflects_every_member<joint::multitask_options>);

std::filesystem::path temp_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("unirl_test_multitask_" + name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// The progress weighting's formula, written out independently of the library.
std::vector<double> progress_distribution(const std::vector<double>& w, const std::vector<double>& g, double temp,
                                          double floor) {
  double z = 0;
  for (std::size_t i = 0; i < w.size(); ++i) z += w[i] * std::exp(g[i] / temp);
  std::vector<double> p;
  for (std::size_t i = 0; i < w.size(); ++i)
    p.push_back(floor / static_cast<double>(w.size()) + (1 - floor) * w[i] * std::exp(g[i] / temp) / z);
  return p;
}

TEST_CASE("multitask: fixed weights — sample_index by hand, and the choice stream's frequencies match the weights",
          "[cpu][joint][multitask]") {
  // Inverse CDF on hand values: cumulative 0.2, 0.5, 1.0.
  const std::vector<double> p{0.2, 0.3, 0.5};
  CHECK(joint::sample_index(p, 0.0) == 0);
  CHECK(joint::sample_index(p, 0.19) == 0);
  CHECK(joint::sample_index(p, 0.2) == 1);
  CHECK(joint::sample_index(p, 0.49) == 1);
  CHECK(joint::sample_index(p, 0.5) == 2);
  CHECK(joint::sample_index(p, 0.999999) == 2);
  CHECK(joint::sample_index({0.5, 0.5, 0.0}, 0.9999999999) == 1);  // a zero-probability task is never chosen
  CHECK(joint::sample_index({0.0, 1.0}, 0.0) == 1);
  CHECK_THROWS_WITH(joint::sample_index(p, 1.0), Catch::Contains("u = 1"));
  CHECK_THROWS_WITH(joint::sample_index({0.5, -0.1}, 0.3), Catch::Contains("probability 1 = -0.1"));

  // Weights 1 : 2 : 5 : 0 → 1/8, 2/8, 5/8, 0; 8000 draws of the choice function alone.
  joint::task_scheduler s({.seed = 11}, {"a", "b", "c", "off"}, {1.0, 2.0, 5.0, 0.0});
  const std::vector<double> want{1.0 / 8, 2.0 / 8, 5.0 / 8, 0.0};
  const auto got = s.probabilities();
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-15));
  const int n = 8000;
  std::vector<int> count(4, 0);
  std::vector<std::size_t> first;
  for (int i = 0; i < n; ++i) {
    const auto c = s.draw();
    ++count[c];
    if (i < 50) first.push_back(c);
  }
  CHECK(count[3] == 0);
  double chi2 = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    const double e = n * want[i], sd = std::sqrt(n * want[i] * (1 - want[i]));
    INFO("task " << i << ": " << count[i] << " draws, expected " << e << " +- " << sd);
    CHECK(std::abs(count[i] - e) < 4 * sd);
    chi2 += (count[i] - e) * (count[i] - e) / e;
  }
  CHECK(chi2 < 13.82);  // chi-square, 2 degrees of freedom, p = 0.001
  CHECK(s.draws() == n);
  // Fixed weights ignore the rewards; the same seed draws the same sequence, another seed another.
  s.observe(0, 1.0);
  s.observe(0, 0.0);
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(s.probabilities()[i] == Approx(want[i]).margin(1e-15));
  joint::task_scheduler again({.seed = 11}, {"a", "b", "c", "off"}, {1.0, 2.0, 5.0, 0.0}),
      other({.seed = 12}, {"a", "b", "c", "off"}, {1.0, 2.0, 5.0, 0.0});
  std::vector<std::size_t> a, o;
  for (int i = 0; i < 50; ++i) {
    a.push_back(again.draw());
    o.push_back(other.draw());
  }
  CHECK(a == first);
  CHECK(o != first);
}

TEST_CASE("multitask: progress weighting moves probability toward the task whose reward changes (formula by hand)",
          "[cpu][joint][multitask]") {
  const joint::multitask_options o{
      .weighting = joint::task_weighting::progress, .temperature = 0.05, .fast = 0.5, .slow = 0.1, .floor = 0.05};
  joint::task_scheduler s(o, {"moving", "flat"}, {1.0, 1.0});
  CHECK(s.probabilities()[0] == Approx(0.5).margin(1e-15));  // no progress yet: the weights alone
  // moving: 0, 1, 1 → fast 0 → 0.5 → 0.75, slow 0 → 0.1 → 0.19; flat: 0.5 three times → no progress.
  for (double r : {0.0, 1.0, 1.0}) s.observe(0, r);
  for (int i = 0; i < 3; ++i) s.observe(1, 0.5);
  const auto st = s.statistics();
  CHECK(st[0].steps == 3);
  CHECK(st[0].reward == 1.0);
  CHECK(st[0].reward_fast == Approx(0.75).margin(1e-15));
  CHECK(st[0].reward_slow == Approx(0.19).margin(1e-15));
  CHECK(st[0].progress == Approx(0.56).margin(1e-15));
  CHECK(st[1].progress == 0.0);
  // q = e^{0.56/0.05} / (e^{0.56/0.05} + 1) = e^{11.2} / (e^{11.2} + 1); p = 0.05/2 + 0.95 q
  const double q = std::exp(11.2) / (std::exp(11.2) + 1);
  const auto p = s.probabilities();
  CHECK(p[0] == Approx(0.025 + 0.95 * q).epsilon(1e-12));
  CHECK(p[1] == Approx(0.025 + 0.95 * (1 - q)).epsilon(1e-9));
  CHECK(p[0] > 0.97);
  const auto f = s.figures();
  CHECK(f.at("task/moving/probability") == p[0]);
  CHECK(f.at("task/moving/progress") == st[0].progress);
  CHECK(f.at("task/moving/steps") == 3.0);
  CHECK(f.at("task/flat/reward") == 0.5);
  CHECK(f.at("task/flat/weight") == 1.0);

  // The task plateaus at 1: its progress decays (EMAs recomputed here) and so does its probability.
  double fast = 0.75, slow = 0.19;
  for (int i = 0; i < 30; ++i) {
    s.observe(0, 1.0);
    fast = 0.5 * fast + 0.5;
    slow = 0.9 * slow + 0.1;
  }
  CHECK(s.progress(0) == Approx(std::abs(fast - slow)).margin(1e-12));
  const double later = s.probabilities()[0];
  CHECK(later == Approx(progress_distribution({1, 1}, {std::abs(fast - slow), 0}, 0.05, 0.05)[0]).epsilon(1e-12));
  CHECK(later < p[0] - 0.2);

  // Unequal weights, a falling reward (|f - s| counts both ways), and a weight-0 task keeping floor / K.
  joint::task_scheduler u(o, {"falling", "flat", "off"}, {1.0, 3.0, 0.0});
  for (double r : {1.0, 0.0, 0.0}) u.observe(0, r);
  u.observe(1, 0.2);
  const auto want = progress_distribution({1, 3, 0}, {0.56, 0}, 0.05, 0.05);
  const auto pu = u.probabilities();
  for (std::size_t i = 0; i < 3; ++i) CHECK(pu[i] == Approx(want[i]).epsilon(1e-12));
  CHECK(pu[2] == Approx(0.05 / 3).epsilon(1e-14));

  // A tiny temperature: exp(0.56 / 1e-4) overflows a naive softmax; here the distribution stays finite.
  joint::task_scheduler t({.weighting = joint::task_weighting::progress, .temperature = 1e-4, .floor = 0.1},
                          {"moving", "flat"}, {1.0, 1.0});
  for (double r : {0.0, 1.0, 1.0}) t.observe(0, r);
  t.observe(1, 0.0);
  CHECK(t.probabilities()[0] == Approx(0.05 + 0.9).epsilon(1e-12));
  CHECK(t.probabilities()[1] == Approx(0.05).epsilon(1e-9));

  // End to end with scripted tasks: a task whose reward keeps rising is drawn more often than a
  // flat one of the same weight.
  scripted rising{{}}, level{{0.5}};
  for (int i = 0; i < 400; ++i) rising.rewards.push_back(0.05 * i);
  joint::multitask m{o, joint::task{"rising", 1.0, &rising, identity}, joint::task{"level", 1.0, &level, identity}};
  for (int i = 0; i < 200; ++i) m.step();
  INFO("rising " << rising.at << " level " << level.at);
  CHECK(rising.at + level.at == 200);
  CHECK(rising.at > 3 * level.at);
}

TEST_CASE("multitask: a short run of a token trainer and a flow trainer records per-task statistics",
          "[cpu][joint][multitask]") {
  auto lm = make_lm(1);
  auto gen = make_flow(2);
  std::map<std::string, std::vector<std::int64_t>> asked;
  joint::multitask m{{.seed = 3},
                     joint::task{"bandit", 1.0, &lm,
                                 [&](std::int64_t k) {
                                   asked["bandit"].push_back(k);
                                   return prompts(k);
                                 }},
                     joint::task{"digits", 1.0, &gen, [&](std::int64_t k) {
                                   asked["digits"].push_back(k);
                                   return labels(k);
                                 }}};
  CHECK(m.probabilities() == std::vector<double>{0.5, 0.5});
  std::map<std::string, std::int64_t> count;
  std::map<std::string, double> last;
  for (int i = 0; i < 8; ++i) {
    const auto lm_before = unirl_test::parameter_copies(lm.models().policy);
    const auto gen_before = unirl_test::parameter_copies(gen.models().policy);
    const auto s = m.step();
    CHECK(s.step == i);
    CHECK(s.probability == 0.5);
    REQUIRE(s.stats.has_value());
    CHECK(s.stats->step == s.k);  // the trainer's own step index is the task's count
    CHECK(s.k == count[s.name]);
    CHECK(s.stats->samples == 8);  // 2 prompts / conditions x group 4
    CHECK(s.reward_mean == s.stats->reward_mean);
    CHECK(std::isfinite(s.stats->loss));
    ++count[s.name];
    last[s.name] = s.reward_mean;
    // Only the chosen trainer stepped: the other's weights are untouched.
    CHECK(s.stats->optimizer_steps == 1);
    if (s.name != "bandit") CHECK(unirl_test::all_equal(unirl_test::parameter_copies(lm.models().policy), lm_before));
    if (s.name != "digits") CHECK(unirl_test::all_equal(unirl_test::parameter_copies(gen.models().policy), gen_before));
    for (const std::string name : {"bandit", "digits"}) {
      CHECK(s.figures.at("task/" + name + "/steps") == static_cast<double>(count[name]));
      CHECK(s.figures.at("task/" + name + "/probability") == 0.5);
      if (count[name] > 0) CHECK(s.figures.at("task/" + name + "/reward") == last[name]);
    }
    const auto j = s.to_json();
    CHECK(j.at("task") == s.name);
    CHECK(j.at(s.name + "/reward_mean") == s.reward_mean);
    CHECK(j.at(s.name + "/samples") == 8);
    CHECK(j.contains("task/digits/probability"));
  }
  REQUIRE(count["bandit"] >= 1);  // seed 3 draws both tasks in 8 steps
  REQUIRE(count["digits"] >= 1);
  CHECK(count["bandit"] + count["digits"] == 8);
  for (const auto& [name, ks] : asked) {
    std::vector<std::int64_t> want(ks.size());
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = static_cast<std::int64_t>(i);
    CHECK(ks == want);  // each source saw 0, 1, 2, ...
  }
  CHECK(m.step_count() == 8);
  const auto st = m.statistics();
  CHECK(st[0].name == "bandit");
  CHECK(st[0].steps == count["bandit"]);
  CHECK(st[1].steps == count["digits"]);
}

TEST_CASE("multitask: save at step k and continue, then load into fresh objects and continue: bit-identical",
          "[cpu][joint][multitask]") {
  const auto dir = temp_dir("resume");
  const auto path = (dir / "multitask.pt").string();
  const joint::multitask_options o{.weighting = joint::task_weighting::progress, .temperature = 0.2, .seed = 9};
  const int k = 3, n = 5;
  struct record {
    std::vector<std::string> chosen;
    std::vector<double> rewards, probabilities;
    std::vector<torch::Tensor> lm, gen;
    std::map<std::string, double> figures;
  };
  auto continue_run = [&](auto& m, auto& lm, auto& gen) {
    record r;
    for (int i = 0; i < n; ++i) {
      const auto s = m.step();
      r.chosen.push_back(s.name);
      r.rewards.push_back(s.reward_mean);
      r.probabilities.push_back(s.probability);
    }
    r.lm = unirl_test::parameter_copies(lm.models().policy);
    r.gen = unirl_test::parameter_copies(gen.models().policy);
    r.figures = m.figures();
    return r;
  };
  auto make = [&](lm_trainer& lm, flow_trainer& gen) {
    return joint::multitask{o, joint::task{"bandit", 1.0, &lm, prompts}, joint::task{"digits", 2.0, &gen, labels}};
  };
  record first;
  {
    auto lm = make_lm(1);
    auto gen = make_flow(2);
    auto m = make(lm, gen);
    for (int i = 0; i < k; ++i) m.step();
    m.save(path);
    first = continue_run(m, lm, gen);
  }
  auto lm = make_lm(21);
  auto gen = make_flow(22);
  auto m = make(lm, gen);
  CHECK_FALSE(unirl_test::all_equal(unirl_test::parameter_copies(lm.models().policy), first.lm));  // other weights before the load
  m.load(path);
  CHECK(m.step_count() == k);
  const record second = continue_run(m, lm, gen);
  CHECK(second.chosen == first.chosen);
  CHECK(second.rewards == first.rewards);
  CHECK(second.probabilities == first.probabilities);
  CHECK(unirl_test::all_equal(second.lm, first.lm));
  CHECK(unirl_test::all_equal(second.gen, first.gen));
  CHECK(second.figures == first.figures);
  INFO("chosen after the checkpoint: " << nlohmann::json(first.chosen).dump());
  CHECK(m.step_count() == k + n);
  std::filesystem::remove_all(dir);
}

TEST_CASE("multitask: a joint::chain is a task like any trainer, its chain_stats are recorded and it resumes",
          "[cpu][joint][multitask]") {
  // The chain: an LM writes one token naming a condition (tokens 2..5 → 0..3) for a flow model
  // rewarded for condition 2; both learn in its single joint stage. Beside it, a plain flow task.
  struct hit_two {
    torch::Tensor operator()(const flow_rollout& b) const {
      return (b.conditions.reshape({-1}) == 2).to(torch::kFloat32);
    }
  };
  struct first_token {
    joint::decoded operator()(const token_rollout& b) const {
      const auto t = b.completion_ids.select(1, 0);
      return {(t - 2).clamp(0, 3), (t >= 2) & (t <= 5)};
    }
  };
  using gen_t = trainer<flow_t, algo::flow_grpo<>, hit_two>;
  using link_t = joint::link<gen_t, first_token>;
  using up_t = trainer<models::gpt, algo::grpo<>, link_t>;
  torch::manual_seed(5);
  gen_t gen{flow_t{models::mlp_velocity_net(models::flow_net_options{
                       .shape = {1, 4, 4}, .num_classes = 4, .hidden = 16, .depth = 2, .embed_dim = 8}),
                   {1, 4, 4}},
            hit_two{},
            {.algorithm = {.beta = 0.0, .sampler = {.steps = 3}}, .group_size = 2, .seed = 5, .progress = false}};
  up_t up{models::gpt(models::gpt_options{.vocab_size = 8, .max_len = 8, .n_layer = 1, .n_head = 2, .d_model = 16}),
          link_t{gen, first_token{}},
          {.algorithm = {.sampling = {.max_new_tokens = 1}}, .group_size = 4, .seed = 6, .progress = false}};
  joint::chain ch{up, gen};
  auto digits = make_flow(7);
  auto m = joint::multitask{{.seed = 1},
                            joint::task{"prompted", 1.0, &ch,
                                        [](std::int64_t) {
                                          return prompt_batch{.tokens = {{1}, {1}}};
                                        }},
                            joint::task{"digits", 1.0, &digits, labels}};
  const auto dir = temp_dir("chain");
  const auto path = (dir / "m.pt").string();
  auto run = [&](int n) {
    std::vector<std::string> chosen;
    std::vector<double> rewards;
    for (int i = 0; i < n; ++i) {
      const auto s = m.step();
      chosen.push_back(s.name);
      rewards.push_back(s.reward_mean);
      if (s.name == "prompted") {
        CHECK_FALSE(s.stats.has_value());  // a chain's step returns chain_stats, not step_stats
        CHECK(s.task_stats.at("stage") == "joint");
        CHECK(s.task_stats.at("reward_mean") == s.reward_mean);
        CHECK(s.task_stats.contains("upstream/reward_mean"));
        CHECK(s.task_stats.contains("generator/reward_mean"));  // the generator stepped inside the chain
        CHECK(s.to_json().at("prompted/upstream/samples") == 8);
        CHECK(s.k == ch.step_count() - 1);
      } else {
        REQUIRE(s.stats.has_value());
      }
    }
    return std::pair{chosen, rewards};
  };
  run(3);
  m.save(path);
  const auto gen_at_save = unirl_test::parameter_copies(gen.models().policy);
  const auto [chosen, rewards] = run(4);
  INFO(nlohmann::json(chosen).dump());
  CHECK(std::count(chosen.begin(), chosen.end(), "prompted") >= 1);  // seed 1: both tasks in these steps
  CHECK(std::count(chosen.begin(), chosen.end(), "digits") >= 1);
  m.load(path);
  CHECK(unirl_test::all_equal(unirl_test::parameter_copies(gen.models().policy), gen_at_save));
  const auto [again, rewards_again] = run(4);
  CHECK(again == chosen);
  CHECK(rewards_again == rewards);
  std::filesystem::remove_all(dir);
}

TEST_CASE("multitask: bad options and inputs give errors naming the value", "[cpu][joint][multitask][errors]") {
  const std::vector<std::string> ab{"a", "b"};
  const std::vector<double> ones{1.0, 1.0};
  auto [k1, w1] = unirl_test::config_error_of([&] { joint::task_scheduler s({.temperature = 0.0}, ab, ones); });
  CHECK(k1 == "multitask.temperature");
  CHECK_THAT(w1, Catch::Contains("value 0") && Catch::Contains("> 0"));
  auto [k2, w2] = unirl_test::config_error_of([&] { joint::task_scheduler s({.floor = 1.5}, ab, ones); });
  CHECK(k2 == "multitask.floor");
  CHECK_THAT(w2, Catch::Contains("1.5"));
  auto [k3, w3] = unirl_test::config_error_of([&] { joint::task_scheduler s({.fast = 0.0}, ab, ones); });
  CHECK(k3 == "multitask.fast");
  auto [k4, w4] = unirl_test::config_error_of([&] { joint::task_scheduler s({.slow = 2.0}, ab, ones); });
  CHECK(k4 == "multitask.slow");
  CHECK_THAT(w4, Catch::Contains("value 2"));
  // The options read from a recipe's text: an unknown weighting names the choices.
  joint::multitask_options parsed;
  CHECK_THROWS_WITH(options::apply_overrides(parsed, {"weighting=greedy"}),
                    Catch::Contains("greedy") && Catch::Contains("fixed, progress"));
  options::apply_overrides(parsed, {"weighting=progress", "temperature=0.5"});
  CHECK(parsed.weighting == joint::task_weighting::progress);

  CHECK_THROWS_WITH(joint::task_scheduler({}, {"a", "a"}, ones), Catch::Contains("both named 'a'"));
  CHECK_THROWS_WITH(joint::task_scheduler({}, {"a", ""}, ones), Catch::Contains("task 1 has an empty name"));
  CHECK_THROWS_WITH(joint::task_scheduler({}, ab, {1.0, -1.0}), Catch::Contains("'b' has weight -1"));
  CHECK_THROWS_WITH(joint::task_scheduler({}, ab, {1.0, std::nan("")}), Catch::Contains("'b' has weight nan"));
  CHECK_THROWS_WITH(joint::task_scheduler({}, ab, {0.0, 0.0}), Catch::Contains("[0.0,0.0] are all 0"));
  CHECK_THROWS_WITH(joint::task_scheduler({}, ab, {1.0}), Catch::Contains("2 task names but 1 weights"));
  scripted x{{1.0}}, bad{{0.5, std::nan("")}};
  CHECK_THROWS_WITH(
      (joint::multitask{
          {}, joint::task{"x", 1.0, &x, identity}, joint::task{"y", 1.0, static_cast<scripted*>(nullptr), identity}}),
      Catch::Contains("task 'y' has no trainer"));
  // A task's step that reports a non-finite mean reward: the task and the value are named.
  joint::multitask one{{}, joint::task{"nan-task", 1.0, &bad, identity}};
  one.step();
  CHECK_THROWS_WITH(one.step(), Catch::Contains("task 'nan-task' step 1") && Catch::Contains("nan"));

  // Checkpoints: another run's tasks or weights are refused naming both; a missing file; extras.
  const auto dir = temp_dir("errors");
  const auto path = (dir / "m.pt").string();
  scripted p{{0.1, 0.2}}, q{{0.3}};
  joint::multitask m{{.seed = 4}, joint::task{"p", 1.0, &p, identity}, joint::task{"q", 2.0, &q, identity}};
  for (int i = 0; i < 4; ++i) m.step();
  m.save(path);
  scripted p2{{0.1, 0.2}}, q2{{0.3}};
  joint::multitask renamed{{.seed = 4}, joint::task{"p", 1.0, &p2, identity}, joint::task{"r", 2.0, &q2, identity}};
  CHECK_THROWS_WITH(renamed.load(path), Catch::Contains("[\"p\",\"q\"]") && Catch::Contains("[\"p\",\"r\"]"));
  joint::multitask reweighted{{.seed = 4}, joint::task{"p", 1.0, &p2, identity}, joint::task{"q", 3.0, &q2, identity}};
  CHECK_THROWS_WITH(reweighted.load(path), Catch::Contains("weights [1.0,2.0]") && Catch::Contains("[1.0,3.0]"));
  CHECK(p2.at == 0);  // a refused checkpoint changes no trainer
  CHECK(reweighted.step_count() == 0);
  CHECK_THROWS_WITH(m.load((dir / "missing.pt").string()), Catch::Contains("no such file"));
  CHECK_THROWS_WITH(m.load(path, x), Catch::Contains("load was given 1 extra state"));
  // A multitask as an extra of another checkpoint (archive-level save / load).
  const auto outer = (dir / "outer.pt").string();
  train::write_checkpoint(outer, [&](torch::serialize::OutputArchive& a) { train::write_extras(a, m); });
  joint::multitask same_run{{.seed = 4}, joint::task{"p", 1.0, &p2, identity}, joint::task{"q", 2.0, &q2, identity}};
  train::read_checkpoint(outer, [&](torch::serialize::InputArchive& a) {
    train::check_extras(a, 1, "test");
    train::read_extras(a, "test", same_run);
  });
  CHECK(same_run.figures() == m.figures());
  CHECK(p2.at + q2.at == 4);
  CHECK(same_run.step().name == m.step().name);
  std::filesystem::remove_all(dir);
}

}  // namespace multitask_tests
