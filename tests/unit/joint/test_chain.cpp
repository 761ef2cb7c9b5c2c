// Joint training: joint::link (an upstream model rewarded through a generator's samples) and
// joint::chain (stages, who learns in each, one checkpoint for both trainers, resume in stage).
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/flow_dppo.hpp>
#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/algorithms/grpo.hpp>
#include <unirl/algorithms/ram.hpp>
#include <unirl/joint/chain.hpp>
#include <unirl/joint/link.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/flow_nets.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/trainer.hpp>

#include "weights.hpp"

using namespace unirl;

namespace {

using flow_t = models::flow_model<models::mlp_velocity_net>;

flow_t tiny_flow() {
  return {models::mlp_velocity_net(models::flow_net_options{.shape = {1, 4, 4}, .num_classes = 4, .hidden = 16,
                                                             .depth = 2, .embed_dim = 8}),
          {1, 4, 4}};
}

// The generator's reward: 1 for condition 2, else 0, plus a small brightness term, so that an
// upstream model that picks condition 2 earns ~1 and the generator can still learn something.
struct pick_two {
  double brightness = 0.05;
  torch::Tensor operator()(const flow_rollout& b) {
    const auto hit = (b.conditions.reshape({-1}) == 2).to(torch::kFloat32);
    return hit + static_cast<float>(brightness) * b.samples().flatten(1).mean(1);
  }
};
// A generator reward that returns the condition itself: the link's per-completion mean is then
// exactly the decoded condition (a hand-checkable value).
struct condition_value {
  torch::Tensor operator()(const flow_rollout& b) { return b.conditions.reshape({-1}).to(torch::kFloat32); }
};

// The upstream model writes one token; tokens 2..5 name conditions 0..3, anything else is invalid.
struct first_token {
  joint::decoded operator()(const token_rollout& b) const {
    const auto t = b.completion_ids.select(1, 0);
    return {(t - 2).clamp(0, 3), (t >= 2) & (t <= 5)};
  }
};

template <class Reward>
using gen_trainer = trainer<flow_t, algo::flow_grpo<>, Reward>;
template <class Reward>
using link_t = joint::link<gen_trainer<Reward>, first_token>;
template <class Reward>
using lm_trainer = trainer<models::gpt, algo::grpo<>, link_t<Reward>>;

models::gpt tiny_gpt() {
  return models::gpt(models::gpt_options{.vocab_size = 8, .max_len = 8, .n_layer = 1, .n_head = 2, .d_model = 16});
}

template <class Reward>
typename gen_trainer<Reward>::options gen_options() {
  return {.algorithm = {.beta = 0.0, .sampler = {.steps = 3}}, .optim = {.lr = 1e-2}, .group_size = 2, .seed = 3,
          .progress = false};
}
template <class Reward>
typename lm_trainer<Reward>::options lm_options() {
  return {.algorithm = {.sampling = {.max_new_tokens = 1}}, .optim = {.lr = 3e-2}, .group_size = 8, .seed = 4,
          .progress = false};
}

const prompt_batch prompts{.tokens = {{1}, {1}}};


// An upstream batch the link can be called with directly: a fixed set of first tokens.
struct fixed_batch {
  torch::Tensor completion_ids;
  std::int64_t size() const { return completion_ids.size(0); }
};
struct fixed_decode {
  joint::decoded operator()(const fixed_batch& b) const {
    const auto t = b.completion_ids.select(1, 0);
    return {(t - 2).clamp(0, 3), (t >= 2) & (t <= 5)};
  }
};

}  // namespace

static_assert(GeneratorTrainer<gen_trainer<pick_two>, torch::Tensor>);
static_assert(GeneratorLink<link_t<pick_two>>);
static_assert(SteppedTrainer<joint::chain<lm_trainer<pick_two>, gen_trainer<pick_two>>, prompt_batch>);
static_assert(Checkpointable<joint::chain<lm_trainer<pick_two>, gen_trainer<pick_two>>>);

TEST_CASE("joint::link: each upstream sample gets the mean reward of the generator's samples for its condition",
          "[cpu][joint]") {
  torch::manual_seed(1);
  gen_trainer<condition_value> gen{tiny_flow(), condition_value{}, gen_options<condition_value>()};
  joint::link<gen_trainer<condition_value>, fixed_decode> link{gen, fixed_decode{}, {.invalid_reward = -0.5}};
  // tokens 0, 7: invalid; 2..5: conditions 0..3
  const fixed_batch b{torch::tensor({3, 0, 5, 7, 2, 4}, torch::kInt64).reshape({6, 1})};
  const auto before = unirl_test::parameter_copies(gen.models().policy);

  SECTION("frozen: sampled and scored, never updated") {
    const auto r = link(b);
    CHECK(torch::allclose(r, torch::tensor({1.0f, -0.5f, 3.0f, -0.5f, 0.0f, 2.0f})));
    CHECK(gen.step_count() == 0);
    CHECK(unirl_test::all_equal(before, unirl_test::parameter_copies(gen.models().policy)));
    CHECK_FALSE(link.generator_stats().has_value());
    CHECK(link.last_components().at("valid_fraction") == Approx(4.0 / 6.0));
    CHECK(link.last_components().at("generator_reward") == Approx(1.5));
  }
  SECTION("trained: the same call is one generator step (its own optimizer and statistics)") {
    link.set_mode(joint::generator_mode::trained);
    torch::Tensor r;
    {
      torch::NoGradGuard ng;  // as a trainer calls its reward
      r = link(b);
    }
    CHECK(torch::allclose(r, torch::tensor({1.0f, -0.5f, 3.0f, -0.5f, 0.0f, 2.0f})));
    CHECK(gen.step_count() == 1);
    REQUIRE(link.generator_stats().has_value());
    CHECK(link.generator_stats()->samples == 4 * 2);  // 4 valid conditions x group_size 2
    CHECK(gen.last_rewards().numel() == 8);
    CHECK(link.generator_stats()->reward_mean == Approx((1.0 + 3.0 + 0.0 + 2.0) / 4.0));
    CHECK(gen.optimizer().learning_rate() > 0.0);
  }
  SECTION("nothing valid: no generator call, every sample gets invalid_reward") {
    link.set_mode(joint::generator_mode::trained);
    const auto r = link(fixed_batch{torch::tensor({0, 1, 7}, torch::kInt64).reshape({3, 1})});
    CHECK(torch::equal(r, torch::full({3}, -0.5f)));
    CHECK(gen.step_count() == 0);
    CHECK(link.last_components().at("valid_fraction") == 0.0);
  }
  SECTION("a decoder with the wrong shapes is an error naming them") {
    auto bad = [](const fixed_batch&) { return joint::decoded{torch::zeros({2}, torch::kInt64), torch::ones({2}, torch::kBool)}; };
    joint::link<gen_trainer<condition_value>, decltype(bad)> l2{gen, bad};
    CHECK_THROWS_WITH(l2(b), Catch::Contains("valid mask has shape (2,)") && Catch::Contains("expected (6,)"));
  }
  CHECK_THROWS_WITH((joint::link<gen_trainer<condition_value>, fixed_decode>{gen, fixed_decode{}, {.invalid_reward = NAN}}),
                    Catch::Contains("link.invalid_reward"));
}

TEST_CASE("joint::chain: the stage decides who learns, stages come from a recipe", "[cpu][joint]") {
  torch::manual_seed(2);
  gen_trainer<pick_two> gen{tiny_flow(), pick_two{}, gen_options<pick_two>()};
  lm_trainer<pick_two> lm{tiny_gpt(), link_t<pick_two>{gen, first_token{}}, lm_options<pick_two>()};
  joint::chain_options o;
  options::from_json(o, nlohmann::json::parse(R"({"stages": [{"name": "lm", "steps": 2, "train": "upstream"},
                                                              {"name": "gen", "steps": 2, "train": "generator"},
                                                              {"name": "both", "steps": 0, "train": "joint"}]})"));
  joint::chain c{lm, gen, o};
  const std::vector<std::string> names{"lm", "lm", "gen", "gen", "both", "both"};
  for (std::size_t k = 0; k < names.size(); ++k) {
    const auto lm_before = unirl_test::parameter_copies(lm.models().policy);
    const auto gen_before = unirl_test::parameter_copies(gen.models().policy);
    const auto lm_steps = lm.step_count(), gen_steps = gen.step_count();
    const auto s = c.step(prompts);
    INFO("chain step " << k);
    CHECK(s.stage == names[k]);
    const bool lm_learns = names[k] != "gen", gen_learns = names[k] != "lm";
    CHECK(lm.step_count() == lm_steps + (lm_learns ? 1 : 0));
    CHECK(gen.step_count() == gen_steps + (gen_learns ? 1 : 0));
    CHECK(unirl_test::all_equal(lm_before, unirl_test::parameter_copies(lm.models().policy)) == !lm_learns);
    CHECK(unirl_test::all_equal(gen_before, unirl_test::parameter_copies(gen.models().policy)) == !gen_learns);
    CHECK(s.upstream.has_value() == lm_learns);
    CHECK(s.generator.has_value() == gen_learns);
    CHECK(std::isfinite(s.reward_mean));
    const auto j = s.to_json();
    CHECK(j.at("stage") == names[k]);
    CHECK(j.contains("generator/reward_mean") == gen_learns);
  }
  CHECK(c.step_count() == 6);

  // Bad schedules are refused, naming the key.
  joint::chain_options bad;
  CHECK_THROWS_WITH(options::from_json(bad, nlohmann::json::parse(R"({"stages": [{"name": "x", "train": "both"}]})")),
                    Catch::Contains("stages[0].train") && Catch::Contains("upstream, generator, joint"));
  CHECK_THROWS_WITH((joint::chain{lm, gen, {.stages = {{"a", 0, joint::stage_mode::upstream}, {"b", 3, joint::stage_mode::joint}}}}),
                    Catch::Contains("stages[0].steps") && Catch::Contains("only the last stage"));
  gen_trainer<pick_two> other{tiny_flow(), pick_two{}, gen_options<pick_two>()};
  CHECK_THROWS_WITH((joint::chain{lm, other}), Catch::Contains("another generator trainer"));
}

TEST_CASE("joint::chain: the upstream model learns to pick the condition the generator is rewarded for",
          "[cpu][joint]") {
  torch::manual_seed(5);
  gen_trainer<pick_two> gen{tiny_flow(), pick_two{.brightness = 0.0}, gen_options<pick_two>()};
  lm_trainer<pick_two> lm{tiny_gpt(), link_t<pick_two>{gen, first_token{}, {.invalid_reward = 0.0}},
                          lm_options<pick_two>()};
  joint::chain c{lm, gen, {.stages = {{"lm", 0, joint::stage_mode::upstream}}}};
  double first = 0, last = 0;
  for (int k = 0; k < 30; ++k) {
    const auto s = c.step(prompts);
    if (k < 3) first += s.reward_mean / 3;
    if (k >= 27) last += s.reward_mean / 3;
  }
  INFO("reward (share of completions naming condition 2) " << first << " -> " << last);
  CHECK(first < 0.4);
  CHECK(last > 0.8);
  CHECK(gen.step_count() == 0);  // frozen throughout
}

TEST_CASE("joint::chain: one checkpoint for both trainers, a run resumed in stage 2 continues bit for bit",
          "[cpu][joint]") {
  const auto dir = std::filesystem::temp_directory_path() / ("unirl_joint_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "chain.pt").string();
  const joint::chain_options sched{.stages = {{"lm", 2, joint::stage_mode::upstream},
                                              {"gen", 3, joint::stage_mode::generator},
                                              {"both", 0, joint::stage_mode::joint}}};
  struct run_record {
    std::vector<double> rewards;
    std::vector<torch::Tensor> lm, gen;
  };
  auto continue_run = [&](auto& c, auto& lm, auto& gen, int steps) {
    run_record r;
    for (int k = 0; k < steps; ++k) r.rewards.push_back(c.step(prompts).reward_mean);
    r.lm = unirl_test::parameter_copies(lm.models().policy);
    r.gen = unirl_test::parameter_copies(gen.models().policy);
    return r;
  };
  run_record straight;
  {
    torch::manual_seed(6);
    gen_trainer<pick_two> gen{tiny_flow(), pick_two{}, gen_options<pick_two>()};
    lm_trainer<pick_two> lm{tiny_gpt(), link_t<pick_two>{gen, first_token{}}, lm_options<pick_two>()};
    joint::chain c{lm, gen, sched};
    for (int k = 0; k < 3; ++k) c.step(prompts);
    REQUIRE(c.current_stage().name == "gen");
    c.save(path);
    straight = continue_run(c, lm, gen, 4);  // 2 more in "gen", then 2 in "both"
  }
  {
    torch::manual_seed(99);  // other weights and random state until the load
    gen_trainer<pick_two> gen{tiny_flow(), pick_two{}, gen_options<pick_two>()};
    lm_trainer<pick_two> lm{tiny_gpt(), link_t<pick_two>{gen, first_token{}}, lm_options<pick_two>()};
    joint::chain c{lm, gen, sched};
    c.load(path);
    CHECK(c.step_count() == 3);
    CHECK(c.current_stage().name == "gen");
    CHECK(lm.step_count() == 2);
    CHECK(gen.step_count() == 1);
    const auto resumed = continue_run(c, lm, gen, 4);
    CHECK(resumed.rewards == straight.rewards);
    CHECK(unirl_test::all_equal(resumed.lm, straight.lm));
    CHECK(unirl_test::all_equal(resumed.gen, straight.gen));

    // A chain with another schedule refuses the file, naming both schedules.
    joint::chain other{lm, gen, {.stages = {{"both", 0, joint::stage_mode::joint}}}};
    CHECK_THROWS_WITH(other.load(path), Catch::Contains("schedule") && Catch::Contains("\"gen\""));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("joint::chain: the generator learns with Flow-DPPO or RAM as well as Flow-GRPO", "[cpu][joint]") {
  auto run = [](auto tag, auto algo_options) {
    using A = typename decltype(tag)::type;
    using gen_t = trainer<flow_t, A, pick_two>;
    using lm_t = trainer<models::gpt, algo::grpo<>, joint::link<gen_t, first_token>>;
    torch::manual_seed(8);
    gen_t gen{tiny_flow(), pick_two{}, {.algorithm = algo_options, .optim = {.lr = 1e-2}, .group_size = 2, .seed = 3,
                                        .progress = false}};
    lm_t lm{tiny_gpt(), joint::link<gen_t, first_token>{gen, first_token{}}, lm_options<pick_two>()};
    joint::chain c{lm, gen};  // one joint stage
    const auto before = unirl_test::parameter_copies(gen.models().policy);
    for (int k = 0; k < 3; ++k) {
      const auto s = c.step(prompts);
      CHECK(s.mode == joint::stage_mode::joint);
      CHECK(std::isfinite(s.reward_mean));
      // steps the generator only when some completion named a condition
      CHECK(s.generator.has_value() == (s.upstream->extra.at("reward/valid_fraction") > 0));
    }
    CHECK(lm.step_count() == 3);
    CHECK(gen.step_count() >= 1);
    CHECK_FALSE(unirl_test::all_equal(before, unirl_test::parameter_copies(gen.models().policy)));
  };
  SECTION("Flow-DPPO") { run(std::type_identity<algo::flow_dppo<>>{}, algo::flow_dppo_options{.sampler = {.steps = 3}}); }
  SECTION("RAM") { run(std::type_identity<algo::ram<>>{}, algo::ram_options{.multiplier = 1.0, .sampler = {.steps = 3}}); }
}
