// The rollout engine (issue 24) on the built-in GPT: paged forward and engine logits equal the
// full forward, per-sequence streams make completions independent of scheduling, pause / resume,
// the prefix cache's invalidation, memory accounting, errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/models/gpt.hpp>
#include <unirl/rollout/engine.hpp>

using namespace unirl;

namespace {
models::gpt engine_gpt(torch::ScalarType dtype, std::int64_t vocab = 11, std::int64_t max_len = 96) {
  torch::manual_seed(3);
  models::gpt m{models::gpt_options{.vocab_size = vocab, .max_len = max_len, .n_layer = 2, .n_head = 2, .d_model = 32}};
  m.net()->to(dtype);
  m.train(false);
  return m;
}
std::vector<std::int64_t> random_ids(std::mt19937& rng, std::int64_t n, std::int64_t vocab) {
  std::uniform_int_distribution<std::int64_t> d(0, vocab - 1);
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}
// logits() over one whole sequence: (L, V).
torch::Tensor full_logits(const models::gpt& m, const std::vector<std::int64_t>& ids) {
  const auto t = torch::tensor(ids, torch::kInt64).unsqueeze(0);
  return m.logits(t, torch::ones({1, t.size(1)})).squeeze(0);
}
double tol(torch::ScalarType dt) { return dt == torch::kDouble ? 1e-10 : 1e-5; }
// Every result's kept logits and log-probs against logits() over prompt + completion.
void check_against_full(const models::gpt& m, const std::vector<rollout::request>& reqs,
                        const std::vector<rollout::result>& results, torch::ScalarType dt) {
  for (const auto& r : results) {
    auto seq = reqs[static_cast<std::size_t>(r.request)].prompt;
    const auto P = static_cast<std::int64_t>(seq.size());
    seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
    const auto T = static_cast<std::int64_t>(r.tokens.size());
    const auto ref = full_logits(m, seq).slice(0, P - 1, P - 1 + T);
    REQUIRE(r.logits.defined());
    REQUIRE(r.logits.size(0) == T);
    CHECK((r.logits - ref).abs().max().item<double>() < tol(dt));
    const auto lsm = torch::log_softmax(ref.to(torch::kDouble), -1);
    for (std::int64_t t = 0; t < T; ++t)
      CHECK(std::abs(r.logp[static_cast<std::size_t>(t)] - lsm[t][r.tokens[static_cast<std::size_t>(t)]].item<double>()) <
            10 * tol(dt));
  }
}
}  // namespace

TEST_CASE("engine: the paged forward equals logits() over each whole sequence (scattered blocks, two chunks)",
          "[cpu][rollout][engine]") {
  for (const auto dt : {torch::kFloat, torch::kDouble}) {
    const auto m = engine_gpt(dt);
    torch::NoGradGuard ng;
    std::mt19937 rng(1);
    const std::int64_t bs = 4;
    rollout::block_pool pool{64, bs};
    auto kv = m.make_paged_kv(pool.blocks() * bs);
    // Scatter the blocks: take some and give every other one back first.
    std::vector<std::int32_t> scratch;
    pool.grow(scratch, 40);
    pool.release(scratch);
    const std::vector<std::int64_t> lens{1, 7, 13, 4, 22};
    std::vector<std::vector<std::int64_t>> seqs;
    std::vector<std::vector<std::int32_t>> tables(lens.size());
    for (const auto l : lens) seqs.push_back(random_ids(rng, l, 11));
    // Step 1: the first part of every sequence; step 2: the rest (one token for some: the decode group).
    std::vector<std::int64_t> split{1, 6, 5, 3, 10};
    std::map<std::size_t, torch::Tensor> got;
    for (int step = 0; step < 2; ++step) {
      std::vector<rollout::paged_chunk_spec> specs;
      std::vector<std::size_t> which;
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        const auto a = step == 0 ? 0 : split[i], b = step == 0 ? split[i] : lens[i];
        if (a == b) continue;
        REQUIRE(pool.grow(tables[i], b));
        specs.push_back({std::vector<std::int64_t>(seqs[i].begin() + a, seqs[i].begin() + b), a, &tables[i]});
        which.push_back(i);
      }
      const auto batch = rollout::make_paged_batch(specs, bs, {}, torch::kCPU);
      const auto out = m.logits_paged(batch, kv);
      REQUIRE(out.size(0) == batch.tokens());
      std::int64_t row = 0;
      for (std::size_t j = 0; j < which.size(); ++j) {
        const auto n = static_cast<std::int64_t>(specs[j].ids.size());
        const auto part = out.slice(0, row, row + n);
        got[which[j]] = got.count(which[j]) ? torch::cat({got[which[j]], part}) : part;
        row += n;
      }
    }
    for (std::size_t i = 0; i < seqs.size(); ++i)
      CHECK((got[i] - full_logits(m, seqs[i])).abs().max().item<double>() < tol(dt));
  }
}

TEST_CASE("engine: logits through the engine equal logits() - mixed prompt lengths, chunked prefill, shared "
          "prefixes with copy-on-write", "[cpu][rollout][engine]") {
  for (const auto dt : {torch::kFloat, torch::kDouble}) {
    const auto m = engine_gpt(dt);
    std::mt19937 rng(2);
    std::vector<rollout::request> reqs;
    const std::vector<std::int64_t> lens{3, 9, 1, 17, 6};
    for (std::size_t i = 0; i < lens.size(); ++i)
      reqs.push_back({.prompt = random_ids(rng, lens[i], 11),
                      .sampling = {.max_new_tokens = 5 + static_cast<std::int64_t>(i) * 3, .stop_tokens = {0}},
                      .seed = i, .n = i % 2 == 0 ? 3 : 1});
    // Small blocks and a small token budget: prompts are split across steps and blocks, and the
    // prompts of 3, 9, 17 tokens leave a partial last block that the group's samples share.
    for (const std::int64_t budget : {4, 7, 64}) {
      rollout::engine eng{m, {.block_size = 4, .kv_tokens = 512, .max_sequences = 6, .max_batch_tokens = budget,
                              .keep_logits = true}};
      for (const auto& r : reqs) eng.submit(r);
      const auto results = eng.run();
      std::int64_t expected = 0;
      for (const auto& r : reqs) expected += r.n;
      REQUIRE(static_cast<std::int64_t>(results.size()) == expected);
      check_against_full(m, reqs, results, dt);
      CHECK(eng.stats().used_blocks == 0);  // every block came back
    }
  }
}

namespace {
struct completion {
  std::vector<std::int64_t> tokens;
  std::vector<double> logp;
};
std::map<std::pair<std::int64_t, std::int64_t>, completion> run_requests(const models::gpt& m,
                                                                        const std::vector<rollout::request>& reqs,
                                                                        std::int64_t max_sequences,
                                                                        const std::vector<std::size_t>& order,
                                                                        std::int64_t budget = 64) {
  rollout::engine eng{m, {.block_size = 8, .kv_tokens = 4096, .max_sequences = max_sequences,
                          .max_batch_tokens = budget}};
  std::map<std::int64_t, std::int64_t> id_to_req;
  for (const auto i : order) id_to_req[eng.submit(reqs[i])] = static_cast<std::int64_t>(i);
  std::map<std::pair<std::int64_t, std::int64_t>, completion> out;
  for (auto& r : eng.run()) out[{id_to_req[r.request], r.sample}] = {r.tokens, r.logp};
  return out;
}
std::vector<rollout::request> stream_requests(std::int64_t top_k, std::int64_t group = 1) {
  std::mt19937 rng(5);
  std::vector<rollout::request> reqs;
  std::uniform_int_distribution<std::int64_t> len(1, 12), lim(1, 20);
  for (std::uint64_t i = 0; i < 24; ++i)
    reqs.push_back({.prompt = random_ids(rng, len(rng), 11),
                    .sampling = {.max_new_tokens = lim(rng), .top_k = top_k, .stop_tokens = {0}},
                    .seed = 1000 + i, .n = i % 3 == 0 ? group : 1});
  return reqs;
}
}  // namespace

TEST_CASE("engine: per-sequence streams - the same completions with max_sequences 1, 8, 64 and any arrival order",
          "[cpu][rollout][engine]") {
  std::vector<std::size_t> order(24);
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto shuffled = order;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(9));
  {
    // Single samples with max_sequences 1, 8, 64; groups of 4 (a group enters whole) with 4, 8, 64.
    const auto m = engine_gpt(torch::kDouble);
    for (const std::int64_t group : {1, 4}) {
      const auto reqs = stream_requests(0, group);
      const auto ref = run_requests(m, reqs, group, order);
      REQUIRE(ref.size() == 8 * static_cast<std::size_t>(group) + 16);
      for (const auto& [seqs, ord, budget] : {std::tuple{8L, order, 64L}, std::tuple{64L, order, 64L},
                                              std::tuple{64L, shuffled, 64L}, std::tuple{8L, shuffled, 5L}}) {
        const auto got = run_requests(m, reqs, seqs, ord, budget);
        REQUIRE(got.size() == ref.size());
        for (const auto& [key, c] : ref) {
          const auto& g = got.at(key);
          REQUIRE(g.tokens == c.tokens);
          for (std::size_t t = 0; t < c.logp.size(); ++t) CHECK(std::abs(g.logp[t] - c.logp[t]) < 1e-12);
        }
      }
    }
  }
  {
    // float32, greedy (top_k = 1): identical tokens.
    const auto m = engine_gpt(torch::kFloat);
    const auto reqs = stream_requests(1, 4);
    const auto ref = run_requests(m, reqs, 4, order);
    for (const auto& [seqs, ord] : {std::pair{8L, order}, std::pair{64L, shuffled}}) {
      const auto got = run_requests(m, reqs, seqs, ord);
      for (const auto& [key, c] : ref) CHECK(got.at(key).tokens == c.tokens);
    }
    // temperature = 0 is greedy: the tokens and log-probs of top_k = 1 at temperature 1.
    auto cold = stream_requests(0, 4);
    for (auto& r : cold) r.sampling.temperature = 0.0;
    const auto got = run_requests(m, cold, 4, order);  // the reference's schedule: equal to the bit
    REQUIRE(got.size() == ref.size());
    for (const auto& [key, c] : ref) {
      const auto& g = got.at(key);
      REQUIRE(g.tokens == c.tokens);
      for (std::size_t t = 0; t < c.logp.size(); ++t) CHECK(g.logp[t] == c.logp[t]);
    }
  }
  {
    // float32, sampled: ulp-level differences between batch shapes may flip a draw; measure how often.
    const auto m = engine_gpt(torch::kFloat);
    const auto reqs = stream_requests(0, 4);
    const auto ref = run_requests(m, reqs, 4, order);
    const auto got = run_requests(m, reqs, 64, shuffled);
    std::int64_t tokens = 0, differ = 0;
    for (const auto& [key, c] : ref) {
      const auto& g = got.at(key).tokens;
      // Tokens up to and including the first difference count (after it the sequences diverge).
      for (std::size_t t = 0; t < std::min(g.size(), c.tokens.size()); ++t) {
        ++tokens;
        if (g[t] != c.tokens[t]) {
          ++differ;
          break;
        }
      }
    }
    const double rate = static_cast<double>(differ) / static_cast<double>(tokens);
    WARN("float32 sampled tokens that differ between max_sequences 4 (in order) and 64 (shuffled): " << differ << " of " << tokens
                                                                                          << " (" << rate << ")");
    CHECK(rate <= 0.01);
  }
}

namespace {
std::string letters(const std::vector<std::int64_t>& t) {
  std::string s;
  for (const auto x : t) s += static_cast<char>('a' + x);
  return s;
}
}  // namespace

TEST_CASE("engine: pause at a stop string keeps the blocks; resume appends tokens without prefilling the past and "
          "its logits equal a full re-prefill", "[cpu][rollout][engine]") {
  for (const auto dt : {torch::kFloat, torch::kDouble}) {
    const auto m = engine_gpt(dt);
    std::mt19937 rng(4);
    rollout::engine eng{m, {.block_size = 4, .kv_tokens = 1024, .max_sequences = 8, .keep_logits = true}, letters};
    // Token 2 decodes to "c": with 11 tokens a sample emits it soon. "</tool_call>" works the same.
    std::vector<rollout::request> reqs;
    for (std::uint64_t i = 0; i < 4; ++i)
      reqs.push_back({.prompt = random_ids(rng, 5 + static_cast<std::int64_t>(i), 11),
                      .sampling = {.max_new_tokens = 30}, .seed = 50 + i, .stop_strings = {"c"},
                      .pause_at_stop_string = true});
    for (const auto& r : reqs) eng.submit(r);
    std::vector<rollout::result> first;
    while (eng.has_work())
      for (auto& r : eng.step()) first.push_back(std::move(r));
    std::int64_t paused = 0;
    for (const auto& r : first) {
      if (r.reason != rollout::finish_reason::paused) continue;
      ++paused;
      CHECK(letters(r.tokens).find('c') == letters(r.tokens).size() - 1);  // the turn ends at the stop string
      auto history = reqs[static_cast<std::size_t>(r.request)].prompt;
      history.insert(history.end(), r.tokens.begin(), r.tokens.end());
      const std::vector<std::int64_t> reply{7, 8, 9};  // a tool's reply
      history.insert(history.end(), reply.begin(), reply.end());
      const auto blocks_before = eng.pool().used_blocks();
      eng.resume(r.sequence, reply, 6);
      std::vector<rollout::result> second;
      bool first_step = true;
      while (eng.has_work()) {
        auto out = eng.step();
        if (first_step) {
          // The past is not prefilled again: the last sampled token and the reply only.
          CHECK(eng.stats().prefill_tokens == 4);
          CHECK(eng.stats().tokens == 4);
          first_step = false;
        }
        for (auto& x : out) second.push_back(std::move(x));
      }
      REQUIRE(second.size() == 1);
      const auto& s = second.front();
      const auto H = static_cast<std::int64_t>(history.size());
      auto whole = history;
      whole.insert(whole.end(), s.tokens.begin(), s.tokens.end());
      const auto ref = full_logits(m, whole).slice(0, H - 1, H - 1 + static_cast<std::int64_t>(s.tokens.size()));
      CHECK((s.logits - ref).abs().max().item<double>() < tol(dt));
      if (s.reason == rollout::finish_reason::paused) eng.release(s.sequence);
      CHECK(blocks_before > 0);
    }
    CHECK(paused >= 2);
    CHECK_THROWS_WITH(eng.resume(12345, {1}), Catch::Contains("sequence 12345 is not paused"));
  }
}

TEST_CASE("engine: the prefix cache serves equal prefixes and never a prefix cached under other weights",
          "[cpu][rollout][engine]") {
  auto m = engine_gpt(torch::kDouble);
  std::mt19937 rng(6);
  const auto prompt = random_ids(rng, 14, 11);
  rollout::engine eng{m, {.block_size = 4, .kv_tokens = 256, .keep_logits = true}};
  const rollout::request req{.prompt = prompt, .sampling = {.max_new_tokens = 4}, .seed = 1};
  eng.submit(req);
  auto a = eng.run();
  CHECK(eng.stats().prefix_hit_tokens == 0);
  eng.submit(req);
  auto b = eng.run();
  CHECK(eng.stats().prefix_hit_tokens == 12);  // three full blocks; the last token is always computed
  CHECK(b.front().tokens == a.front().tokens);
  check_against_full(m, {req, req}, b, torch::kDouble);  // request ids 0, 1
  // New weights: the engine is told, and the same prompt is prefilled again under them.
  {
    torch::NoGradGuard ng;
    for (auto& p : m.net()->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
  eng.set_weight_version(1);
  eng.submit(req);
  auto c = eng.run();
  CHECK(eng.stats().prefix_hit_tokens == 12);  // no hit after the update
  check_against_full(m, {req, req, req}, c, torch::kDouble);
  eng.submit(req);
  (void)eng.run();
  CHECK(eng.stats().prefix_hit_tokens == 24);  // the new weights' blocks are served again
}

TEST_CASE("engine: KV memory - a group of 8 holds one prompt + 8 completions; a long-tail rollout at most its live "
          "tokens in blocks", "[cpu][rollout][engine]") {
  const auto m = engine_gpt(torch::kFloat, 11, 600);
  std::mt19937 rng(7);
  const std::int64_t bs = 16, T = 12, G = 8;
  auto blocks = [bs](std::int64_t tokens) { return (tokens + bs - 1) / bs; };
  // 60 tokens: a partial last block, copied by 7 of the 8 samples; 512 tokens: 32 full blocks.
  for (const std::int64_t P : {60, 512}) {
    rollout::engine eng{m, {.block_size = bs, .kv_tokens = 8192}};
    eng.submit({.prompt = random_ids(rng, P, 11), .sampling = {.max_new_tokens = T}, .seed = 3, .n = G});
    std::int64_t peak = 0;
    while (eng.has_work()) {
      (void)eng.step();
      peak = std::max(peak, eng.stats().used_blocks);
      CHECK(eng.stats().kv_bytes == eng.stats().used_blocks * bs * eng.slot_bytes());
    }
    // One prompt + G completions (each with its copy of the prompt's partial block), not G prompts.
    CHECK(peak <= blocks(P) + G * blocks(P % bs + T));
    CHECK(peak * 2 < G * blocks(P + T));
    WARN("group of " << G << " from a " << P << "-token prompt, " << T << " new tokens each: peak " << peak
                     << " blocks (" << peak * bs * eng.slot_bytes() << " bytes); unshared: " << G * blocks(P + T));
  }
  {
    rollout::engine eng{m, {.block_size = bs, .kv_tokens = 4096, .max_sequences = 16}};
    std::geometric_distribution<std::int64_t> tail(0.08);
    for (std::uint64_t i = 0; i < 40; ++i)
      eng.submit({.prompt = random_ids(rng, 8, 11), .sampling = {.max_new_tokens = std::min<std::int64_t>(1 + tail(rng), 100)},
                  .seed = i});
    while (eng.has_work()) {
      (void)eng.step();
      CHECK(eng.stats().used_blocks <= eng.stats().live_token_blocks);
    }
    CHECK(eng.stats().used_blocks == 0);
  }
}

TEST_CASE("engine: preemption when the pool runs out gives the same completions", "[cpu][rollout][engine]") {
  const auto m = engine_gpt(torch::kDouble);
  const auto reqs = stream_requests(0, 4);
  std::vector<std::size_t> order(reqs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto ref = run_requests(m, reqs, 64, order);
  rollout::engine eng{m, {.block_size = 8, .kv_tokens = 96, .max_sequences = 64}};
  std::map<std::int64_t, std::int64_t> id_to_req;
  for (const auto i : order) id_to_req[eng.submit(reqs[i])] = static_cast<std::int64_t>(i);
  std::map<std::pair<std::int64_t, std::int64_t>, completion> got;
  for (auto& r : eng.run()) got[{id_to_req[r.request], r.sample}] = {r.tokens, r.logp};
  CHECK(eng.stats().preemptions > 0);
  REQUIRE(got.size() == ref.size());
  for (const auto& [key, c] : ref) {
    REQUIRE(got.at(key).tokens == c.tokens);
    for (std::size_t t = 0; t < c.logp.size(); ++t) CHECK(std::abs(got.at(key).logp[t] - c.logp[t]) < 1e-12);
  }
}

TEST_CASE("engine: bad requests are errors naming the value", "[cpu][rollout][engine]") {
  const auto m = engine_gpt(torch::kFloat, 11, 32);
  rollout::engine eng{m, {.block_size = 4, .kv_tokens = 16}, letters};
  CHECK_THROWS_WITH(eng.submit({.prompt = std::vector<std::int64_t>(30, 1), .sampling = {.max_new_tokens = 5}}),
                    Catch::Contains("a request of 30 tokens plus max_new_tokens = 5 is longer than the model's context (32"));
  CHECK_THROWS_WITH(eng.submit({.prompt = std::vector<std::int64_t>(10, 1), .sampling = {.max_new_tokens = 10}}),
                    Catch::Contains("needs 5 blocks of 4; the pool has 4"));
  CHECK_THROWS_WITH(eng.submit({.prompt = {1}, .stop_strings = {""}}), Catch::Contains("a stop string is empty"));
  CHECK_THROWS_WITH(eng.submit({.prompt = {1, 11}}), Catch::Contains("token id 11 is outside [0, vocab_size = 11)"));
  CHECK_THROWS_WITH(eng.submit({.prompt = {}}), Catch::Contains("prompt is empty"));
  CHECK_THROWS_WITH(eng.submit({.prompt = {1}, .n = 65}), Catch::Contains("request.n = 65 exceeds max_sequences = 64"));
  rollout::engine no_decoder{m, {.block_size = 4, .kv_tokens = 64}};
  CHECK_THROWS_WITH(no_decoder.submit({.prompt = {1}, .stop_strings = {"</tool_call>"}}),
                    Catch::Contains("stop strings need a decoder"));
}

TEST_CASE("engine: the inverse-CDF draw follows the model's distribution; top-k's dropped tokens are never drawn; "
          "non-finite logits are an error",
          "[cpu][rollout][engine]") {
  const auto m = engine_gpt(torch::kDouble);
  const std::vector<std::int64_t> prompt{3, 1, 4, 1, 5};
  // Temperature 0.05 sharpens the random model's near-uniform distribution, so a draw that
  // ignored the probabilities (uniform, or always the most likely token) could not pass.
  const double T = 0.05;
  const auto p = torch::softmax(full_logits(m, prompt)[4] / T, -1);
  const auto V = p.size(0);
  auto draw = [&](std::int64_t top_k, std::int64_t requests) {
    rollout::engine eng{m, {.block_size = 4, .kv_tokens = 64 * 8, .max_sequences = 64}};
    for (std::int64_t i = 0; i < requests; ++i)
      eng.submit({.prompt = prompt, .sampling = {.max_new_tokens = 1, .temperature = T, .top_k = top_k},
                  .seed = static_cast<std::uint64_t>(100 + i), .n = 64});
    return eng.run();
  };
  const auto all = draw(0, 40);
  std::vector<double> count(static_cast<std::size_t>(V), 0.0);
  for (const auto& r : all) {
    REQUIRE(r.tokens.size() == 1);
    count[static_cast<std::size_t>(r.tokens[0])] += 1;
    // the recorded log-prob is the temperature-scaled distribution's
    CHECK(std::abs(r.logp[0] - std::log(p[r.tokens[0]].item<double>())) < 1e-10);
  }
  const double N = static_cast<double>(all.size());
  REQUIRE(N == 2560);
  double pmax = 0;
  for (std::int64_t i = 0; i < V; ++i) {
    const double pi = p[i].item<double>(), f = count[static_cast<std::size_t>(i)] / N;
    pmax = std::max(pmax, pi);
    INFO("token " << i << ": p " << pi << ", drawn " << f);
    CHECK(std::abs(f - pi) <= 5.0 * std::sqrt(pi * (1.0 - pi) / N) + 1e-3);  // 5 standard errors
  }
  REQUIRE(pmax < 0.9);        // not a point mass: the frequencies say something
  REQUIRE(pmax > 2.0 / V);    // not uniform
  // top_k = 3: only the three most likely tokens
  const auto top3 = std::get<1>(p.topk(3));
  for (const auto& r : draw(3, 4)) CHECK((top3 == r.tokens[0]).any().item<bool>());
  // A model whose logits hold NaN: the step says so.
  auto bad = engine_gpt(torch::kDouble);
  {
    torch::NoGradGuard ng;
    bad.net()->parameters().back().fill_(std::numeric_limits<double>::quiet_NaN());
  }
  rollout::engine eng{bad, {.block_size = 4, .kv_tokens = 64}};
  eng.submit({.prompt = prompt, .sampling = {.max_new_tokens = 2}});
  CHECK_THROWS_WITH(eng.run(), Catch::Contains("a next-token distribution holds NaN"));
}
