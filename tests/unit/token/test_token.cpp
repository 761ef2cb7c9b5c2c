// The token track: GPT with KV cache, the sampler (replay through the training forward gives the
// same log-probabilities), GRPO / PPO stages, and short training runs through unirl::trainer.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/record_function.h>
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/algorithms/ppo_token.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/models/torchscript_lm.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/trainer.hpp>

#include "config_errors.hpp"

using namespace unirl;

namespace {
models::gpt small_gpt(std::int64_t vocab = 8, std::int64_t max_len = 32) {
  return models::gpt(models::gpt_options{.vocab_size = vocab, .max_len = max_len, .n_layer = 2, .n_head = 2, .d_model = 32});
}
prompt_batch ragged_prompts() {
  return prompt_batch{.tokens = {{1, 2, 3}, {4}, {5, 6}}, .texts = {"a", "b", "c"}, .references = {"x", "y", "z"}};
}
// Fraction of generated tokens equal to `target`: an easy task a policy can learn in a few steps.
struct count_target {
  std::int64_t target = 1;
  torch::Tensor operator()(const token_rollout& b) const {
    const auto hit = (b.completion_ids == target).to(torch::kFloat) * b.completion_mask;
    return hit.sum(1) / b.completion_mask.sum(1).clamp_min(1.0);
  }
};
model_set<models::gpt> set_of(models::gpt m) { return model_set<models::gpt>{std::move(m)}; }
}  // namespace

TEST_CASE("gpt: cached incremental logits equal the full forward with left padding", "[cpu][token][gpt]") {
  torch::manual_seed(0);
  auto m = small_gpt();
  m.train(false);
  torch::NoGradGuard ng;
  auto [ids, mask] = pad_prompts(ragged_prompts(), 1);
  const auto extra = torch::randint(0, 8, {3, 5}, torch::kInt64);
  const auto all_ids = torch::cat({ids, extra}, 1);
  const auto all_mask = torch::cat({mask, torch::ones({3, 5})}, 1);
  const auto full = m.logits(all_ids, all_mask);
  auto cache = m.make_cache(3, 16);
  std::vector<torch::Tensor> parts{m.logits_cached(ids, mask, cache)};
  for (int t = 0; t < 5; ++t) parts.push_back(m.logits_cached(extra.slice(1, t, t + 1), torch::ones({3, 1}), cache));
  const auto inc = torch::cat(parts, 1);
  // only positions with a real token are meaningful
  const auto diff = ((full - inc).abs().amax(-1) * all_mask).max().item<double>();
  CHECK(diff <= 1e-5);
  // a left-padded prompt gives the same logits as the unpadded one
  const auto solo = m.logits(torch::tensor({{4L}}), torch::ones({1, 1}));
  CHECK((solo[0][0] - full[1][2]).abs().max().item<double>() <= 1e-5);
  CHECK_THROWS_WITH(m.logits_cached(torch::cat({extra, extra}, 1), torch::ones({3, 10}), cache),
                    Catch::Contains("KV cache holds 16"));
}

TEST_CASE("sampler: replaying the samples through the training forward gives the same log-probs",
          "[cpu][token][sampler]") {
  torch::manual_seed(1);
  auto m = small_gpt();
  m.train(false);
  torch::NoGradGuard ng;
  auto in = ragged_prompts();
  in.decode = [](const std::vector<std::int64_t>& t) {
    std::string s;
    for (auto v : t) s += static_cast<char>('0' + v);
    return s;
  };
  const auto b = sample_tokens(m, in, 4, {.max_new_tokens = 10, .temperature = 0.7, .stop_tokens = {0}});
  REQUIRE(b.size() == 12);
  const auto lp = models::completion_logprob(m, b, 0.7, false).first * b.completion_mask;
  CHECK((lp - b.old_logp).abs().max().item<double>() <= 1e-5);
  // groups are contiguous and carry the prompt's text and reference
  CHECK(b.prompts[5] == "b");
  CHECK(b.references[11] == "z");
  CHECK(torch::equal(b.prompt_index, torch::tensor({0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2}, torch::kInt64)));
  // after a stop token nothing is generated; decoded text excludes it and matches the ids
  const auto ids = b.completion_ids, mk = b.completion_mask;
  for (int64_t i = 0; i < b.size(); ++i) {
    std::string expect;
    bool stopped = false;
    for (int64_t t = 0; t < ids.size(1); ++t) {
      if (stopped) CHECK(mk[i][t].item<float>() == 0.f);
      else {
        CHECK(mk[i][t].item<float>() == 1.f);
        if (ids[i][t].item<int64_t>() == 0) stopped = true;
        else expect += static_cast<char>('0' + ids[i][t].item<int64_t>());
      }
    }
    CHECK(b.completions[static_cast<std::size_t>(i)] == expect);
  }
}

TEST_CASE("sampler: top-k 1 and a tiny top-p are greedy; filter_logits by hand", "[cpu][token][sampler]") {
  const auto l = torch::tensor({{1.f, 3.f, 2.f, 0.f}});
  const auto k2 = filter_logits(l, 2, 1.0);
  CHECK(std::isinf(k2[0][0].item<float>()));
  CHECK(k2[0][1].item<float>() == 3.f);
  CHECK(k2[0][2].item<float>() == 2.f);
  // probabilities .644, .237, .087, .032: top_p .7 keeps the first two
  const auto p = filter_logits(l, 0, 0.7);
  CHECK(std::isfinite(p[0][1].item<float>()));
  CHECK(std::isfinite(p[0][2].item<float>()));
  CHECK(std::isinf(p[0][0].item<float>()));
  torch::manual_seed(2);
  auto m = small_gpt();
  torch::NoGradGuard ng;
  const auto a = sample_tokens(m, ragged_prompts(), 3, {.max_new_tokens = 6, .top_k = 1});
  const auto c = sample_tokens(m, ragged_prompts(), 3, {.max_new_tokens = 6, .top_p = 1e-6});
  CHECK(torch::equal(a.completion_ids, c.completion_ids));
  // greedy: every member of a group is the same
  CHECK(torch::equal(a.completion_ids[0], a.completion_ids[1]));
  CHECK_THROWS_WITH(sample_tokens(m, ragged_prompts(), 2, {.top_p = 0.0}), Catch::Contains("top_p"));
  CHECK_THROWS_WITH(sample_tokens(m, prompt_batch{.tokens = {{}}}, 2, {}), Catch::Contains("prompt 0 is empty"));
}

TEST_CASE("sampler: temperature 0 is greedy, the same tokens and log-probs as top_k 1", "[cpu][token][sampler]") {
  auto m = small_gpt();
  torch::NoGradGuard ng;
  torch::manual_seed(5);
  const auto k1 = sample_tokens(m, ragged_prompts(), 3, {.max_new_tokens = 6, .temperature = 1.0, .top_k = 1});
  torch::manual_seed(5);
  const auto t0 = sample_tokens(m, ragged_prompts(), 3, {.max_new_tokens = 6, .temperature = 0.0});
  CHECK(torch::equal(t0.completion_ids, k1.completion_ids));
  CHECK(torch::equal(t0.completion_mask, k1.completion_mask));
  CHECK(torch::equal(t0.old_logp, k1.old_logp));
  // ... and the update's log-probs of temperature 0 are those at temperature 1
  const auto logits = torch::randn({2, 3, 5});
  const auto targets = torch::randint(5, {2, 3}, torch::kInt64);
  CHECK(torch::equal(rollout::token_logprob(logits, targets, 0.0).first, rollout::token_logprob(logits, targets, 1.0).first));
  CHECK_THROWS_WITH(sample_tokens(m, ragged_prompts(), 2, {.temperature = -1.0}), Catch::Contains("temperature"));
}

TEST_CASE("grpo: on-policy first update has ratio exactly 1; zero-variance groups give zero loss gradient",
          "[cpu][token][grpo]") {
  torch::manual_seed(3);
  algo::grpo<> g({.kl_coef = 0.0, .sampling = {.max_new_tokens = 5}});
  auto ms = set_of(small_gpt());
  const step_info info{0, 4};
  auto b = g.sample(ms, ragged_prompts(), info);
  const auto r = count_target{}(b);
  const auto adv = g.advantage(ms, b, r, info);
  CHECK(adv.size(0) == 12);
  const auto t = g.loss(ms, b, info);
  CHECK(t.ratio_mean == 1.0);
  CHECK(t.clip_fraction == 0.0);
  // all rewards equal: A = 0 everywhere, the policy gradient is exactly zero
  g.advantage(ms, b, torch::full({12}, 0.7f), info);
  CHECK(torch::equal(b.advantages, torch::zeros_like(b.advantages)));
  const auto t0 = g.loss(ms, b, info);
  t0.total.backward();
  for (const auto& p : ms.policy.parameters())
    if (p.grad().defined()) CHECK(p.grad().abs().max().item<double>() == 0.0);
}

TEST_CASE("grpo: the policy-gradient direction matches finite differences of the loss", "[cpu][token][grpo]") {
  torch::manual_seed(4);
  algo::grpo<> g({.clip_high = 0.28, .kl_coef = 0.1, .agg = algo::loss_agg::token_mean,
                  .sampling = {.max_new_tokens = 4}});
  auto ms = set_of(small_gpt());
  ms.reference.emplace(ms.policy.clone());
  const step_info info{0, 4};
  auto b = g.sample(ms, ragged_prompts(), info);
  REQUIRE(b.ref_logp.defined());
  g.advantage(ms, b, torch::rand({12}), info);
  // move the policy off pi_old so clip and KL matter
  {
    torch::NoGradGuard ng;
    for (auto& p : ms.policy.parameters()) p.add_(0.05 * torch::randn_like(p));
  }
  auto head = ms.policy.net()->head->weight;
  for (auto& p : ms.policy.parameters()) p.mutable_grad() = torch::Tensor();
  g.loss(ms, b, info).total.backward();
  const auto grad = head.grad().clone();
  torch::NoGradGuard ng;
  double worst = 0, scale = grad.abs().max().item<double>();
  const double h = 1e-3;
  for (int64_t k = 0; k < 6; ++k) {
    const int64_t i = k * 7 % head.size(0), j = k * 5 % head.size(1);
    const float orig = head[i][j].item<float>();
    head[i][j] = orig + h;
    const double up = g.loss(ms, b, info).total.item<double>();
    head[i][j] = orig - h;
    const double dn = g.loss(ms, b, info).total.item<double>();
    head[i][j] = orig;
    worst = std::max(worst, std::abs((up - dn) / (2 * h) - grad[i][j].item<double>()));
  }
  CHECK(scale > 0);
  CHECK(worst <= 2e-3 * std::max(1.0, scale));
}

TEST_CASE("grpo: advantage kinds store per-token advantages under the mask", "[cpu][token][grpo]") {
  torch::manual_seed(5);
  auto ms = set_of(small_gpt());
  const step_info info{0, 4};
  const auto r = torch::tensor({1.f, 0.f, 0.f, 0.f, 1.f, 1.f, 0.f, 0.f, 2.f, 2.f, 2.f, 2.f});
  for (auto kind : {algo::advantage_kind::group, algo::advantage_kind::dr_grpo, algo::advantage_kind::rloo}) {
    algo::grpo<> g({.advantage = kind, .sampling = {.max_new_tokens = 3}});
    auto b = g.sample(ms, ragged_prompts(), info);
    const auto a = g.advantage(ms, b, r, info);
    CHECK(torch::equal(b.advantages, a.unsqueeze(1) * b.completion_mask));
    CHECK(a.slice(0, 8, 12).abs().max().item<float>() == 0.f);  // equal rewards
  }
  // Dr.GRPO by hand: group 1 mean .25
  algo::grpo<> dr({.advantage = algo::advantage_kind::dr_grpo, .sampling = {.max_new_tokens = 3}});
  auto b = dr.sample(ms, ragged_prompts(), info);
  CHECK(dr.advantage(ms, b, r, info)[0].item<float>() == Approx(0.75f));
  // REINFORCE++ with gamma 1 and no KL: every token gets the whitened outcome
  algo::grpo<> rpp({.advantage = algo::advantage_kind::reinforce_pp, .sampling = {.max_new_tokens = 3}});
  auto c = rpp.sample(ms, ragged_prompts(), info);
  rpp.advantage(ms, c, r, info);
  const auto m = c.completion_mask;
  const auto expect = algo::masked_normalize(r.unsqueeze(1) * m, m);
  CHECK((c.advantages - expect).abs().max().item<double>() <= 1e-5);
}

TEST_CASE("grpo: dynamic sampling refills groups whose rewards are all equal", "[cpu][token][grpo]") {
  torch::manual_seed(6);
  algo::grpo<> g({.dynamic_sampling = true, .max_resample_rounds = 4, .sampling = {.max_new_tokens = 3}});
  auto ms = set_of(small_gpt());
  const step_info info{0, 4};
  CHECK_THROWS_WITH(g.sample(ms, ragged_prompts(), info), Catch::Contains("set_filter_reward"));
  // reward 1 only for a hit on the first token: groups often all-0, never kept when degenerate
  auto first_hit = [](const token_rollout& b) { return (b.completion_ids.select(1, 0) == 1).to(torch::kFloat); };
  g.set_filter_reward(first_hit);
  const auto b = g.sample(ms, ragged_prompts(), info);
  REQUIRE(b.size() % 4 == 0);
  const auto r = first_hit(b).view({-1, 4});
  CHECK((r.amax(1) != r.amin(1)).all().item<bool>());
}

TEST_CASE("grpo through unirl::trainer raises the reward on an easy task", "[cpu][token][integration]") {
  using algo_t = algo::grpo<>;
  trainer<models::gpt, algo_t, count_target> t{
      small_gpt(), count_target{},
      {.algorithm = {.clip_high = 0.28, .agg = algo::loss_agg::token_mean, .sampling = {.max_new_tokens = 6}},
       .optim = {.lr = 3e-3},
       .group_size = 8,
       .seed = 7,
       .progress = false}};
  CHECK_FALSE(t.models().reference.has_value());  // kl_coef = 0: no reference built
  const prompt_batch in{.tokens = {{2}, {3, 4}, {5}, {6, 7}}};
  double first = 0, last = 0;
  for (int s = 0; s < 25; ++s) {
    const auto st = t.step(in);
    if (s < 3) first += st.reward_mean / 3;
    if (s >= 22) last += st.reward_mean / 3;
    if (s == 0) CHECK(st.ratio_mean == Approx(1.0).margin(1e-6));
  }
  CHECK(last > first + 0.3);
}

TEST_CASE("trainer: samples_path holds the first samples_count completions of every samples_every-th step, with "
          "their rewards", "[cpu][token][integration]") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("unirl_samples_" + std::to_string(std::random_device{}()));
  using grpo_t = trainer<models::gpt, algo::grpo<>, count_target>;
  grpo_t t{small_gpt(),
           count_target{},
           {.algorithm = {.sampling = {.max_new_tokens = 5}},
            .group_size = 4,
            .seed = 3,
            .samples_path = (dir / "samples.jsonl").string(),
            .samples_every = 2,
            .samples_count = 3,
            .progress = false}};
  prompt_batch in{.tokens = {{2}, {3, 4}}, .texts = {"two", "three four"}, .references = {"r2", "r34"}};
  in.decode = [](const std::vector<std::int64_t>& ids) {
    std::string s;
    for (auto v : ids) s += static_cast<char>('a' + v);
    return s;
  };
  for (int s = 0; s < 5; ++s) t.step(in);
  const auto rows = train::read_metrics((dir / "samples.jsonl").string());
  REQUIRE(rows.size() == 9);  // steps 0, 2, 4; three samples each (all of the first prompt's group)
  const auto last = t.last_rewards().to(torch::kFloat64);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    CHECK(r.at("step").get<std::int64_t>() == static_cast<std::int64_t>(2 * (i / 3)));
    CHECK(r.at("sample").get<std::int64_t>() == static_cast<std::int64_t>(i % 3));
    CHECK(r.at("prompt") == "two");
    CHECK(r.at("reference") == "r2");
    // count_target's reward from the text alone: the share of token 1 ('b') among the 5 tokens
    const auto text = r.at("completion").get<std::string>();
    REQUIRE(text.size() == 5);
    CHECK(r.at("reward").get<double>() == Approx(std::count(text.begin(), text.end(), 'b') / 5.0).margin(1e-6));
    if (i >= 6) CHECK(r.at("reward").get<double>() == Approx(last[static_cast<std::int64_t>(i - 6)].item<double>()));
  }
  auto [key, what] = unirl_test::config_error_of(
      [] { grpo_t bad{small_gpt(), count_target{}, {.group_size = 4, .samples_every = 0, .progress = false}}; });
  CHECK(key == "samples_every");
  CHECK_THAT(what, Catch::Contains(">= 1"));
  fs::remove_all(dir);
}

TEST_CASE("ppo (token track) through unirl::trainer raises the reward on an easy task", "[cpu][token][integration]") {
  using algo_t = algo::ppo<>;
  trainer<models::gpt, algo_t, count_target> t{
      small_gpt(), count_target{},
      {.algorithm = {.ent_coef = 0.0, .kl_coef = 0.05, .gamma = 1.0, .lambda = 0.95,
                     .track = {.sampling = {.max_new_tokens = 6}}},
       .optim = {.lr = 3e-3},
       .group_size = 8,
       .minibatches = 2,
       .seed = 8,
       .progress = false}};
  REQUIRE(t.models().critic.has_value());
  REQUIRE(t.models().reference.has_value());
  const prompt_batch in{.tokens = {{2}, {3, 4}, {5}, {6, 7}}};
  double first = 0, last = 0;
  for (int s = 0; s < 25; ++s) {
    const auto st = t.step(in);
    if (s < 3) first += st.reward_mean / 3;
    if (s >= 22) last += st.reward_mean / 3;
  }
  CHECK(last > first + 0.3);
}

TEST_CASE("torchscript_lm: a model scripted in Python trains through the same trainer", "[cpu][token][torchscript]") {
  if (std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0) {
    WARN("skipped: /usr/bin/python3 with torch is not available to script the test model");
    return;
  }
  namespace fs = std::filesystem;
  std::mt19937_64 rng(std::random_device{}());
  const auto dir = fs::temp_directory_path() / ("unirl_ts_" + std::to_string(rng()));
  fs::create_directories(dir);
  const auto script = dir / "make.py", model_path = dir / "lm.pt", expect_path = dir / "expect.txt";
  std::ofstream(script) << R"(import sys, torch
class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 16)
        self.emb2 = torch.nn.Embedding(8, 16)
        self.head = torch.nn.Linear(16, 8)
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # causal and padding-invariant: running mean of the real tokens' embeddings
        x = self.emb(ids) * mask.unsqueeze(-1)
        h = x.cumsum(1) / mask.cumsum(1).clamp(min=1.0).unsqueeze(-1)
        return self.head(torch.tanh(h + self.emb2(ids)))
torch.manual_seed(0)
m = torch.jit.script(LM())
m.save(sys.argv[1])
out = m(torch.tensor([[1, 2, 3]]), torch.ones(1, 3))
open(sys.argv[2], "w").write(" ".join(repr(v) for v in out.flatten().tolist()))
)";
  const auto cmd = "/usr/bin/python3 " + script.string() + " " + model_path.string() + " " + expect_path.string();
  REQUIRE(std::system(cmd.c_str()) == 0);
  auto lm = models::torchscript_lm::load(model_path.string(), 8);
  {
    torch::NoGradGuard ng;
    const auto out = lm.logits(torch::tensor({{1L, 2L, 3L}}), torch::ones({1, 3})).flatten();
    std::ifstream in(expect_path);
    std::vector<float> expect;
    for (float v; in >> v;) expect.push_back(v);
    REQUIRE(static_cast<std::int64_t>(expect.size()) == out.numel());
    CHECK((out - torch::tensor(expect)).abs().max().item<double>() <= 1e-5);
    // sampler through the prefix cache; replay through the full forward agrees
    const auto b = sample_tokens(lm, ragged_prompts(), 2, {.max_new_tokens = 4});
    const auto lp = models::completion_logprob(lm, b, 1.0, false).first * b.completion_mask;
    CHECK((lp - b.old_logp).abs().max().item<double>() <= 1e-5);
  }
  CHECK_THROWS_WITH(models::torchscript_lm::load((dir / "missing.pt").string(), 8), Catch::Contains("missing.pt"));
  const auto before = lm.named_parameters().front().second.clone();
  trainer<models::torchscript_lm, algo::grpo<>, count_target> t{
      lm, count_target{}, {.algorithm = {.sampling = {.max_new_tokens = 4}}, .optim = {.lr = 1e-2}, .group_size = 4,
                           .progress = false}};
  double first = 0, last = 0;
  const prompt_batch in{.tokens = {{2}, {3, 4}}};
  for (int s = 0; s < 15; ++s) {
    const auto st = t.step(in);
    if (s < 3) first += st.reward_mean / 3;
    if (s >= 12) last += st.reward_mean / 3;
  }
  CHECK_FALSE(torch::equal(before, t.models().policy.named_parameters().front().second));
  CHECK(last > first);
  fs::remove_all(dir);
}

TEST_CASE("dynamic padding: extra padding changes neither log-probs nor the loss", "[cpu][token][grpo]") {
  torch::manual_seed(9);
  algo::grpo<> g({.sampling = {.max_new_tokens = 5, .stop_tokens = {0}}});
  auto ms = set_of(small_gpt());
  const step_info info{0, 4};
  auto b = g.sample(ms, ragged_prompts(), info);
  g.advantage(ms, b, torch::rand({12}), info);
  // the same batch with 3 more padding columns before the prompts and 4 after the completions
  token_rollout wide = b;
  wide.prompt_ids = torch::constant_pad_nd(b.prompt_ids, {3, 0}, 0);
  wide.prompt_mask = torch::constant_pad_nd(b.prompt_mask, {3, 0}, 0);
  for (auto* f : {&wide.completion_ids}) *f = torch::constant_pad_nd(*f, {0, 4}, 0);
  for (auto* f : {&wide.completion_mask, &wide.old_logp, &wide.advantages}) *f = torch::constant_pad_nd(*f, {0, 4}, 0);
  torch::NoGradGuard ng;
  const auto T = b.completion_ids.size(1);
  const auto narrow_lp = models::completion_logprob(ms.policy, b, 1.0, false).first * b.completion_mask;
  const auto wide_lp = models::completion_logprob(ms.policy, wide, 1.0, false).first * wide.completion_mask;
  CHECK((wide_lp.slice(1, 0, T) - narrow_lp).abs().max().item<double>() <= 1e-5);
  const auto t = wide.trimmed();
  CHECK(t.prompt_ids.size(1) == b.prompt_ids.size(1));
  CHECK(t.completion_ids.size(1) <= T);
  CHECK(g.loss(ms, wide, info).total.item<double>() == Approx(g.loss(ms, b, info).total.item<double>()).margin(1e-6));
}

namespace {
// Four samples whose responses have very different lengths (1, 12, 3, 7 tokens) after ragged
// prompts; old / reference log-probs moved off the policy so clip and KL matter.
token_rollout very_ragged_rollout(const models::gpt& m) {
  token_rollout b;
  std::tie(b.prompt_ids, b.prompt_mask) =
      pad_prompts(prompt_batch{.tokens = {{1, 2, 3}, {4}, {5, 6}, {7, 1, 2, 3}}, .pad_id = 0}, 1);
  const std::vector<std::int64_t> len{1, 12, 3, 7};
  const std::int64_t T = 12;
  b.completion_ids = torch::randint(1, 8, {4, T}, torch::kInt64);
  b.completion_mask = torch::zeros({4, T});
  for (std::size_t i = 0; i < len.size(); ++i) b.completion_mask[static_cast<std::int64_t>(i)].slice(0, 0, len[i]).fill_(1.0);
  b.completion_ids = b.completion_ids * b.completion_mask.to(torch::kInt64);  // pad id 0 after the end
  b.prompt_index = torch::arange(4, torch::kInt64);
  torch::NoGradGuard ng;
  const auto lp = models::completion_logprob(m, b, 1.0, false).first;
  b.old_logp = (lp + 0.1 * torch::randn_like(lp)) * b.completion_mask;
  b.ref_logp = (lp + 0.2 * torch::randn_like(lp)) * b.completion_mask;
  b.advantages = torch::randn({4, 1}) * b.completion_mask;
  return b;
}
// A CausalLM that cannot pack (logits_packed hidden): pack_sequences must fail with a clear error.
struct unpackable_gpt : models::gpt {
  explicit unpackable_gpt(models::gpt g) : models::gpt(std::move(g)) {}
  void logits_packed() const = delete;
  unpackable_gpt clone() const { return unpackable_gpt(models::gpt::clone()); }
};
static_assert(CausalLM<unpackable_gpt> && !PackedCausalLM<unpackable_gpt>);
static_assert(!PackedCausalLM<models::torchscript_lm>);
std::vector<torch::Tensor> grads_of(models::gpt& m, const torch::Tensor& loss) {
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
  loss.backward();
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return g;
}
double max_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}
double max_abs(const std::vector<torch::Tensor>& a) {
  double d = 0;
  for (const auto& x : a) d = std::max(d, x.abs().max().item<double>());
  return d;
}
}  // namespace

TEST_CASE("sequence packing: one row without padding, positions restarting, same per-token log-probs",
          "[cpu][token][packing]") {
  torch::manual_seed(10);
  auto m = small_gpt();
  const auto b = very_ragged_rollout(m);
  const auto p = models::pack_rollout(b);
  // no pad tokens: the row is exactly the real tokens, 3+1+2+4 prompt + 1+12+3+7 response = 33
  const auto real = static_cast<std::int64_t>((b.prompt_mask.sum() + b.completion_mask.sum()).item<double>());
  CHECK(real == 33);
  CHECK(p.length() == real);
  CHECK(p.ids.size(0) == 1);
  CHECK(torch::equal(p.ids[0], b.full_ids().masked_select(b.full_mask() > 0)));
  CHECK(torch::equal(p.segments[0], torch::repeat_interleave(torch::arange(4), torch::tensor({4L, 13L, 5L, 11L}))));
  // positions restart at 0 for every sequence
  CHECK(torch::equal(p.positions[0].slice(0, 0, 6), torch::tensor({0L, 1L, 2L, 3L, 0L, 1L})));
  CHECK(p.positions[0][32].item<std::int64_t>() == 10);
  CHECK(p.completion_index.numel() == 23);
  torch::NoGradGuard ng;
  const auto mask = b.completion_mask;
  const auto [lp, ent] = models::completion_logprob(m, b, 0.8, true);
  const auto [plp, pent] = models::packed_completion_logprob(m, b, 0.8, true);
  CHECK(((lp - plp) * mask).abs().max().item<double>() <= 1e-5);
  CHECK(((ent - pent) * mask).abs().max().item<double>() <= 1e-5);
  CHECK(((plp.abs() + pent.abs()) * (1.0 - mask)).max().item<double>() == 0.0);  // 0 at padded slots
  // each packed sequence equals that sequence run alone (no leakage across segments)
  const auto alone = models::completion_logprob(m, b.select(torch::tensor({1L})).trimmed(), 0.8, false).first;
  CHECK((alone[0] - plp[1]).abs().max().item<double>() <= 1e-5);
  // the critic packs the same way
  const auto critic = m.make_critic();
  const auto v = algo::detail::completion_values(critic, b) * mask;
  const auto pv = algo::detail::update_values(critic, b, true);
  CHECK((v - pv).abs().max().item<double>() <= 1e-5);
  CHECK_THROWS_WITH(m.logits_packed(p.ids, p.positions + 32, p.segments), Catch::Contains("max_len = 32"));
  CHECK_THROWS_WITH(models::update_logprob(unpackable_gpt(m), b, 1.0, false, models::update_layout::packed),
                    Catch::Contains("pack_sequences = true"));
  CHECK(((models::update_logprob(unpackable_gpt(m), b, 0.8, false, models::update_layout::padded).first - lp) * mask)
            .abs().max().item<double>() == 0.0);
}

TEST_CASE("sequence packing: GRPO and PPO losses and gradients equal the padded path in every loss_agg mode",
          "[cpu][token][packing][grpo]") {
  torch::manual_seed(11);
  auto ms = set_of(small_gpt());
  ms.reference.emplace(ms.policy.clone());
  const auto b = very_ragged_rollout(ms.policy);
  const step_info info{0, 1};
  for (auto agg : {algo::loss_agg::token_mean, algo::loss_agg::seq_mean_token_mean,
                   algo::loss_agg::seq_mean_token_sum_norm}) {
    INFO("agg = " << static_cast<int>(agg));
    const algo::grpo_options o{.clip_low = 0.05, .clip_high = 0.08, .kl_coef = 0.1, .agg = agg, .ent_coef = 0.01,
                               .sampling = {.max_new_tokens = 12}};
    auto po = o;
    po.layout = rollout::update_layout::packed;
    algo::grpo<> padded(o), packed(po);
    const auto tp = padded.loss(ms, b, info);
    const auto tk = packed.loss(ms, b, info);
    CHECK(tp.clip_fraction > 0.0);  // the clip is active
    CHECK(tk.total.item<double>() == Approx(tp.total.item<double>()).margin(1e-6));
    CHECK(tk.kl == Approx(tp.kl).margin(1e-6));
    CHECK(tk.entropy == Approx(tp.entropy).margin(1e-6));
    const auto gp = grads_of(ms.policy, tp.total), gk = grads_of(ms.policy, tk.total);
    CHECK(max_abs(gp) > 1e-4);
    CHECK(max_diff(gp, gk) <= 1e-5);
  }
  // PPO (policy + critic through the same packing)
  auto c = b;
  ms.critic.emplace(ms.policy.make_critic());
  {
    torch::NoGradGuard ng;
    c.values = algo::detail::completion_values(*ms.critic, c) * c.completion_mask;
    c.returns = (c.values + torch::randn_like(c.values)) * c.completion_mask;
  }
  using token_ppo = algo::ppo<>::for_track<token_track>;
  token_ppo padded({.ent_coef = 0.01, .kl_coef = 0.1, .kl_in_reward = false,
                    .track = {.sampling = {.max_new_tokens = 12}}});
  token_ppo packed({.ent_coef = 0.01, .kl_coef = 0.1, .kl_in_reward = false,
                    .track = {.sampling = {.max_new_tokens = 12}, .layout = rollout::update_layout::packed}});
  const auto tp = padded.loss(ms, c, info);
  const auto tk = packed.loss(ms, c, info);
  CHECK(tk.total.item<double>() == Approx(tp.total.item<double>()).margin(1e-6));
  CHECK(tk.value == Approx(tp.value).margin(1e-6));
  auto all_grads = [&](const torch::Tensor& loss) {
    auto g = grads_of(ms.policy, loss);  // policy, then the critic
    for (const auto& p : ms.critic->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    for (auto& p : ms.critic->parameters()) p.mutable_grad() = torch::Tensor();
    return g;
  };
  const auto gp = all_grads(tp.total), gk = all_grads(tk.total);
  CHECK(max_abs(gp) > 1e-4);
  CHECK(max_diff(gp, gk) <= 1e-5);
}

namespace {
// The built-in GPT without select_cache: no prefix sharing (the sampler prefills every row, the
// shared_prompt layout runs padded).
struct unshared_gpt : models::gpt {
  explicit unshared_gpt(models::gpt g) : models::gpt(std::move(g)) {}
  void select_cache() const = delete;
  unshared_gpt clone() const { return unshared_gpt(models::gpt::clone()); }
};
static_assert(CausalLM<unshared_gpt> && !PrefixSharingCausalLM<unshared_gpt>);
static_assert(PrefixSharingCausalLM<models::gpt>);

// The built-in GPT counting the token rows it runs: full forwards and cached chunks.
struct counting_gpt : models::gpt {
  struct counts {
    std::int64_t full_calls = 0, full_rows = 0, cached_rows = 0;
  };
  explicit counting_gpt(models::gpt g, std::shared_ptr<counts> c = std::make_shared<counts>())
      : models::gpt(std::move(g)), n(std::move(c)) {}
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const {
    ++n->full_calls;
    n->full_rows += ids.size(0);
    return models::gpt::logits(ids, mask);
  }
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, models::kv_cache& c) const {
    n->cached_rows += ids.size(0);
    return models::gpt::logits_cached(ids, mask, c);
  }
  counting_gpt clone() const { return counting_gpt(models::gpt::clone(), n); }
  std::shared_ptr<counts> n;
};
static_assert(PrefixSharingCausalLM<counting_gpt>);
}  // namespace

TEST_CASE("prefix sharing: the sampler prefills each prompt once and draws what the unshared sampler draws",
          "[cpu][token][sampler][prefix]") {
  auto m = small_gpt();
  m.train(false);
  torch::NoGradGuard ng;
  const sampling_options so{.max_new_tokens = 7, .temperature = 0.9, .stop_tokens = {0}};
  torch::manual_seed(21);
  const auto shared = sample_tokens(m, ragged_prompts(), 4, so);
  torch::manual_seed(21);
  const auto alone = sample_tokens(unshared_gpt(m), ragged_prompts(), 4, so);
  CHECK(torch::equal(shared.completion_ids, alone.completion_ids));
  CHECK(torch::equal(shared.completion_mask, alone.completion_mask));
  CHECK((shared.old_logp - alone.old_logp).abs().max().item<double>() <= 1e-5);
  CHECK(torch::equal(shared.prompt_ids, alone.prompt_ids));
  // the replay property still holds
  const auto lp = models::completion_logprob(m, shared, 0.9, false).first * shared.completion_mask;
  CHECK((lp - shared.old_logp).abs().max().item<double>() <= 1e-5);
  // rows run: 3 prompt rows for the prefill, then 12 per decoded step; the sampler reads whether
  // every sequence stopped every stop_check_interval tokens, so it decodes up to the first such
  // read after the longest completion (or to max_new_tokens)
  counting_gpt cm(m);
  torch::manual_seed(21);
  const auto counted = sample_tokens(cm, ragged_prompts(), 4, so);
  const auto width = counted.completion_ids.size(1);
  const auto steps = std::min<std::int64_t>(
      so.max_new_tokens, (width + stop_check_interval - 1) / stop_check_interval * stop_check_interval);
  CHECK(cm.n->cached_rows == 3 + 12 * (steps - 1));
  // kv_cache::select copies rows and checks its index
  auto cache = m.make_cache(3, 8);
  m.logits_cached(torch::tensor({{1L, 2L}, {3L, 4L}, {5L, 6L}}), torch::ones({3, 2}), cache);
  const auto sel = cache.select(torch::tensor({2L, 2L, 0L}));
  CHECK(torch::equal(sel.k[1][1], cache.k[1][2]));
  CHECK(torch::equal(sel.v[0][2], cache.v[0][0]));
  CHECK(sel.length == 2);
  CHECK_THROWS_WITH(cache.select(torch::zeros({2, 2}, torch::kInt64)), Catch::Contains("index must be 1-D"));
}

TEST_CASE("prefix sharing: the update forward runs each distinct prompt once, same log-probs and gradients",
          "[cpu][token][prefix]") {
  torch::manual_seed(22);
  auto m = small_gpt();
  token_rollout b;
  {
    torch::NoGradGuard ng;
    b = sample_tokens(m, ragged_prompts(), 4, {.max_new_tokens = 6, .stop_tokens = {0}});
  }
  REQUIRE(b.completion_mask.min().item<float>() == 0.f);  // some completions stopped early
  // a shuffled minibatch: groups scattered, still 3 distinct prompts
  const auto mb = b.select(torch::randperm(12, torch::kInt64).slice(0, 0, 9));
  const auto d = models::find_distinct_prompts(mb);
  CHECK(d.count() == 3);
  CHECK(torch::equal(d.ids.index_select(0, d.inverse), mb.prompt_ids));
  CHECK(torch::equal(d.mask.index_select(0, d.inverse), mb.prompt_mask));
  const auto w = torch::randn(mb.completion_mask.sizes()) * mb.completion_mask;
  auto objective = [&](const std::pair<torch::Tensor, torch::Tensor>& r) {
    return (r.first * w).sum() + 0.3 * (r.second * w).sum();
  };
  const auto pad = models::completion_logprob(m, mb, 0.8, true);
  counting_gpt cm(m);
  const auto shr = models::shared_prompt_completion_logprob(cm, mb, 0.8, true);
  CHECK(cm.n->full_calls == 0);
  CHECK(cm.n->cached_rows == 3 + 9);  // the distinct prompts, then the completions
  const auto mask = mb.completion_mask;
  CHECK(((pad.first - shr.first) * mask).abs().max().item<double>() <= 1e-5);
  CHECK(((pad.second - shr.second) * mask).abs().max().item<double>() <= 1e-5);
  const auto gp = grads_of(m, objective(pad)), gs = grads_of(m, objective(shr));
  CHECK(max_abs(gp) > 1e-3);
  CHECK(max_diff(gp, gs) <= 1e-5);
  // all prompts distinct: the padded forward runs
  const auto solo = b.select(torch::tensor({0L, 4L, 8L}));
  counting_gpt cs(m);
  const auto r = models::update_logprob(cs, solo, 1.0, false, models::update_layout::shared_prompt);
  CHECK(cs.n->full_calls == 1);
  CHECK(((r.first - models::completion_logprob(m, solo, 1.0, false).first) * solo.completion_mask).abs().max()
            .item<double>() == 0.0);
  // a model without select_cache runs padded under the shared_prompt layout
  const auto u = models::update_logprob(unshared_gpt(m), mb, 0.8, false, models::update_layout::shared_prompt);
  CHECK(((u.first - pad.first) * mask).abs().max().item<double>() == 0.0);
}

TEST_CASE("grpo: share_prompt and reuse_on_policy_logp give the plain path's training with fewer forwards",
          "[cpu][token][grpo][prefix]") {
  const prompt_batch in{.tokens = {{2}, {3, 4}, {5}, {6, 7}}};
  auto run = [&](bool fast, std::int64_t minibatches) {
    torch::manual_seed(5);
    counting_gpt m(small_gpt());
    trainer<counting_gpt, algo::grpo<>, count_target> t{
        m, count_target{},
        {.algorithm = {.clip_high = 0.28, .agg = algo::loss_agg::token_mean, .reuse_on_policy_logp = fast,
                       .layout = fast ? rollout::update_layout::shared_prompt : rollout::update_layout::padded,
                       .sampling = {.max_new_tokens = 5, .stop_tokens = {0}}},
         .optim = {.lr = 3e-3},
         .group_size = 6,
         .minibatches = minibatches,
         .seed = 3,
         .progress = false}};
    std::vector<step_stats> st;
    for (int s = 0; s < 3; ++s) st.push_back(t.step(in));
    return std::tuple{st, t.models().policy.parameters(), *m.n};
  };
  const auto [fs, fw, fc] = run(true, 1);
  const auto [ps, pw, pc] = run(false, 1);
  for (std::size_t s = 0; s < fs.size(); ++s) {
    CHECK(fs[s].ratio_mean == 1.0);  // pi_old is the update's own forward: exactly on-policy
    CHECK(ps[s].ratio_mean == 1.0);
    CHECK(fs[s].loss == Approx(ps[s].loss).margin(1e-5));
    CHECK(fs[s].reward_mean == ps[s].reward_mean);
    CHECK(fs[s].extra.at("sampler_logp_max_diff") <= 1e-5);
  }
  CHECK(max_diff(fw, pw) <= 1e-5);
  // the fast path runs no full forward (no recompute, prompts shared); the plain one two per step
  CHECK(fc.full_calls == 0);
  CHECK(pc.full_calls == 6);
  // two minibatches: pi_old is recomputed after sampling (the shared layout), ratio 1 on the first
  const auto [ms, mw, mc] = run(true, 2);
  CHECK(mc.full_calls == 0);
  CHECK(ms[0].optimizer_steps == 2);
}

namespace {
// Counts the calls of named LibTorch ops on this thread while alive (RecordFunction callbacks):
// `aten::_local_scalar_dense` is every `.item()` — a host synchronisation on an accelerator.
class op_counter {
 public:
  op_counter() {
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&op_counter::on_start).scopes({at::RecordScope::FUNCTION}));
    current() = this;
  }
  ~op_counter() {
    at::removeCallback(handle_);
    current() = nullptr;
  }
  std::int64_t count(const std::string& op) const { return counts_.count(op) ? counts_.at(op) : 0; }

 private:
  static op_counter*& current() {
    thread_local op_counter* c = nullptr;
    return c;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (auto* c = current()) ++c->counts_[fn.name()];
    return nullptr;
  }
  at::CallbackHandle handle_{};
  std::map<std::string, std::int64_t> counts_;
};

template <class Exec>
step_stats grpo_step_with() {
  torch::manual_seed(41);  // the model's initial weights
  trainer<models::gpt, algo::grpo<Exec>, count_target> t{
      small_gpt(), count_target{},
      {.algorithm = {.clip_high = 0.28, .kl_coef = 0.05, .sampling = {.max_new_tokens = 6}}, .group_size = 4,
       .minibatches = 2, .seed = 41, .progress = false}};
  return t.step(prompt_batch{.tokens = {{2}, {3, 4}, {5}, {6, 7}}});
}
template <class Exec>
step_stats ppo_step_with() {
  torch::manual_seed(42);
  trainer<models::gpt, algo::ppo<Exec>, count_target> t{
      small_gpt(), count_target{},
      {.algorithm = {.ent_coef = 0.01, .kl_coef = 0.05, .kl_in_reward = false,
                     .track = {.sampling = {.max_new_tokens = 6}}},
       .group_size = 4, .minibatches = 2, .seed = 42, .progress = false}};
  return t.step(prompt_batch{.tokens = {{2}, {3, 4}, {5}, {6, 7}}});
}
}  // namespace

TEST_CASE("exec::reference through a whole GRPO step and a whole PPO step gives the default's losses",
          "[cpu][token][exec]") {
  // The same seeds: the same samples; every op of the algorithm then runs its reference
  // (log_softmax + gather for the token log-probs, the tensor recursion for GAE).
  auto compare = [](const step_stats& def, const step_stats& ref) {
    CHECK(ref.reward_mean == def.reward_mean);
    CHECK(ref.optimizer_steps == 2);
    CHECK(ref.loss == Approx(def.loss).margin(1e-6));
    CHECK(ref.policy_loss == Approx(def.policy_loss).margin(1e-6));
    CHECK(ref.value_loss == Approx(def.value_loss).margin(1e-6));
    CHECK(ref.kl == Approx(def.kl).margin(1e-6));
    CHECK(ref.entropy == Approx(def.entropy).margin(1e-6));
    CHECK(ref.advantage_mean == Approx(def.advantage_mean).margin(1e-6));
  };
  std::int64_t def_softmax = 0, ref_softmax = 0;
  step_stats def, ref;
  {
    op_counter c;
    def = grpo_step_with<exec::automatic>();
    def_softmax = c.count("aten::log_softmax");
  }
  {
    op_counter c;
    ref = grpo_step_with<exec::reference>();
    ref_softmax = c.count("aten::log_softmax");
  }
  compare(def, ref);
  CHECK(def.kl > 0.0);
  // The policy reached the ops: the reference log-prob composes log_softmax, the fused CPU loop does not.
  CHECK(ref_softmax > def_softmax);
  {
    op_counter c;
    def = ppo_step_with<exec::automatic>();
    def_softmax = c.count("aten::log_softmax");
  }
  {
    op_counter c;
    ref = ppo_step_with<exec::reference>();
    ref_softmax = c.count("aten::log_softmax");
  }
  compare(def, ref);
  CHECK(def.value_loss > 0.0);
  CHECK(ref_softmax > def_softmax);
}

TEST_CASE("a GRPO step reads the device a bounded number of times: once per minibatch, twice per step, once per "
          "engine step", "[cpu][token][sync]") {
  // Host synchronisations = every `.item()` (aten::_local_scalar_dense, LibTorch's and ours) plus
  // every whole-tensor read through unirl::to_host. Before the statistics became tensors these
  // were 78 per step with 1 minibatch and 215 with 4 (same model, prompts and sampling); with
  // the statistics as tensors 24 and 31 (a stop test and multinomial's two validation reads per
  // decoded token, a shared-prompt check and the dynamic padding per minibatch).
  const prompt_batch in{.tokens = {{2}, {3, 4}, {5}, {6, 7}}};
  struct counted {
    std::int64_t items, reads;
    double engine_steps;
  };
  auto measure = [&](std::int64_t minibatches, bool engine) {
    torch::manual_seed(0);
    trainer<models::gpt, algo::grpo<>, count_target> t{
        small_gpt(), count_target{},
        {.algorithm = {.sampling = {.max_new_tokens = 6, .engine = engine}}, .group_size = 8,
         .minibatches = minibatches, .progress = false}};
    t.step(in);  // warm-up
    op_counter c;
    const auto reads_before = host_reads();
    const auto s = t.step(in);
    REQUIRE(s.optimizer_steps == minibatches);
    return counted{c.count("aten::_local_scalar_dense"), host_reads() - reads_before,
                   s.extra.count("engine/steps") ? s.extra.at("engine/steps") : 0.0};
  };
  for (const bool engine : {true, false}) {
    INFO((engine ? "the rollout engine (the default)" : "the static sampler (engine = false)"));
    const auto one = measure(1, engine), four = measure(4, engine);
    WARN("host synchronisations per GRPO step, " << (engine ? "engine" : "static") << ": " << one.items + one.reads
                                                 << " with 1 minibatch (" << one.items << " .item(), " << one.reads
                                                 << " to_host), " << four.items + four.reads << " with 4 ("
                                                 << four.items << " .item(), " << four.reads << " to_host)");
    // The engine reads once per step that samples (the drawn tokens, their log-probs, a NaN
    // flag): 6 here, every completion 6 tokens long (no stop token) and the 32 samples live at
    // once. The static sampler reads none: it needs no stop test without stop tokens.
    const std::int64_t sampling_reads = engine ? 6 : 0;
    CHECK(one.engine_steps == static_cast<double>(sampling_reads));
    CHECK(four.engine_steps == static_cast<double>(sampling_reads));
    // The trainer's own reads: the rewards, one per minibatch (the found-non-finite flag with the
    // loss and the gradient norm), the statistics.
    CHECK(one.reads == 2 + 1 + sampling_reads);
    CHECK(four.reads == 2 + 4 + sampling_reads);
    // Nothing else: neither sampler uses multinomial's validation reads; the dynamic padding and
    // the shared-prompt layout take the sampled batch's host lengths. What is left are two reads
    // inside LibTorch's CPU `std` of all elements (the reward and advantage figures; none on CUDA).
    CHECK(one.items <= 2);
    CHECK(four.items <= 2);
    CHECK(one.items + one.reads <= 5 + sampling_reads);
    CHECK(four.items + four.reads <= 8 + sampling_reads);
  }
}

TEST_CASE("sampler: stop tokens are read every stop_check_interval tokens, lengths and text in the last read",
          "[cpu][token][sync][sampler]") {
  torch::manual_seed(3);
  auto m = small_gpt(8, 48);
  m.train(false);
  torch::NoGradGuard ng;
  auto in = ragged_prompts();
  in.decode = [](const std::vector<std::int64_t>& t) {
    std::string s;
    for (auto v : t) s += static_cast<char>('0' + v);
    return s;
  };
  // 40 tokens, stop token 7 (1 in 8 per draw): the reads are the checks at 8, 16, ... until every
  // sequence stopped, and one at the end (lengths and tokens), not one per token.
  // Inside a deferred_checks scope, as in the trainer's step (the model's position checks wait).
  const sampling_options so{.max_new_tokens = 40, .stop_tokens = {7}};
  token_rollout b;
  std::int64_t reads = 0, items = 0;
  {
    deferred_checks checks;
    op_counter c;
    const auto reads_before = host_reads();
    b = sample_tokens(m, in, 4, so);
    reads = host_reads() - reads_before;
    items = c.count("aten::_local_scalar_dense");
    CHECK_NOTHROW(checks.verify());
  }
  const auto width = b.completion_ids.size(1);
  CHECK(items == 0);
  const auto checks_made =
      std::min<std::int64_t>(so.max_new_tokens - 1, width + stop_check_interval - 1) / stop_check_interval;
  CHECK(reads == checks_made + 1);
  CHECK(reads < width);  // fewer reads than decoded tokens
  // The host lengths are the masks' row sums, the width the longest; the text stops at the stop token.
  const auto len = b.completion_mask.sum(1).to(torch::kInt64);
  REQUIRE(b.host_completion_lengths.size() == 12);
  for (std::int64_t i = 0; i < 12; ++i) {
    const auto l = len[i].item<std::int64_t>();
    CHECK(b.host_completion_lengths[static_cast<std::size_t>(i)] == l);
    CHECK(b.host_prompt_lengths[static_cast<std::size_t>(i)] == b.prompt_mask[i].sum().item<double>());
    std::string expect;
    for (std::int64_t t = 0; t < l; ++t) {
      CHECK(b.completion_mask[i][t].item<float>() == 1.f);  // real tokens first, contiguous
      const auto v = b.completion_ids[i][t].item<std::int64_t>();
      if (v == 7) {
        CHECK(t == l - 1);  // the stop token ends the completion
        break;
      }
      expect += static_cast<char>('0' + v);
    }
    CHECK(b.completions[static_cast<std::size_t>(i)] == expect);
  }
  CHECK(len.max().item<std::int64_t>() == width);
  // Without stop tokens and decoder, inside the trainer's deferred scope: no read at all.
  in.decode = nullptr;
  deferred_checks checks;
  const auto before = host_reads();
  op_counter c2;
  const auto plain = sample_tokens(m, in, 4, {.max_new_tokens = 5});
  CHECK(host_reads() == before);
  CHECK(c2.count("aten::_local_scalar_dense") == 0);
  CHECK(plain.completion_ids.size(1) == 5);
  CHECK(!checks.empty());  // the NaN check waits for the caller's read
  CHECK_NOTHROW(checks.verify());
}

TEST_CASE("sampler: the draw is torch::multinomial's, a NaN distribution is an error", "[cpu][token][sampler]") {
  // The same generator state gives the same tokens as multinomial(probs, 1) on the same logits.
  torch::manual_seed(5);
  const auto logits = torch::randn({64, 11});
  const auto probs = torch::softmax(logits, -1);
  torch::manual_seed(6);
  const auto expect = torch::multinomial(probs, 1).squeeze(1);
  torch::manual_seed(6);
  const auto got = probs.div(torch::empty_like(probs).exponential_(1)).argmax(-1);
  CHECK(torch::equal(expect, got));
  // A model whose logits are NaN: the sampler names the problem instead of drawing from it.
  struct nan_gpt : models::gpt {
    explicit nan_gpt(models::gpt g) : models::gpt(std::move(g)) {}
    torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, cache_type& c) const {
      return models::gpt::logits_cached(ids, mask, c) * std::numeric_limits<float>::quiet_NaN();
    }
    nan_gpt clone() const { return *this; }
  };
  torch::manual_seed(7);
  nan_gpt bad{small_gpt()};
  torch::NoGradGuard ng;
  CHECK_THROWS_WITH(sample_tokens(bad, ragged_prompts(), 2, {.max_new_tokens = 3}), Catch::Contains("NaN"));
}

TEST_CASE("token_rollout::trimmed from the host lengths equals batch::trim from the masks", "[cpu][token][batch]") {
  torch::manual_seed(8);
  auto m = small_gpt();
  m.train(false);
  torch::NoGradGuard ng;
  const auto b = sample_tokens(m, ragged_prompts(), 4, {.max_new_tokens = 9, .stop_tokens = {0, 1}});
  REQUIRE(b.has_host_lengths());
  for (int rep = 0; rep < 5; ++rep) {
    const auto mb = b.select(torch::randperm(12, torch::kInt64).slice(0, 0, 3));  // a host index
    REQUIRE(mb.has_host_lengths());
    const auto fast = mb.trimmed();
    const auto reads_before = host_reads();
    const auto slow = batch::trim(mb);  // reads the masks
    CHECK(host_reads() == reads_before + 1);
    CHECK(torch::equal(fast.prompt_ids, slow.prompt_ids));
    CHECK(torch::equal(fast.prompt_mask, slow.prompt_mask));
    CHECK(torch::equal(fast.completion_ids, slow.completion_ids));
    CHECK(torch::equal(fast.completion_mask, slow.completion_mask));
    CHECK(torch::equal(fast.old_logp, slow.old_logp));
    CHECK(fast.host_completion_lengths == mb.host_completion_lengths);
  }
}

TEST_CASE("trainer: settings that cannot work are rejected at construction, naming the option",
          "[cpu][token][errors]") {
  using grpo_t = trainer<models::gpt, algo::grpo<>, count_target>;
  // max_len = 16: 16 new tokens leave no room for a prompt; 15 do (a 1-token prompt fills 16).
  auto [k1, w1] = unirl_test::config_error_of([] {
    grpo_t t{small_gpt(8, 16), count_target{}, {.algorithm = {.sampling = {.max_new_tokens = 16}}, .progress = false}};
  });
  CHECK(k1 == "algorithm.sampling.max_new_tokens");
  CHECK_THAT(w1, Catch::Contains("value 16") && Catch::Contains("max_length() = 16"));
  CHECK_NOTHROW(grpo_t{small_gpt(8, 16), count_target{},
                       {.algorithm = {.sampling = {.max_new_tokens = 15}}, .progress = false}});
  // PPO on the token track keeps its sampling under algorithm.track
  using ppo_t = trainer<models::gpt, algo::ppo<>, count_target>;
  auto [k2, w2] = unirl_test::config_error_of([] {
    ppo_t t{small_gpt(8, 16), count_target{},
            {.algorithm = {.track = {.sampling = {.max_new_tokens = 20}}}, .group_size = 2, .progress = false}};
  });
  CHECK(k2 == "algorithm.track.sampling.max_new_tokens");
  CHECK_THAT(w2, Catch::Contains("value 20") && Catch::Contains("max_length() = 16"));
  // a stop token the model cannot produce (vocabulary of 8: ids 0..7)
  auto [k3, w3] = unirl_test::config_error_of([] {
    grpo_t t{small_gpt(8, 16), count_target{},
             {.algorithm = {.sampling = {.max_new_tokens = 4, .stop_tokens = {3, 8}}}, .progress = false}};
  });
  CHECK(k3 == "algorithm.sampling.stop_tokens");
  CHECK_THAT(w3, Catch::Contains("token id 8") && Catch::Contains("vocabulary of 8 tokens"));
  // a CUDA device this process does not have
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 8) {
    auto [k4, w4] = unirl_test::config_error_of([] {
      grpo_t t{small_gpt(8, 16), count_target{},
               {.algorithm = {.sampling = {.max_new_tokens = 4}}, .device = "cuda:7", .progress = false}};
    });
    CHECK(k4 == "device");
    CHECK_THAT(w4, Catch::Contains("cuda:7") && Catch::Contains("CUDA device(s)"));
  }
  // an overlong buffer longer than the completions (the algorithm's own validation)
  auto [k5, w5] = unirl_test::config_error_of([] {
    grpo_t t{small_gpt(8, 16), count_target{},
             {.algorithm = {.overlong_buffer = 5, .sampling = {.max_new_tokens = 4}}, .progress = false}};
  });
  CHECK(k5 == "algorithm.overlong_buffer");
}

TEST_CASE("trainer: a prompt too long for the context fails before any model work, naming both lengths",
          "[cpu][token][errors]") {
  using grpo_t = trainer<models::gpt, algo::grpo<>, count_target>;
  grpo_t t{small_gpt(8, 16), count_target{},
           {.algorithm = {.sampling = {.max_new_tokens = 12}}, .group_size = 2, .seed = 3, .progress = false}};
  const auto before = t.models().policy.named_parameters()[0].second.clone();
  // 5 + 12 = 17 > 16
  const prompt_batch too_long{.tokens = {{1, 2}, {1, 2, 3, 4, 5}}}, fits{.tokens = {{1, 2}, {1, 2, 3, 4}}};
  CHECK_THROWS_WITH(t.step(too_long),
                    Catch::Contains("prompt 1 has 5 tokens") &&
                        Catch::Contains("algorithm.sampling.max_new_tokens = 12") &&
                        Catch::Contains("max_length() = 16"));
  CHECK(t.step_count() == 0);
  CHECK(torch::equal(before, t.models().policy.named_parameters()[0].second));
  // 4 + 12 = 16 fills the context exactly: the model takes it (its own position check agrees)
  CHECK_NOTHROW(t.step(fits));
  CHECK(t.step_count() == 1);
}

TEST_CASE("float64 end to end: a GRPO step on a float64 GPT keeps float64 and gives the hand-computed loss",
          "[cpu][token][grpo][f64]") {
  torch::manual_seed(21);
  auto model = small_gpt();
  model.net()->to(torch::kDouble);
  auto ms = set_of(std::move(model));
  ms.reference.emplace(ms.policy.clone());
  algo::grpo<> g({.clip_high = 0.28, .kl_coef = 0.05, .sampling = {.max_new_tokens = 4}});  // k3, seq_mean_token_mean
  const step_info info{0, 4};  // updates unknown: pi_old is recomputed right after sampling
  auto b = g.sample(ms, ragged_prompts(), info);
  REQUIRE(b.old_logp.scalar_type() == torch::kDouble);
  REQUIRE(b.ref_logp.scalar_type() == torch::kDouble);
  // float32 rewards, float64 model: the advantages take the wider type.
  const auto rewards = torch::tensor({0.1f, 0.7f, 0.3f, 0.9f, 1.f, 0.f, 0.f, 1.f, 0.5f, 0.5f, 0.5f, 0.5f});
  const auto adv = g.advantage(ms, b, rewards, info);
  REQUIRE(adv.scalar_type() == torch::kDouble);
  REQUIRE(b.advantages.scalar_type() == torch::kDouble);
  // GRPO advantages by hand: (r - mean_g) / (unbiased std_g + 1e-6), exactly 0 for an all-equal group.
  std::vector<double> a_hand(12, 0.0);
  for (int grp = 0; grp < 3; ++grp) {
    double mean = 0, var = 0;
    for (int i = 0; i < 4; ++i) mean += rewards[grp * 4 + i].item<double>() / 4;
    for (int i = 0; i < 4; ++i) var += std::pow(rewards[grp * 4 + i].item<double>() - mean, 2) / 3;
    if (var == 0) continue;
    for (int i = 0; i < 4; ++i) a_hand[grp * 4 + i] = (rewards[grp * 4 + i].item<double>() - mean) / (std::sqrt(var) + 1e-6);
  }
  const auto a_expect = torch::tensor(a_hand, torch::kDouble);
  CHECK((adv - a_expect).abs().max().item<double>() <= 1e-12);
  CHECK((b.advantages - a_expect.unsqueeze(1) * b.completion_mask).abs().max().item<double>() <= 1e-12);

  {  // move the policy off pi_old so that the clip and the KL matter
    torch::NoGradGuard ng;
    for (auto& p : ms.policy.parameters()) p.add_(0.05 * torch::randn_like(p));
  }
  const auto t = g.loss(ms, b, info);
  REQUIRE(t.total.scalar_type() == torch::kDouble);
  {
    // The loss by hand: token log-probs from the model's logits through LibTorch's log_softmax (not
    // our log-prob op), then the GRPO formula in plain doubles.
    torch::NoGradGuard ng;
    const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1), B = b.size();
    const auto ids = torch::cat({b.prompt_ids, b.completion_ids}, 1), msk = torch::cat({b.prompt_mask, b.completion_mask}, 1);
    const auto logits = ms.policy.logits(ids.slice(1, 0, P + T - 1), msk.slice(1, 0, P + T - 1)).slice(1, P - 1, P + T - 1);
    REQUIRE(logits.scalar_type() == torch::kDouble);
    const auto lp = torch::log_softmax(logits, -1).gather(2, b.completion_ids.unsqueeze(2)).squeeze(2).contiguous();
    const auto lpa = lp.accessor<double, 2>();
    const auto old = b.old_logp.contiguous(), ref = b.ref_logp.contiguous();
    const auto olda = old.accessor<double, 2>(), refa = ref.accessor<double, 2>();
    const auto m = b.completion_mask.contiguous();
    const auto ma = m.accessor<float, 2>();
    double policy = 0, kl = 0, clipped = 0, tokens = 0;
    for (std::int64_t i = 0; i < B; ++i) {
      double ps = 0, ks = 0, n = 0;
      for (std::int64_t j = 0; j < T; ++j) {
        if (ma[i][j] == 0.f) continue;
        const double A = a_hand[static_cast<std::size_t>(i)], rho = std::exp(lpa[i][j] - olda[i][j]);
        const double unclipped = -A * rho, clip = -A * std::clamp(rho, 0.8, 1.28);
        ps += std::max(unclipped, clip);
        clipped += clip > unclipped ? 1 : 0;
        const double l = std::clamp(lpa[i][j] - refa[i][j], -20.0, 20.0);
        ks += std::min(std::exp(-l) - 1 + l, 10.0);
        n += 1;
      }
      policy += n > 0 ? ps / n / static_cast<double>(B) : 0.0;
      kl += n > 0 ? ks / n / static_cast<double>(B) : 0.0;
      tokens += n;
    }
    CHECK(t.policy == Approx(policy).margin(1e-12));
    CHECK(t.kl == Approx(kl).margin(1e-12));
    CHECK(t.total.item<double>() == Approx(policy + 0.05 * kl).margin(1e-12));
    CHECK(t.clip_fraction == Approx(clipped / tokens).margin(1e-12));
    CHECK(kl > 0.0);
  }

  // And a whole trainer step on a float64 model: the weights stay float64, the figures are finite.
  torch::manual_seed(22);
  auto m2 = small_gpt();
  m2.net()->to(torch::kDouble);
  trainer<models::gpt, algo::grpo<>, count_target> tr{
      std::move(m2), count_target{},
      {.algorithm = {.kl_coef = 0.05, .sampling = {.max_new_tokens = 4}}, .group_size = 4, .seed = 3, .progress = false}};
  const auto s = tr.step(prompt_batch{.tokens = {{2}, {3, 4}}});
  CHECK(std::isfinite(s.loss));
  CHECK(s.optimizer_steps == 1);
  for (const auto& p : tr.models().policy.parameters()) CHECK(p.scalar_type() == torch::kDouble);
}

// ---- Mixed precision and gradient accumulation (issue 12) ----------------------------------

namespace {
// count_target that also keeps the last rollout it scored (the batch the update trained on).
struct recording_target {
  std::shared_ptr<std::optional<token_rollout>> last = std::make_shared<std::optional<token_rollout>>();
  torch::Tensor operator()(const token_rollout& b) const {
    *last = b;
    return count_target{}(b);
  }
};
std::vector<torch::Tensor> weights_of(const models::gpt& m) {
  std::vector<torch::Tensor> w;
  for (const auto& p : m.parameters()) w.push_back(p.detach().clone());
  return w;
}
double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}
// One trainer step of algorithm A from a copy of `init`; returns the statistics and the weights after it.
template <class A>
std::pair<step_stats, std::vector<torch::Tensor>> one_step(const models::gpt& init,
                                                           typename trainer<models::gpt, A, recording_target>::options o,
                                                           const recording_target& r = {}) {
  trainer<models::gpt, A, recording_target> t{init.clone(), r, o};
  const auto s = t.step(prompt_batch{.tokens = {{2}, {3, 4}, {5}}});
  return {s, weights_of(t.models().policy)};
}
}  // namespace

TEST_CASE("gradient accumulation: micro-batches give the whole minibatch's loss, gradients and update in every "
          "loss_agg mode (GRPO and PPO)",
          "[cpu][token][accumulation]") {
  torch::manual_seed(40);
  const auto init = small_gpt();
  // lr / eps = 1 with eps >> |g|: AdamW's first step moves every weight by ~ -g (elementwise), so
  // equal updates mean equal gradients, not only equal signs.
  const train::optimizer_options sgd_like{.lr = 1e6, .eps = 1e6};
  const sampling_options samp{.max_new_tokens = 6, .stop_tokens = {0}};
  for (const auto agg : {algo::loss_agg::token_mean, algo::loss_agg::seq_mean_token_mean,
                         algo::loss_agg::seq_mean_token_sum_norm}) {
    for (const std::int64_t micro : {1, 5}) {
      DYNAMIC_SECTION("agg " << enum_to_string(agg) << ", micro_batch_size " << micro) {
        {  // GRPO, with a KL term and an entropy bonus so that every term of the loss is accumulated
          using A = algo::grpo<>;
          typename trainer<models::gpt, A, recording_target>::options o{
              .algorithm = {.kl_coef = 0.05, .agg = agg, .ent_coef = 0.01, .sampling = samp},
              .optim = sgd_like, .group_size = 4, .seed = 5, .progress = false};
          const auto [full, w_full] = one_step<A>(init, o);
          o.micro_batch_size = micro;
          const auto [acc, w_acc] = one_step<A>(init, o);
          CHECK(acc.loss == Approx(full.loss).epsilon(1e-5).margin(1e-7));
          CHECK(acc.grad_norm == Approx(full.grad_norm).epsilon(1e-5));
          CHECK(acc.entropy == Approx(full.entropy).epsilon(1e-5));
          const double moved = max_abs_diff(w_full, weights_of(init));
          CHECK(moved > 1e-3);
          CHECK(max_abs_diff(w_acc, w_full) <= 1e-4 * moved);
        }
        {  // PPO (critic, value loss, advantages whitened over the whole minibatch)
          using A = algo::ppo<>;
          typename trainer<models::gpt, A, recording_target>::options o{
              .algorithm = {.agg = agg, .track = {.sampling = samp}},
              .optim = sgd_like, .group_size = 4, .seed = 6, .progress = false};
          const auto [full, w_full] = one_step<A>(init, o);
          o.micro_batch_size = micro;
          const auto [acc, w_acc] = one_step<A>(init, o);
          CHECK(acc.loss == Approx(full.loss).epsilon(1e-5).margin(1e-7));
          CHECK(acc.value_loss == Approx(full.value_loss).epsilon(1e-5).margin(1e-7));
          CHECK(acc.grad_norm == Approx(full.grad_norm).epsilon(1e-5));
          const double moved = max_abs_diff(w_full, weights_of(init));
          CHECK(moved > 1e-3);
          CHECK(max_abs_diff(w_acc, w_full) <= 1e-4 * moved);
        }
      }
    }
  }
}

TEST_CASE("gradient accumulation: the token-mean normaliser is the whole minibatch's, not each micro-batch's",
          "[cpu][token][accumulation]") {
  torch::manual_seed(41);
  const auto init = small_gpt();
  using A = algo::grpo<>;
  recording_target rec;
  typename trainer<models::gpt, A, recording_target>::options o{
      .algorithm = {.agg = algo::loss_agg::token_mean, .sampling = {.max_new_tokens = 8, .stop_tokens = {0, 1}}},
      .group_size = 4, .seed = 9, .progress = false};
  const auto [full, w_full] = one_step<A>(init, o, rec);
  o.micro_batch_size = 4;  // three micro-batches of four completions
  const auto [acc, w_acc] = one_step<A>(init, o);
  REQUIRE(rec.last->has_value());
  token_rollout b = **rec.last;  // the batch both runs trained on (same seed, same sampler)
  const auto counts = b.completion_mask.sum(1).view({3, 4}).sum(1);  // valid tokens per micro-batch
  INFO("tokens per micro-batch: " << counts);
  REQUIRE(counts.max().item<double>() >= 1.5 * counts.min().item<double>());  // very different token counts

  CHECK(acc.loss == Approx(full.loss).epsilon(1e-6).margin(1e-7));
  CHECK(max_abs_diff(w_acc, w_full) <= 1e-6);

  // What per-micro-batch normalisation (each micro-batch's own token count, micro losses averaged)
  // gives on the same batch and initial weights: far from the whole minibatch's loss.
  auto ms = set_of(init.clone());
  A alg(o.algorithm);
  const step_info info{0, 4, torch::kCPU, nullptr, 1, nullptr};
  alg.advantage(ms, b, count_target{}(b), info);
  const double whole = alg.loss(ms, b, info).total.item<double>();
  double per_micro = 0;
  for (std::int64_t i = 0; i < 3; ++i)
    per_micro += alg.loss(ms, b.select(torch::arange(4 * i, 4 * i + 4, torch::kInt64)), info).total.item<double>() / 3;
  CHECK(whole == Approx(full.loss).epsilon(1e-5).margin(1e-7));
  CHECK(std::abs(per_micro - whole) > 1e-3 + 1e-3 * std::abs(whole));
}

TEST_CASE("mixed precision: a bf16 forward gives float32 log-probs and losses close to float32's", "[cpu][token][precision]") {
  torch::manual_seed(42);
  auto ms = set_of(small_gpt());
  algo::grpo<> alg({.kl_coef = 0.0, .ent_coef = 0.1, .reuse_on_policy_logp = false,
                    .sampling = {.max_new_tokens = 6}});
  const step_info info{0, 4, torch::kCPU, nullptr, 2, nullptr};  // two updates: pi_old from sampling (fp32)
  token_rollout b = alg.sample(ms, prompt_batch{.tokens = {{2}, {3, 4}, {5}}}, info);
  alg.advantage(ms, b, count_target{}(b), info);
  auto grads = [&](bool bf16) {
    for (auto& p : ms.policy.parameters()) p.mutable_grad() = torch::Tensor();
    loss_terms t;
    {
      autocast_scope amp(torch::kCPU, bf16 ? precision::bf16 : precision::fp32);
      t = alg.loss(ms, b, info);
      CHECK(t.total.scalar_type() == torch::kFloat);  // the loss is accumulated in float32
      const auto lp = rollout::update_logprob(ms.policy, b.trimmed(), 1.0, false, rollout::update_layout::padded).first;
      CHECK(lp.scalar_type() == torch::kFloat);       // log-probs from float32 logits
    }
    t.total.backward();
    std::vector<torch::Tensor> g;
    for (auto& p : ms.policy.parameters()) {
      CHECK(p.scalar_type() == torch::kFloat);
      CHECK(p.grad().scalar_type() == torch::kFloat);  // gradients land on the float32 master weights
      g.push_back(p.grad().reshape({-1}).clone());
    }
    return std::pair{t.total.item<double>(), torch::cat(g)};
  };
  const auto [l32, g32] = grads(false);
  const auto [l16, g16] = grads(true);
  CHECK(!unirl::detail::compat::autocast_state(c10::DeviceType::CPU).first);  // the scope restored the state
  CHECK(l16 == Approx(l32).epsilon(2e-2).margin(2e-3));
  const double cos = (g16 * g32).sum().item<double>() / (g16.norm() * g32.norm()).item<double>();
  CHECK(cos > 0.99);
  CHECK((g16 - g32).norm().item<double>() > 0.0);  // the bf16 path really ran in bfloat16
}

TEST_CASE("mixed precision: bf16 trainer steps keep float32 master weights and optimizer state", "[cpu][token][precision]") {
  torch::manual_seed(43);
  using T = trainer<models::gpt, algo::ppo<>, count_target>;
  T t{small_gpt(), count_target{},
      {.algorithm = {.track = {.sampling = {.max_new_tokens = 5}}}, .optim = {.lr = 1e-3}, .precision = precision::bf16,
       .group_size = 4, .seed = 2, .progress = false}};
  const auto before = weights_of(t.models().policy);
  for (int i = 0; i < 2; ++i) {
    const auto s = t.step(prompt_batch{.tokens = {{2}, {3, 4}}});
    CHECK(std::isfinite(s.loss));
    CHECK(s.optimizer_steps == 1);
    CHECK(s.extra.count("loss_scale") == 0);  // bf16 needs no loss scaling
  }
  CHECK(max_abs_diff(weights_of(t.models().policy), before) > 0.0);
  for (const auto& p : t.optimizer().parameters()) CHECK(p.scalar_type() == torch::kFloat);
  std::size_t states = 0;
  for (const auto& [k, st] : t.optimizer().torch_optimizer().state()) {
    (void)k;
    const auto& a = static_cast<const torch::optim::AdamWParamState&>(*st);
    CHECK(a.exp_avg().scalar_type() == torch::kFloat);
    CHECK(a.exp_avg_sq().scalar_type() == torch::kFloat);
    ++states;
  }
  CHECK(states == t.optimizer().parameters().size());
  // fp16 on this machine's CPU: supported from LibTorch 2.4 on; before, a config_error naming the key.
  if (!unirl::detail::compat::cpu_autocast_supports(torch::kHalf))
    CHECK_THROWS_WITH((T{small_gpt(), count_target{}, {.precision = precision::fp16, .group_size = 4}}),
                      Catch::Contains("option 'precision'") && Catch::Contains("bf16"));
}

TEST_CASE("loss scaling: an injected inf gradient halves the scale and skips the step; good steps grow it; "
          "a power-of-two scale changes nothing else",
          "[cpu][token][precision]") {
  using T = trainer<models::gpt, algo::grpo<>, count_target>;
  const prompt_batch in{.tokens = {{2}, {3, 4}}};
  torch::manual_seed(44);
  const auto init = small_gpt();
  T::options o{.algorithm = {.sampling = {.max_new_tokens = 5}}, .optim = {.lr = 1e-2}, .group_size = 4, .seed = 8,
               .progress = false};
  o.loss_scale = {.mode = train::loss_scaling::on, .init_scale = 1024, .growth_interval = 2};
  T t{init.clone(), count_target{}, o};
  auto inject = std::make_shared<bool>(true);
  t.models().policy.parameters().front().register_hook([inject](const torch::Tensor& g) {
    return *inject ? g * std::numeric_limits<float>::infinity() : g;
  });
  const auto before = weights_of(t.models().policy);
  const auto s0 = t.step(in);
  CHECK(s0.skipped_updates == 1);
  CHECK(s0.optimizer_steps == 0);
  CHECK(s0.extra.at("loss_scale") == 512.0);                      // halved
  CHECK(max_abs_diff(weights_of(t.models().policy), before) == 0.0);  // unchanged
  *inject = false;
  const auto s1 = t.step(in);
  CHECK(s1.optimizer_steps == 1);
  CHECK(s1.extra.at("loss_scale") == 512.0);   // one good step
  const auto s2 = t.step(in);
  CHECK(s2.extra.at("loss_scale") == 1024.0);  // growth_interval = 2 good steps: doubled
  CHECK(s2.skipped_total == 1);

  // Scaling by 2^k and unscaling is exact in binary floating point: the same weights bit for bit
  // as the unscaled run.
  auto run = [&](train::loss_scaling mode) {
    T::options p = o;
    p.loss_scale = {.mode = mode, .init_scale = 65536};
    T u{init.clone(), count_target{}, p};
    for (int i = 0; i < 2; ++i) u.step(in);
    return weights_of(u.models().policy);
  };
  CHECK(max_abs_diff(run(train::loss_scaling::on), run(train::loss_scaling::off)) == 0.0);
}

TEST_CASE("CUDA: bf16 and fp16 (dynamic loss scaling) trainer steps with float32 master weights", "[cuda][token][precision]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device");
    return;
  }
  for (const auto p : {precision::bf16, precision::fp16}) {
    torch::manual_seed(45);
    trainer<models::gpt, algo::grpo<>, count_target> t{
        small_gpt(), count_target{},
        {.algorithm = {.sampling = {.max_new_tokens = 5}}, .precision = p, .group_size = 4, .seed = 1,
         .device = "cuda", .progress = false}};
    for (int i = 0; i < 3; ++i) {
      const auto s = t.step(prompt_batch{.tokens = {{2}, {3, 4}}});
      CHECK(std::isfinite(s.loss));
      if (p == precision::fp16) CHECK(s.extra.at("loss_scale") > 0.0);
    }
    for (const auto& q : t.models().policy.parameters()) CHECK(q.scalar_type() == torch::kFloat);
  }
}

// ---- supervised fine-tuning (train/sft.hpp, train/supervised.hpp) ---------------------------
#include <unirl/train/sft.hpp>

namespace {
// A bigram LM with a known logit table: the logits at a position are row `ids[t]` of W (V, V),
// whatever came before, so the cross-entropy can be written down by hand.
class bigram_netImpl : public torch::nn::Cloneable<bigram_netImpl> {
 public:
  explicit bigram_netImpl(torch::Tensor w) : w0_(std::move(w)) { reset(); }
  void reset() override { w = register_parameter("w", w0_.clone()); }
  torch::Tensor w;

 private:
  torch::Tensor w0_;
};
TORCH_MODULE(bigram_net);

struct bigram_lm : models::module_adapter<bigram_lm, bigram_net> {
  using track = token_track;
  struct cache_type {};
  using module_adapter::module_adapter;
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor&) const {
    return net()->w.index_select(0, ids.reshape({-1})).view({ids.size(0), ids.size(1), -1});
  }
  torch::Tensor logits_packed(const torch::Tensor& ids, const torch::Tensor&, const torch::Tensor&) const {
    return logits(ids, ids);
  }
  cache_type make_cache(std::int64_t, std::int64_t) const { return {}; }
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& m, cache_type&) const { return logits(ids, m); }
  std::int64_t vocab_size() const { return net()->w.size(0); }
};
static_assert(PackedCausalLM<bigram_lm>);

double bigram_w(std::int64_t i, std::int64_t j) { return 0.3 * static_cast<double>(i) - 0.2 * static_cast<double>(j) + (i == j ? 0.5 : 0.0) + 0.05 * static_cast<double>(i * j % 3); }
}  // namespace

TEST_CASE("sft_loss is the cross-entropy of the completion tokens only, on known logits", "[cpu][sft]") {
  constexpr std::int64_t V = 6;
  auto w = torch::empty({V, V}, torch::kFloat);
  for (std::int64_t i = 0; i < V; ++i)
    for (std::int64_t j = 0; j < V; ++j) w[i][j] = bigram_w(i, j);
  bigram_lm model{bigram_net(w)};
  const std::vector<std::vector<std::int64_t>> prompts{{1, 2, 3}, {4}, {0, 5}}, answers{{5, 0}, {2, 2, 3, 1}, {4}};
  // By hand: -log softmax(W[prev])[next] over the completion tokens only (prev: the token before).
  double sum = 0;
  std::int64_t n = 0;
  for (std::size_t s = 0; s < prompts.size(); ++s) {
    std::vector<std::int64_t> seq = prompts[s];
    seq.insert(seq.end(), answers[s].begin(), answers[s].end());
    for (std::size_t k = prompts[s].size(); k < seq.size(); ++k) {
      const auto prev = seq[k - 1], next = seq[k];
      double z = 0;
      for (std::int64_t j = 0; j < V; ++j) z += std::exp(bigram_w(prev, j));
      sum += -(bigram_w(prev, next) - std::log(z));
      ++n;
    }
  }
  const auto b = train::make_sft_batch(prompts, answers, /*pad_id=*/0);
  CHECK(b.tokens() == 7);
  CHECK(n == 7);
  CHECK(train::sft_loss(model, b).item<double>() == Approx(sum / 7.0).epsilon(1e-6));
  CHECK(train::sft_loss(model, b, train::sft_layout::packed).item<double>() == Approx(sum / 7.0).epsilon(1e-6));
  // The prompt is context only: changing a prompt token that predicts nothing of the completion
  // (the first of a 3-token prompt) leaves the loss unchanged; the padding id does not matter.
  const auto b2 = train::make_sft_batch({{4, 2, 3}, {4}, {3, 5}}, answers, /*pad_id=*/5);
  CHECK(train::sft_loss(model, b2).item<double>() == Approx(sum / 7.0).epsilon(1e-6));
  // Gradient: only the rows of W that predict a completion token get one.
  auto loss = train::sft_loss(model, b);
  loss.backward();
  const auto g = model.net()->w.grad().abs().sum(1);
  CHECK(g[1].item<double>() == 0.0);  // 1 predicts 2, a prompt token
  CHECK(g[3].item<double>() > 0.0);   // 3 predicts 5 (completion) and 1 (completion)
  CHECK(g[5].item<double>() > 0.0);
  CHECK_THROWS_WITH(train::sft_loss(model, train::sft_batch{b.ids, b.mask, b.mask}),
                    Catch::Contains("expected (B, L), (B, L) and (B, L-1)"));
}

TEST_CASE("sft_loss: packed and padded batches give the same loss and gradients", "[cpu][sft]") {
  torch::manual_seed(3);
  auto model = small_gpt(11, 24);
  const std::vector<std::vector<std::int64_t>> prompts{{1, 2, 3, 4, 5}, {6}, {7, 8}, {9, 1, 2}},
      answers{{3}, {4, 5, 6, 7, 8, 9}, {10, 1}, {2, 3, 4}};
  const auto b = train::make_sft_batch(prompts, answers, /*pad_id=*/0);
  auto grads = [&](train::sft_layout layout) {
    for (auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
    auto loss = train::sft_loss(model, b, layout);
    loss.backward();
    std::vector<torch::Tensor> g;
    for (auto& p : model.parameters()) g.push_back(p.grad().clone());
    return std::pair{loss.item<double>(), g};
  };
  const auto [padded, gp] = grads(train::sft_layout::padded);
  const auto [packed, gk] = grads(train::sft_layout::packed);
  CHECK(packed == Approx(padded).epsilon(1e-6));
  for (std::size_t i = 0; i < gp.size(); ++i) CHECK(torch::allclose(gp[i], gk[i], 1e-4, 1e-6));
  // Each sequence alone (no padding at all), token-weighted: the same mean.
  double total = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i)
    total += train::sft_loss(model, train::make_sft_batch({prompts[i]}, {answers[i]}, 0)).item<double>() *
             static_cast<double>(answers[i].size());
  CHECK(padded == Approx(total / 12.0).epsilon(1e-5));  // 1 + 6 + 2 + 3 completion tokens
}

TEST_CASE("sft_trainer: resume from a checkpoint is bit-identical", "[cpu][sft]") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("unirl_sft_" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  // Batches drawn from LibTorch's generator: the checkpoint's generator state must bring them back.
  auto next = [](std::int64_t n) {
    const auto p = torch::randint(1, 11, {n, 3}, torch::kInt64), c = torch::randint(1, 11, {n, 2}, torch::kInt64);
    std::vector<std::vector<std::int64_t>> ps, cs;
    for (std::int64_t i = 0; i < n; ++i) {
      ps.push_back({p[i][0].item<std::int64_t>(), p[i][1].item<std::int64_t>(), p[i][2].item<std::int64_t>()});
      cs.push_back({c[i][0].item<std::int64_t>(), c[i][1].item<std::int64_t>()});
    }
    return train::make_sft_batch(ps, cs, 0);
  };
  using sft_t = train::sft_trainer<models::gpt>;
  const sft_t::options o{.optim = {.lr = 3e-3, .weight_decay = 0.01},
                         .schedule = {.kind = train::schedule_kind::cosine, .warmup_steps = 2},
                         .clip = {.max_grad_norm = 0.5},
                         .batch_size = 8,
                         .steps = 6,
                         .seed = 7,
                         .progress = false};
  torch::manual_seed(1);
  sft_t straight(small_gpt(11, 16), o);
  std::vector<double> losses;
  for (int i = 0; i < 6; ++i) losses.push_back(straight.step(next(8)).loss);

  // Through run(): 3 steps into a run directory, then a fresh trainer (other weights) resumes to 6.
  auto first = o;
  first.steps = 3;
  first.out = (dir / "run").string();
  first.metrics_path = (dir / "metrics.jsonl").string();
  torch::manual_seed(1);
  sft_t a(small_gpt(11, 16), first);
  const auto ra = a.run(next);
  CHECK(ra.steps == 3);
  CHECK_FALSE(ra.resumed);
  CHECK(fs::exists(dir / "run" / "checkpoints" / "step-00000003.pt"));
  auto second = first;
  second.steps = 6;
  torch::manual_seed(99);
  sft_t b(small_gpt(11, 16), second);
  std::vector<double> resumed_losses;
  const auto rb = b.run([&](std::int64_t n) { return next(n); });
  CHECK(rb.resumed);
  CHECK(rb.first_step == 3);
  CHECK(rb.steps == 3);
  CHECK(rb.loss_last == losses[5]);
  const auto pa = straight.model().parameters(), pb = b.model().parameters();
  REQUIRE(pa.size() == pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i], pb[i]));
  // metrics.jsonl: one row per step, the resumed process appending.
  const auto rows = train::read_metrics(first.metrics_path);
  REQUIRE(rows.size() == 6);
  CHECK(rows[5]["step"] == 5);
  CHECK(rows[5]["loss"].get<double>() == losses[5]);
  CHECK(rows[0]["tokens"] == 16);
  CHECK(rows[0]["grad_norm"].get<double>() > 0.0);
  // A finished run loads and trains no more (a cache); another stage's checkpoint is refused.
  sft_t c(small_gpt(11, 16), second);
  CHECK(c.run(next).steps == 0);
  CHECK(c.step_count() == 6);
  CHECK_THROWS_WITH(c.load((dir / "missing.pt").string()), Catch::Contains("no such file"));
  // Extra states (a data set's position) are checked against the checkpoint before anything changes.
  struct position {
    std::int64_t at = 0;
    void save(torch::serialize::OutputArchive& a) const { a.write("at", torch::tensor(at)); }
    void load(torch::serialize::InputArchive& a) {
      torch::Tensor t;
      a.read("at", t);
      at = t.item<std::int64_t>();
    }
  } pos;
  CHECK_THROWS_WITH(c.load((dir / "run" / "checkpoints" / "step-00000006.pt").string(), pos),
                    Catch::Contains("supervised_trainer::load") && Catch::Contains("extra.0 is missing from the checkpoint"));
  CHECK(c.step_count() == 6);
  fs::remove_all(dir);
}

namespace {
// Prompt "a+b=" and completion "<sum>." over a 13-symbol vocabulary, every pair 0..9.
std::pair<std::vector<std::vector<std::int64_t>>, std::vector<std::vector<std::int64_t>>> addition_problems() {
  const std::string alphabet = "0123456789+=.";
  auto enc = [&](const std::string& s) {
    std::vector<std::int64_t> v;
    for (char ch : s) v.push_back(static_cast<std::int64_t>(alphabet.find(ch)) + 1);  // 0: padding
    return v;
  };
  std::vector<std::vector<std::int64_t>> prompts, answers;
  for (int a = 0; a < 10; ++a)
    for (int b = 0; b < 10; ++b) {
      prompts.push_back(enc(std::to_string(a) + "+" + std::to_string(b) + "="));
      answers.push_back(enc(std::to_string(a + b) + "."));
    }
  return {prompts, answers};
}

// A 1-layer GPT (seed 0) trained by `sft_trainer` with `o` on the 100 problems, served by `data`
// (passed to run() as its extra); the loss on all of them before and after.
struct addition_run {
  double before = 0, after = 0;
  std::int64_t steps = 0;
  models::gpt model;
};
addition_run run_addition_sft(const train::sft_trainer<models::gpt>::options& o, train::sft_dataset& data) {
  const auto [prompts, answers] = addition_problems();
  const auto all = train::make_sft_batch(prompts, answers, 0);
  torch::manual_seed(0);
  auto model = models::gpt(models::gpt_options{.vocab_size = 14, .max_len = 8, .n_layer = 1, .n_head = 2, .d_model = 32});
  train::sft_trainer<models::gpt> t(model, o);
  addition_run out{train::sft_loss(model, all).item<double>(), 0, 0, model};
  out.steps = t.run([&](std::int64_t n) { return data.next(n); }, nullptr, data).steps;
  out.after = train::sft_loss(model, all).item<double>();
  return out;
}
}  // namespace

TEST_CASE("sft_trainer: a short run learns single-digit addition", "[cpu][sft]") {
  const auto [prompts, answers] = addition_problems();
  train::sft_dataset data(prompts, answers, 0, /*seed=*/1);
  const auto r = run_addition_sft({.optim = {.lr = 1e-2},
                                   .schedule = {.kind = train::schedule_kind::cosine, .warmup_steps = 10},
                                   .batch_size = 25,
                                   .steps = data.steps_for(60, 25),
                                   .progress = false},
                                  data);
  CHECK(r.steps == 240);
  CHECK(data.epoch() == 59);
  INFO("loss on all 100 problems: " << r.before << " -> " << r.after);
  CHECK(r.before > 2.0);          // about log(14) at the start
  CHECK(r.after < 0.25 * r.before);
}

TEST_CASE("sft_trainer: under bf16 autocast, in micro-batches, the loss falls", "[cpu][sft][engine][precision]") {
  const auto [prompts, answers] = addition_problems();
  train::sft_dataset data(prompts, answers, 0, /*seed=*/1);
  const auto r = run_addition_sft({.optim = {.lr = 1e-2},
                                   .schedule = {.kind = train::schedule_kind::cosine, .warmup_steps = 10},
                                   .precision = precision::bf16,
                                   .micro_batch_size = 13,
                                   .batch_size = 25,
                                   .steps = 80,
                                   .progress = false},
                                  data);
  CHECK(r.steps == 80);
  {  // what ran is the bf16 forward: under the trainer's autocast the logits are bfloat16
    const auto all = train::make_sft_batch(prompts, answers, 0);
    autocast_scope amp(torch::kCPU, precision::bf16);
    CHECK(r.model.logits(all.ids, all.mask).scalar_type() == torch::kBFloat16);
  }
  INFO("bf16 SFT, loss on all 100 problems: " << r.before << " -> " << r.after);
  CHECK(r.before > 2.0);
  CHECK(r.after < 0.5 * r.before);
  for (const auto& p : r.model.parameters()) CHECK(p.scalar_type() == torch::kFloat);  // float32 master weights
}

// Not run by default (hidden tag): figures for docs/training.md. Run one section per process so
// that each has its own peak resident memory:
//   unit_token "[bench][precision]" -c fp32    /    -c bf16
TEST_CASE("bench: one GRPO step of a small GPT in fp32 and bf16 (time, peak memory)", "[.][bench][precision]") {
  auto run = [](precision p) {
    torch::manual_seed(46);
    models::gpt m(models::gpt_options{.vocab_size = 512, .max_len = 192, .n_layer = 4, .n_head = 4, .d_model = 256});
    trainer<models::gpt, algo::grpo<>, count_target> t{
        std::move(m), count_target{},
        {.algorithm = {.sampling = {.max_new_tokens = 128}}, .precision = p, .group_size = 8, .seed = 1,
         .progress = false}};
    prompt_batch in;
    for (std::int64_t i = 0; i < 4; ++i) in.tokens.push_back(std::vector<std::int64_t>(32, 2 + i));
    t.step(in);  // warm-up
    double update = 0, sample = 0, peak = 0;
    const int n = 3;
    for (int i = 0; i < n; ++i) {
      const auto s = t.step(in);
      update += s.time_update / n;
      sample += s.time_sample / n;
      if (s.extra.count("memory/update_peak_mb")) peak = std::max(peak, s.extra.at("memory/update_peak_mb"));
    }
    std::cout << enum_to_string(p) << ": update " << update << " s, sample " << sample << " s, update peak RSS "
              << peak << " MB\n";
  };
  SECTION("fp32") { run(precision::fp32); }
  SECTION("bf16") { run(precision::bf16); }
}
