// `sample_tokens_engine`: the contract of `sample_tokens` through the engine (layout, replay
// parity of the behaviour log-probs); GRPO through unirl::trainer and through the split mode's
// rollout_worker sampling on the engine by default.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/parallel/colocated.hpp>
#include <unirl/parallel/rollout_worker.hpp>
#include <unirl/rollout/engine_sampler.hpp>
#include <unirl/rollout/partial.hpp>
#include <unirl/trainer.hpp>

using namespace unirl;

namespace {
models::gpt trainer_gpt() {
  return models::gpt(models::gpt_options{.vocab_size = 8, .max_len = 32, .n_layer = 2, .n_head = 2, .d_model = 32});
}
struct count_ones {
  torch::Tensor operator()(const token_rollout& b) const {
    const auto hit = (b.completion_ids == 1).to(torch::kFloat) * b.completion_mask;
    return hit.sum(1) / b.completion_mask.sum(1).clamp_min(1.0);
  }
};
}  // namespace

TEST_CASE("engine sampler: the batch layout of sample_tokens; replaying it through the training forward gives its "
          "log-probs", "[cpu][rollout][engine]") {
  for (const auto dt : {torch::kFloat, torch::kDouble}) {
    torch::manual_seed(1);
    auto m = trainer_gpt();
    m.net()->to(dt);
    m.train(false);
    torch::NoGradGuard ng;
    prompt_batch in{.tokens = {{1, 2, 3}, {4}, {5, 6}}, .texts = {"a", "b", "c"}, .references = {"x", "y", "z"}};
    in.decode = [](const std::vector<std::int64_t>& t) {
      std::string s;
      for (auto v : t) s += static_cast<char>('0' + v);
      return s;
    };
    const sampling_options s{.max_new_tokens = 10, .temperature = 0.7, .stop_tokens = {0}, .engine = true};
    torch::manual_seed(5);
    const auto b = rollout::sample_tokens_engine(m, in, 4, s);
    const auto st = sample_tokens(m, in, 4, s);
    REQUIRE(b.size() == 12);
    CHECK(b.prompt_ids.sizes() == st.prompt_ids.sizes());
    CHECK(torch::equal(b.prompt_ids, st.prompt_ids));
    CHECK(torch::equal(b.prompt_mask, st.prompt_mask));
    CHECK(b.old_logp.scalar_type() == st.old_logp.scalar_type());
    const auto lp = models::completion_logprob(m, b, 0.7, false).first * b.completion_mask;
    CHECK((lp - b.old_logp).abs().max().item<double>() <= (dt == torch::kDouble ? 1e-10 : 1e-5));
    CHECK(b.prompts[5] == "b");
    CHECK(b.references[11] == "z");
    CHECK(torch::equal(b.prompt_index, torch::tensor({0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2}, torch::kInt64)));
    REQUIRE(b.has_host_lengths());
    const auto ids = b.completion_ids, mk = b.completion_mask;
    for (int64_t i = 0; i < b.size(); ++i) {
      std::string expect;
      bool stopped = false;
      std::int64_t len = 0;
      for (int64_t t = 0; t < ids.size(1); ++t) {
        if (stopped) {
          CHECK(mk[i][t].item<float>() == 0.f);
          continue;
        }
        if (mk[i][t].item<float>() == 0.f) break;
        ++len;
        if (ids[i][t].item<int64_t>() == 0) stopped = true;
        else expect += static_cast<char>('0' + ids[i][t].item<int64_t>());
      }
      CHECK((stopped || len == 10));
      CHECK(b.host_completion_lengths[static_cast<std::size_t>(i)] == len);
      CHECK(b.completions[static_cast<std::size_t>(i)] == expect);
    }
    // Reproducible under torch::manual_seed.
    torch::manual_seed(5);
    const auto again = rollout::sample_tokens_engine(m, in, 4, s);
    CHECK(torch::equal(again.completion_ids, b.completion_ids));
  }
}

TEST_CASE("engine sampler: GRPO through unirl::trainer samples on the engine by default and raises the reward; the "
          "first update's ratio is 1", "[cpu][rollout][engine][integration]") {
  using algo_t = algo::grpo<>;
  trainer<models::gpt, algo_t, count_ones> t{
      trainer_gpt(), count_ones{},
      {.algorithm = {.clip_high = 0.28, .agg = algo::loss_agg::token_mean, .sampling = {.max_new_tokens = 6}},
       .optim = {.lr = 3e-3},
       .group_size = 8,
       .seed = 7,
       .progress = false}};
  const prompt_batch in{.tokens = {{2}, {3, 4}, {5}, {6, 7}}};
  double first = 0, last = 0;
  for (int s = 0; s < 25; ++s) {
    const auto st = t.step(in);
    if (s < 3) first += st.reward_mean / 3;
    if (s >= 22) last += st.reward_mean / 3;
    if (s == 0) CHECK(st.ratio_mean == Approx(1.0).margin(1e-6));
    // The default drew through the engine: 6 steps (4 groups of 8 live at once, no stop token).
    CHECK(st.extra.at("engine/steps") == 6.0);
  }
  CHECK(last > first + 0.3);
}

TEST_CASE("engine sampler: the split mode's rollout_worker samples on the engine by default; the behaviour log-probs "
          "it pushes equal the learner's recompute", "[cpu][rollout][engine][integration]") {
  using algo_t = algo::grpo<>;
  using tr_t = parallel::colocated_transport<token_rollout>;
  // pi_old is the batch's behaviour log-probs (no recompute): the learner's ratio is exp(its
  // log-probs - the engine's), 1 only if the two agree.
  auto opts = [](bool engine) {
    return trainer_options<algo_t>{
        .algorithm = {.agg = algo::loss_agg::token_mean, .recompute_old_logp = false,
                      .sampling = {.max_new_tokens = 6, .temperature = 0.8, .engine = engine}},
        .optim = {.lr = 3e-3},
        .group_size = 8,
        .seed = 11,
        .progress = false};
  };
  const prompt_batch in{.tokens = {{2}, {3, 4}, {5}, {6, 7}}};
  torch::manual_seed(4);
  trainer<models::gpt, algo_t, count_ones> t{trainer_gpt(), count_ones{}, opts(true)};
  tr_t tr;
  parallel::rollout_worker<models::gpt, algo_t, count_ones, tr_t> w(trainer_gpt(), count_ones{}, opts(true), tr);
  parallel::learner l(t, tr);
  for (int k = 0; k < 3; ++k) {
    INFO("version " << k);
    REQUIRE(w.run_once(in));
    const auto f = w.figures();
    // Through the engine: 6 steps; at the peak each of the 32 samples holds one block of its own
    // (16 slots: the 1-2 prompt tokens and 6 completion tokens; the group's shared partial block
    // copied on its first write by 7 of the 8), of 2 layers x (K, V) x 32 floats per slot.
    CHECK(f.at("engine/steps") == 6.0);
    CHECK(f.at("engine/peak_blocks") == 32.0);
    CHECK(f.at("engine/peak_kv_bytes") == 32.0 * 16 * 2 * 2 * 32 * 4);
    auto b = tr.pop(k);
    REQUIRE(b.has_value());
    CHECK(b->policy_version == k);
    {
      torch::NoGradGuard ng;
      auto& policy = t.models().policy;  // the weights of version k, which the worker fetched
      policy.train(false);
      const auto lp = models::completion_logprob(policy, b->batch, 0.8, false).first * b->batch.completion_mask;
      CHECK((lp - b->batch.old_logp).abs().max().item<double>() <= 1e-5);
    }
    REQUIRE(tr.push(std::move(*b)));
    const auto st = l.step();
    REQUIRE(st.has_value());
    CHECK(st->ratio_mean == Approx(1.0).margin(1e-5));
  }
  // engine = false: the static batch of sample_tokens, no engine figures.
  tr_t tr2;
  parallel::rollout_worker<models::gpt, algo_t, count_ones, tr_t> ws(trainer_gpt(), count_ones{}, opts(false), tr2);
  tr2.publish(parallel::policy_state(t.models().policy), 0);
  REQUIRE(ws.run_once(in));
  CHECK(ws.figures().count("engine/steps") == 0);
}

namespace {
// The tokens of `b` drawn with weight version v, each against version v's log-prob of it:
// the largest |difference| over the tokens of each version in `weights` (v's parameters).
double worst_version_error(models::gpt& m, const token_rollout& b, const std::vector<std::vector<torch::Tensor>>& weights,
                           double temperature) {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> now;
  for (auto& p : m.net()->parameters()) now.push_back(p.detach().clone());
  double worst = 0;
  for (std::size_t v = 0; v < weights.size(); ++v) {
    const auto here = (b.token_version == static_cast<std::int64_t>(v)) & (b.completion_mask > 0);
    if (!here.any().item<bool>()) continue;
    auto ps = m.net()->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i) ps[i].detach().copy_(weights[v][i]);
    const auto lp = models::completion_logprob(m, b, temperature, false).first;
    worst = std::max(worst, ((lp - b.old_logp).abs() * here.to(lp.scalar_type())).max().item<double>());
  }
  auto ps = m.net()->parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) ps[i].detach().copy_(now[i]);
  return worst;
}
}  // namespace

TEST_CASE("partial rollouts: groups carried across draws and weight versions, every token's behaviour log-prob is "
          "the log-prob of the version it records (float64), no token older than max_token_age",
          "[cpu][rollout][engine][partial]") {
  for (const bool recompute : {true, false}) {
    INFO("recompute_kv " << recompute);
    torch::manual_seed(3);
    auto m = trainer_gpt();
    m.net()->to(torch::kDouble);
    m.train(false);
    torch::NoGradGuard ng;
    // The weights move to a new version every 3rd poll (a poll comes before a draw and after each
    // engine step), as a learner's updates would arrive while the engine steps.
    std::vector<std::vector<torch::Tensor>> weights;
    auto snapshot = [&] {
      std::vector<torch::Tensor> w;
      for (auto& p : m.net()->parameters()) w.push_back(p.detach().clone());
      weights.push_back(std::move(w));
    };
    snapshot();
    std::int64_t polls = 0;
    // Over-sampled: 4 prompts given per draw, 2 groups returned.
    rollout::partial_rollouts carry{{.recompute_kv = recompute, .max_token_age = 1, .batch_groups = 2}, [&] {
                                      if (++polls % 3 == 0) {
                                        for (auto& p : m.net()->parameters()) p.detach().add_(torch::randn_like(p) * 0.05);
                                        snapshot();
                                      }
                                      return static_cast<std::int64_t>(weights.size()) - 1;
                                    }};
    // Long-tailed lengths: stop token 0 of 8 ends about one completion in eight per token.
    const sampling_options s{.max_new_tokens = 12, .temperature = 1.0, .stop_tokens = {0}, .engine = true};
    std::int64_t carried = 0, mixed = 0, restarted = 0;
    double worst = 0;
    for (std::int64_t d = 0; d < 6; ++d) {
      INFO("draw " << d);
      prompt_batch in{.tokens = {{1 + d % 7}, {2, 1 + (d + 3) % 7}, {3, 4, 5}, {6}}};
      for (int p = 0; p < 4; ++p) in.texts.push_back("p" + std::to_string(4 * d + p));
      const auto b = carry.draw(m, in, 2, s);
      const auto& f = carry.last();
      REQUIRE(b.size() == 4);
      REQUIRE(b.token_version.defined());
      CHECK(torch::equal(b.prompt_index, torch::tensor({0, 0, 1, 1}, torch::kInt64)));
      for (std::int64_t i = 0; i < 4; i += 2) CHECK(b.prompts[static_cast<std::size_t>(i)] == b.prompts[static_cast<std::size_t>(i + 1)]);
      // the live groups were topped up to the 4 prompts: 2 left in flight, 2 new next time
      CHECK(f.new_groups + f.unused_prompts == 4);
      CHECK(f.in_flight_groups == 2);
      const auto mk = b.completion_mask > 0;
      const auto oldest = torch::where(mk, b.token_version, torch::full_like(b.token_version, 1 << 30)).min().item<std::int64_t>();
      CHECK(oldest == f.oldest_version);
      CHECK(oldest >= f.newest_version - 1);  // max_token_age
      // versions never decrease along a completion
      const auto step = b.token_version.slice(1, 1) - b.token_version.slice(1, 0, -1);
      CHECK(((step >= 0) | ~mk.slice(1, 1)).all().item<bool>());
      CHECK(f.in_flight_groups == carry.in_flight());
      carried += f.carried_groups;
      mixed += f.mixed_samples;
      restarted += f.restarted_groups;
      worst = std::max(worst, worst_version_error(m, b, weights, 1.0));
    }
    // Groups outlived their draw, completions spanned weight versions, too-old groups restarted.
    CHECK(carried > 0);
    CHECK(mixed > 0);
    CHECK(restarted > 0);
    if (recompute) CHECK(worst <= 1e-10);
    else CHECK(worst > 1e-6);  // kept keys and values of older weights: the later tokens' log-probs mix versions
  }
}

TEST_CASE("partial rollouts: misuse is an error naming it", "[cpu][rollout][engine][partial]") {
  auto m = trainer_gpt();
  auto m2 = trainer_gpt();
  m.train(false);
  torch::NoGradGuard ng;
  rollout::partial_rollouts carry;
  const sampling_options s{.max_new_tokens = 4, .engine = true};
  const prompt_batch in{.tokens = {{1}, {2}}};
  (void)carry.draw(m, in, 2, s);
  CHECK_THROWS_WITH(carry.draw(m, in, 3, s), Catch::Contains("group_size = 3") && Catch::Contains("first draw's 2"));
  CHECK_THROWS_WITH(carry.draw(m2, in, 2, s), Catch::Contains("another model"));
  CHECK_THROWS_WITH(carry.draw(m, in, 2, {.max_new_tokens = 5, .engine = true}), Catch::Contains("max_new_tokens 5"));
  CHECK_THROWS_WITH(carry.draw(m, in, 2, {.max_new_tokens = 4, .engine = false}), Catch::Contains("sampling.engine = false"));
  CHECK_THROWS_WITH(carry.set_version(-1), Catch::Contains("non-decreasing"));
  rollout::partial_rollouts three{{.batch_groups = 3}};
  CHECK_THROWS_WITH(three.draw(m, in, 2, s), Catch::Contains("batch_groups = 3 but 2 prompts given"));
}

TEST_CASE("partial rollouts in the split mode: the worker carries groups across versions, a batch's policy_version "
          "is its oldest token, and the learner trains on it", "[cpu][rollout][engine][partial][integration]") {
  using algo_t = algo::grpo<>;
  using tr_t = parallel::colocated_transport<token_rollout>;
  const trainer_options<algo_t> opts{
      .algorithm = {.agg = algo::loss_agg::token_mean,
                    .sampling = {.max_new_tokens = 10, .temperature = 1.0, .stop_tokens = {0}, .engine = true}},
      .optim = {.lr = 3e-3},
      .group_size = 4,
      .seed = 11,
      .progress = false};
  const prompt_batch in{.tokens = {{2}, {3, 4}, {5}, {6, 7}}};
  torch::manual_seed(4);
  trainer<models::gpt, algo_t, count_ones> t{trainer_gpt(), count_ones{}, opts};
  {
    tr_t sync;  // synchronous transport: refused
    CHECK_THROWS_WITH((parallel::rollout_worker<models::gpt, algo_t, count_ones, tr_t>(
                          trainer_gpt(), count_ones{}, opts, sync, 0, {.partial_rollouts = true})),
                      Catch::Contains("max_staleness >= 1"));
  }
  // max_staleness 2: the worker restarts a group whose oldest token is more than 1 version behind
  // its newest weights (partial_max_token_age -1: max_staleness - 1).
  tr_t tr{{.max_staleness = 2}};
  parallel::rollout_worker<models::gpt, algo_t, count_ones, tr_t> w(trainer_gpt(), count_ones{}, opts, tr, 0,
                                                                     {.partial_rollouts = true, .partial_batch_groups = 2});
  parallel::learner l(t, tr);
  double carried = 0, mixed = 0;
  for (int k = 0; k < 6; ++k) {
    INFO("step " << k);
    REQUIRE(w.run_once(in));
    const auto f = w.figures();
    carried += f.at("partial/carried_groups");
    mixed += f.at("partial/mixed_samples");
    auto b = tr.pop(l.version());
    REQUIRE(b.has_value());
    const auto& x = b->batch;
    REQUIRE(x.token_version.defined());
    const auto mk = x.completion_mask > 0;
    CHECK(b->policy_version ==
          torch::where(mk, x.token_version, torch::full_like(x.token_version, 1 << 30)).min().item<std::int64_t>());
    CHECK(b->policy_version >= l.version() - 2);
    REQUIRE(tr.push(std::move(*b)));
    const auto st = l.step();
    REQUIRE(st.has_value());
    CHECK(st->extra.at("staleness") <= 2.0);
    CHECK(std::isfinite(st->loss));
  }
  CHECK(carried > 0);
  CHECK(mixed > 0);
}
