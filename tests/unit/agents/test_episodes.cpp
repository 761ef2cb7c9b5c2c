// Multi-turn episodes on the rollout engine (issue 25): a trajectory's ids equal the chat
// template's rendering of the same conversation (Qwen3's tokenizer), the policy's tokens are kept
// as sampled and the rest tokenized once (ids that do not survive decode / encode stay), resumed
// logits equal a full forward over the trajectory, tool faults in a rollout are replies and
// counters, GRPO over episodes trains the policy tokens only (its loss against the formula,
// and a policy that learns), and PPO over episodes: GAE over the policy tokens against its
// definition, no gradient off the policy mask, a return that improves.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <zlib.h>

#include <unirl/models/char_tokenizer.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/agents/remote_environment.hpp>
#include <unirl/envs/guess_number.hpp>
#include <unirl/multi_turn.hpp>
#include <unirl/agents/demonstration.hpp>
#include <unirl/tokenizers/tokenizers.hpp>

#include "env_server_child.hpp"

using namespace unirl;
using namespace unirl::agents;
using nlohmann::json;

namespace {
std::string gunzip(const std::filesystem::path& p) {
  gzFile f = gzopen(p.string().c_str(), "rb");
  REQUIRE(f != nullptr);
  std::string out;
  char buf[1 << 16];
  for (int n; (n = gzread(f, buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  gzclose(f);
  return out;
}

// The built-in GPT with a fixed logit bias and, at chosen positions, a forced token (+1e4): a
// policy whose turns a test scripts, in float64 so the forcing leaves the rest exact. Both
// forwards the rollout and the loss use (`logits`, `logits_paged`) add the same terms.
struct steered_gpt : models::gpt {
  torch::Tensor bias;                                   // (V,) float64
  std::shared_ptr<std::map<std::int64_t, std::int64_t>> force =
      std::make_shared<std::map<std::int64_t, std::int64_t>>();  // position -> token written there

  steered_gpt(models::gpt g, torch::Tensor b) : models::gpt(std::move(g)), bias(std::move(b)) {}
  steered_gpt clone() const {
    steered_gpt c{models::gpt::clone(), bias};
    c.force = force;
    return c;
  }
  torch::Tensor steer(torch::Tensor logits, const torch::Tensor& positions) const {  // (N, V), (N,) predicting positions + 1
    logits = logits + bias.to(logits.scalar_type());
    const auto pos = positions.to(torch::kCPU).contiguous();
    for (std::int64_t i = 0; i < pos.numel(); ++i)
      if (const auto it = force->find(pos.data_ptr<std::int64_t>()[i] + 1); it != force->end())
        logits[i][it->second] += 1e4;
    return logits;
  }
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const {
    const auto raw = models::gpt::logits(ids, mask);
    const auto pos = (mask.cumsum(1) - 1).to(torch::kInt64);
    return steer(raw.reshape({-1, raw.size(-1)}), pos.reshape({-1})).view(raw.sizes());
  }
  torch::Tensor logits_paged(const paged_batch& b, paged_kv& kv) const {
    const auto raw = models::gpt::logits_paged(b, kv);
    const auto pos = b.output_rows.defined() ? b.positions.index_select(0, b.output_rows) : b.positions;
    return steer(raw, pos);
  }
};
static_assert(PagedCausalLM<steered_gpt>);

steered_gpt make_policy(std::int64_t vocab, std::int64_t max_len, std::int64_t d_model = 16,
                        torch::ScalarType dtype = torch::kDouble, std::int64_t n_layer = 1) {
  torch::manual_seed(11);
  models::gpt g{models::gpt_options{.vocab_size = vocab, .max_len = max_len, .n_layer = n_layer, .n_head = 2, .d_model = d_model}};
  g.net()->to(dtype);
  g.train(false);
  return steered_gpt{std::move(g), torch::zeros({vocab}, torch::kDouble)};
}

// Every policy turn's kept logits against the full forward over the finished trajectory.
void check_resumed_logits(const steered_gpt& m, const trajectory& t) {
  const auto ids = torch::tensor(t.tokens, torch::kInt64).unsqueeze(0);
  const auto full = m.logits(ids, torch::ones({1, ids.size(1)})).squeeze(0);  // (L, V)
  std::vector<std::int64_t> rows;
  for (std::size_t j = 1; j < t.tokens.size(); ++j)
    if (t.policy[j]) rows.push_back(static_cast<std::int64_t>(j) - 1);
  REQUIRE(!t.logits.empty());
  const auto kept = torch::cat(t.logits, 0);
  REQUIRE(kept.size(0) == static_cast<std::int64_t>(rows.size()));
  const auto ref = full.index_select(0, torch::tensor(rows, torch::kInt64));
  CHECK((kept - ref).abs().max().item<double>() < 1e-9);
  const auto lsm = torch::log_softmax(ref, -1);
  for (std::size_t k = 0, j = 1; j < t.tokens.size(); ++j)
    if (t.policy[j]) {
      CHECK(std::abs(t.logp[j] - lsm[static_cast<std::int64_t>(k)][t.tokens[j]].item<double>()) < 1e-9);
      ++k;
    }
}

// "What is A*B?": the answer in the final turn scores 1.
struct product_env {
  std::int64_t a = 0, b = 0;
  text_observation reset(std::uint64_t seed) {
    a = 2 + static_cast<std::int64_t>(seed % 7);
    b = 3 + static_cast<std::int64_t>(seed % 5);
    return {.text = "What is " + std::to_string(a) + "*" + std::to_string(b) + "?"};
  }
  text_step step(const std::string& action) {
    return {.reward = action.find(std::to_string(a * b)) != std::string::npos ? 1.0 : 0.0, .done = true};
  }
};
static_assert(TextEnvironment<product_env>);

struct multiplier {
  std::string name() const { return "calculator"; }
  std::string description() const { return "Multiplies: expression \"A*B\"."; }
  json parameters() const {
    return {{"type", "object"}, {"properties", {{"expression", {{"type", "string"}}}}}, {"required", {"expression"}}};
  }
  std::string call(const json& args) const {
    const auto e = args["expression"].get<std::string>();
    const auto star = e.find('*');
    if (star == std::string::npos) throw std::invalid_argument("expected A*B, got " + e);
    return std::to_string(std::stoll(e.substr(0, star)) * std::stoll(e.substr(star + 1)));
  }
};
}  // namespace

TEST_CASE("episodes: the trajectory's ids equal Qwen3's template rendering of the conversation, tokenized once",
          "[agents][cpu]") {
  const auto tok = tokenizers::bpe_tokenizer::from_json_text(
      gunzip(std::filesystem::path(UNIRL_SOURCE_DIR) / "tests/fixtures/tokenizers/qwen3/tokenizer.json.gz"));
  toolbox<multiplier> tools{{.timeout_seconds = 5.0}, multiplier{}};
  using tokenizers::chat_format;
  const std::string call = tokenizers::tool_call_text("calculator", {{"expression", "6*7"}});
  const std::vector<tokenizers::chat_message> conv{
      {"user", "What is 6*7?"}, {"assistant", call}, {"tool", "42"}, {"assistant", "The answer is 42."}};
  // What the template renders; the trajectory ends at the policy's last <|im_end|>.
  auto text = tokenizers::apply_chat_template(chat_format::chatml, conv, false, tools.definitions());
  REQUIRE(text.back() == '\n');
  text.pop_back();
  const auto expected = tok.encode(text);
  const auto prompt = tok.encode(tokenizers::apply_chat_template(chat_format::chatml, {conv[0]}, true, tools.definitions()));
  const auto turn1 = tok.encode(call + "<|im_end|>");
  const auto turn2 = tok.encode("The answer is 42.<|im_end|>");
  REQUIRE(turn1.size() > 3);
  const auto P = prompt.size(), n1 = turn1.size(), n2 = turn2.size();
  const auto c = expected.size() - P - n1 - n2;
  std::vector<std::uint8_t> policy(expected.size(), 0);
  for (std::size_t j = P; j < P + n1; ++j) policy[j] = 1;
  for (std::size_t j = P + n1 + c; j < expected.size(); ++j) policy[j] = 1;

  // The tokenizer: Qwen3's, its ids renumbered densely over those this conversation uses (so the
  // test's model has a small vocabulary); an id outside them is an error.
  std::map<std::int64_t, std::int64_t> dense;
  std::vector<std::int64_t> qwen;
  for (const auto id : expected)
    if (dense.emplace(id, static_cast<std::int64_t>(qwen.size())).second) qwen.push_back(id);
  std::vector<std::int64_t> want;
  for (const auto id : expected) want.push_back(dense.at(id));
  auto model = make_policy(static_cast<std::int64_t>(qwen.size()), 512);
  for (std::size_t j = 0; j < want.size(); ++j)
    if (policy[j]) (*model.force)[static_cast<std::int64_t>(j)] = want[j];
  std::int64_t encodes = 0, decodes = 0;
  const agent_text io{.encode =
                          [&](const std::string& s) {
                            ++encodes;
                            std::vector<std::int64_t> out;
                            for (const auto id : tok.encode(s)) out.push_back(dense.at(id));
                            return out;
                          },
                      .decode =
                          [&](const std::vector<std::int64_t>& ids) {
                            ++decodes;
                            std::vector<std::int64_t> q;
                            for (const auto id : ids) q.push_back(qwen.at(static_cast<std::size_t>(id)));
                            return tok.decode(q);
                          }};
  torch::NoGradGuard ng;
  const auto out = run_episodes(model, product_env{}, {4}, /*group=*/3, tools, io,
                                {.format = chat_format::chatml, .max_turns = 3, .max_turn_tokens = 40,
                                 .max_episode_tokens = 500, .engine = {.keep_logits = true}});
  REQUIRE(out.episodes.size() == 3);
  for (const auto& t : out.episodes) {
    CHECK(t.tokens == want);
    CHECK(t.policy == policy);
    CHECK(t.turns() == 2);
    CHECK(t.tool_calls == 1);
    CHECK(t.reward == 1.0);
    CHECK(t.end == episode_end::done);
    CHECK(t.context_segments == 2);  // the prompt and the tool reply, each tokenized once
    check_resumed_logits(model, t);
  }
  // The prompt once for the task's group, one continuation per episode: nothing else encoded.
  CHECK(encodes == 1 + 3);
  CHECK(out.stats.at("encode_calls") == 4.0);
  CHECK(out.stats.at("tool/ok") == 3.0);
  CHECK(out.stats.at("tool_call_rate") == 1.0);
  CHECK(out.stats.at("turns_mean") == 2.0);
  CHECK(decodes > 0);  // turns are read (stop strings, calls), never re-encoded

  // A demonstration of the same conversation (the supervised stage's input) is the same tokens
  // with the same policy mask: SFT imitates exactly the layout RL samples.
  const auto demo = demonstration_trajectory(chat_format::chatml, conv, io.encode, tools.definitions());
  CHECK(demo.tokens == want);
  CHECK(demo.policy == policy);
  CHECK(demo.turns() == 2);
  // Messages after the last assistant message are left out; a tool reply without an assistant
  // message after it does not enter either.
  auto longer = conv;
  longer.push_back({"user", "Thanks."});
  CHECK(demonstration_trajectory(chat_format::chatml, longer, io.encode, tools.definitions()).tokens == want);
}

TEST_CASE("demonstrations: every chat format lays a conversation out as its template renders it; bad ones are named",
          "[agents][cpu]") {
  const models::char_tokenizer tok([] {
    std::string s = "\n";
    for (char ch = 32; ch < 127; ++ch) s += ch;
    return s;
  }());
  const token_encoder enc = [&](const std::string& s) { return tok.encode(s); };
  using tokenizers::chat_format;
  const std::vector<tokenizers::chat_message> conv{{"user", "Guess my number."}, {"assistant", "50"},
                                                   {"user", "Lower."},           {"assistant", "25"},
                                                   {"user", "Higher."},          {"assistant", "37"}};
  for (const auto f : {chat_format::chatml, chat_format::qwen2_5, chat_format::llama3, chat_format::plain}) {
    const auto t = demonstration_trajectory(f, conv, enc, {}, "Play well.");
    auto with_system = conv;
    with_system.insert(with_system.begin(), {"system", "Play well."});
    // The whole conversation's rendering, up to the last turn's end marker (a newline follows it in ChatML).
    const auto stop = unirl::agents::detail::turn_stop(f);
    auto whole = tokenizers::apply_chat_template(f, with_system, false);
    whole.resize(whole.rfind(stop) + stop.size());
    CHECK(tok.decode(t.tokens) == whole);
    // The policy's tokens are exactly the three answers, each with its end marker (and, in plain,
    // the space its template writes after "Assistant:").
    std::string trained;
    for (std::size_t i = 0; i < t.tokens.size(); ++i)
      if (t.policy[i]) trained += tok.decode({t.tokens[i]});
    const std::string lead = f == chat_format::plain ? " " : "";
    CHECK(trained == lead + "50" + stop + lead + "25" + stop + lead + "37" + stop);
    CHECK(t.turns() == 3);
  }
  auto error_of = [&](const std::vector<tokenizers::chat_message>& m) {
    try {
      demonstration_trajectory(chat_format::chatml, m, enc);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(error_of({{"user", "hi"}, {"robot", "x"}}), Catch::Contains("message 1 has role 'robot'"));
  CHECK_THAT(error_of({{"user", "hi"}, {"user", "again"}}), Catch::Contains("no assistant message"));
  CHECK_THAT(error_of({{"assistant", "first"}}), Catch::Contains("has no user or tool message before it"));
  CHECK_THAT(error_of({{"user", "hi"}, {"assistant", "a"}, {"system", "late"}, {"assistant", "b"}}),
             Catch::Contains("message 2 is a system message"));
}

namespace {
// Printable ASCII and a newline, plus one id that decodes like 'a' (an id decode / encode would lose).
const std::string ascii = [] {
  std::string s = "\n";
  for (char ch = 32; ch < 127; ++ch) s += ch;
  return s;
}();
struct aliased_text {
  models::char_tokenizer tok{ascii};
  std::int64_t alias() const { return tok.vocab_size(); }  // the id after the padding id
  std::int64_t vocab() const { return tok.vocab_size() + 1; }
  agent_text io(std::int64_t* encodes) const {
    return {.encode = [this, encodes](const std::string& s) { ++*encodes; return tok.encode(s); },
            .decode = [this](const std::vector<std::int64_t>& ids) {
              std::string out;
              for (const auto i : ids) out += i == alias() ? std::string("a") : tok.decode({i});
              return out;
            }};
  }
};
// Three turns of "higher / lower" feedback; reward 0.25 per turn, the episode ends at turn 3.
struct feedback_env {
  int turn = 0;
  std::uint64_t seed = 0;
  text_observation reset(std::uint64_t s) {
    turn = 0;
    seed = s;
    return {.text = "Guess my number (" + std::to_string(s) + ")."};
  }
  text_step step(const std::string&) {
    ++turn;
    return {.observation = {.text = turn % 2 ? "Higher." : "Lower."}, .reward = 0.25, .done = turn == 3};
  }
};
}  // namespace

TEST_CASE("episodes: policy tokens kept as sampled over many turns, resumed logits equal a full forward",
          "[agents][cpu]") {
  const aliased_text text;
  auto model = make_policy(text.vocab(), 256);
  model.bias[text.tok.id('\n')] = 4.0;  // turns end ("\n\n") after a few tokens
  model.bias[text.tok.pad_id()] = -1e4;
  std::int64_t encodes = 0;
  const auto io = text.io(&encodes);
  // The first policy token of every episode is the alias id (it decodes as 'a').
  const auto P = static_cast<std::int64_t>(
      text.tok.encode(tokenizers::apply_chat_template(tokenizers::chat_format::plain, {{"user", "Guess my number (1)."}})).size());
  (*model.force)[P] = text.alias();
  torch::NoGradGuard ng;
  torch::manual_seed(5);
  const auto out = run_episodes(model, feedback_env{}, {1, 2}, /*group=*/4, io,
                                {.format = tokenizers::chat_format::plain, .max_turns = 5, .max_turn_tokens = 12,
                                 .max_episode_tokens = 200, .engine = {.block_size = 8, .max_sequences = 3, .keep_logits = true}});
  REQUIRE(out.episodes.size() == 8);
  std::int64_t segments = 0, multi = 0;
  for (const auto& t : out.episodes) {
    check_resumed_logits(model, t);
    segments += t.context_segments;
    multi += t.turns() > 1;
    if (t.task == 0) {
      CHECK(t.tokens[static_cast<std::size_t>(P)] == text.alias());  // kept, not re-encoded to 'a'
      CHECK(t.policy[static_cast<std::size_t>(P)] == 1);
      CHECK(text.tok.encode(io.decode(t.tokens)) != t.tokens);     // what a re-encode would have changed
    }
    if (t.end == episode_end::done) {
      CHECK(t.turns() == 3);
      CHECK(t.reward == 0.75);
    }
    CHECK(t.turns() <= 5);
    CHECK(t.size() <= 200);
    CHECK(t.turn_rewards.size() == static_cast<std::size_t>(t.turns()));
  }
  CHECK(multi > 0);  // some episodes went past their first turn (resumed)
  // One encode per context segment, the prompt once per task (its group shares it).
  CHECK(encodes == segments - 8 + 2);
  CHECK(out.stats.at("episodes") == 8.0);
}

namespace {
struct broken_tool {
  std::string name() const { return "broken"; }
  std::string description() const { return "Fails."; }
  json parameters() const { return {{"type", "object"}}; }
  std::string call(const json&) const { throw std::runtime_error("disk on fire"); }
};
struct slow_tool {
  std::string name() const { return "slow"; }
  std::string description() const { return "Takes long."; }
  json parameters() const { return {{"type", "object"}}; }
  std::string call(const json&, std::stop_token st) const {
    for (int i = 0; i < 3000 && !st.stop_requested(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return "late";
  }
  std::string call(const json& a) const { return call(a, std::stop_token{}); }
};
// Ends after two turns; scores 1 when the first turn's replies came back as errors.
struct two_turns {
  int turn = 0;
  text_observation reset(std::uint64_t) {
    turn = 0;
    return {.text = "Use the tools."};
  }
  text_step step(const std::string&) { return {.observation = {.text = "Again."}, .done = ++turn == 2}; }
};
}  // namespace

TEST_CASE("episodes: a tool that throws or times out is an error reply and a counter, never a hang", "[agents][cpu]") {
  const aliased_text text;
  auto model = make_policy(text.vocab(), 420);
  model.bias[text.tok.id('\n')] = 4.0;
  model.bias[text.tok.pad_id()] = -1e4;
  model.bias[text.alias()] = -1e4;
  const std::string first = "<tool_call>{\"name\": \"broken\"}</tool_call><tool_call>{\"name\": \"slow\"}</tool_call>"
                            "<tool_call>{\"name\": \"nope\"}</tool_call>\n\n";
  const auto P = static_cast<std::int64_t>(
      text.tok.encode(tokenizers::apply_chat_template(tokenizers::chat_format::plain, {{"user", "Use the tools."}})).size());
  const auto ids = text.tok.encode(first);
  for (std::size_t j = 0; j < ids.size(); ++j) (*model.force)[P + static_cast<std::int64_t>(j)] = ids[j];
  toolbox<broken_tool, slow_tool> tools{{.timeout_seconds = 0.05, .threads = 2}, broken_tool{}, slow_tool{}};
  std::int64_t encodes = 0;
  torch::NoGradGuard ng;
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = run_episodes(model, two_turns{}, {3}, /*group=*/2, tools, text.io(&encodes),
                                {.format = tokenizers::chat_format::plain, .max_turns = 4, .max_turn_tokens = 160,
                                 .max_episode_tokens = 400});
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 2.5);  // not the 3 s call
  CHECK(out.stats.at("tool/calls") == 6.0);
  CHECK(out.stats.at("tool/threw") == 2.0);
  CHECK(out.stats.at("tool/timed_out") == 2.0);
  CHECK(out.stats.at("tool/unknown_tool") == 2.0);
  for (const auto& t : out.episodes) {
    CHECK(t.tool_calls == 3);
    std::vector<std::int64_t> context;
    for (std::size_t j = static_cast<std::size_t>(t.prompt_tokens); j < t.tokens.size(); ++j)
      if (!t.policy[j]) context.push_back(t.tokens[j]);
    const auto replies = text.tok.decode(context);
    CHECK(replies.find("Tool: error: the tool 'broken' failed: disk on fire\n\n") != std::string::npos);
    CHECK(replies.find("Tool: error: the tool 'slow' did not answer within 0.05") != std::string::npos);
    CHECK(replies.find("Tool: error: there is no tool named 'nope'; the tools are broken, slow") != std::string::npos);
  }
}

TEST_CASE("episode GRPO: the loss is GRPO's on the policy tokens only, per token or per episode", "[agents][cpu]") {
  auto model = make_policy(12, 64, 16);
  // Two episodes: policy tokens at 3..5 and 8..9 (a reply in between), and 3..4.
  trajectory a, b;
  a.append_context({1, 2, 3});
  a.append_policy({4, 5, 6}, {-1.0, -2.0, -1.5});
  a.append_context({7, 8});
  a.append_policy({9, 10}, {-0.5, -3.0});
  a.reward = 1.0;
  b.append_context({1, 2, 3});
  b.append_policy({11, 4}, {-2.0, -1.0});
  b.reward = 0.0;
  const auto batch = make_episode_batch({a, b}, 0);
  CHECK(batch.ids.sizes() == torch::IntArrayRef{2, 10});
  CHECK(batch.policy_mask.sum().item<double>() == 7.0);
  const auto adv = torch::tensor({0.7, -0.7}, torch::kDouble);
  for (const auto agg : {algo::loss_agg::token_mean, algo::loss_agg::seq_mean_token_mean}) {
    episode_grpo<steered_gpt> learner{model, {.algorithm = {.clip_low = 0.2, .clip_high = 0.28, .agg = agg,
                                                           .recompute_old_logp = false}}};
    const auto terms = learner.loss(batch, adv, batch.old_logp);
    // The formula on the policy tokens alone, from a plain forward.
    torch::NoGradGuard ng;
    double total = 0, count = 0, per_episode = 0;
    for (int e = 0; e < 2; ++e) {
      const auto& t = e == 0 ? a : b;
      const auto ids = torch::tensor(t.tokens, torch::kInt64).unsqueeze(0);
      const auto lsm = torch::log_softmax(model.logits(ids, torch::ones({1, ids.size(1)})).squeeze(0), -1);
      double sum = 0, n = 0;
      for (std::size_t j = 1; j < t.tokens.size(); ++j) {
        if (!t.policy[j]) continue;
        const double ratio = std::exp(lsm[static_cast<std::int64_t>(j) - 1][t.tokens[j]].item<double>() - t.logp[j]);
        const double A = adv[e].item<double>();
        const double l = std::max(-A * ratio, -A * std::clamp(ratio, 0.8, 1.28));
        sum += l;
        ++n;
      }
      total += sum;
      count += n;
      per_episode += sum / n / 2.0;
    }
    const double want = agg == algo::loss_agg::token_mean ? total / count : per_episode;
    CHECK(terms.total.item<double>() == Approx(want).epsilon(1e-10));
  }
  // kl_coef > 0 without a reference: named before any work.
  CHECK_THROWS_WITH((episode_grpo<steered_gpt>{model, {.algorithm = {.kl_coef = 0.1}}}), Catch::Contains("reference"));
}

namespace {
// Rollouts of 16 tasks a step (seeds step * 100 + i, `group` episodes each) and `update` on
// them until the mean reward passes `goal` or `steps` run out: the first and the last mean reward.
template <class Env, class Update>
std::pair<double, double> train_until(const steered_gpt& model, const Env& env, std::int64_t group, const agent_text& io,
                                      const agent_options& o, int steps, double goal, Update&& update) {
  std::vector<std::uint64_t> seeds(16);
  double first = -1, last = 0;
  torch::manual_seed(1);
  for (int step = 0; step < steps; ++step) {
    for (std::size_t i = 0; i < seeds.size(); ++i) seeds[i] = static_cast<std::uint64_t>(step * 100 + i);
    episodes_result out;
    {
      torch::NoGradGuard ng;
      out = run_episodes(model, env, seeds, group, io, o);
    }
    last = out.stats.at("reward_mean");
    if (first < 0) first = last;
    if (last > goal) break;
    update(out);
  }
  return {first, last};
}
}  // namespace

namespace {
// Scores 1 when the answer starts with a digit.
struct digit_env {
  text_observation reset(std::uint64_t) { return {.text = "Say a digit."}; }
  text_step step(const std::string& a) { return {.reward = !a.empty() && a[0] >= '0' && a[0] <= '9' ? 1.0 : 0.0, .done = true}; }
};
}  // namespace

TEST_CASE("episode GRPO: a policy learns from episode rewards (the rollout on the engine, the update on policy tokens)",
          "[agents][cpu]") {
  const aliased_text text;
  auto model = make_policy(text.vocab(), 64, 32);
  model.bias[text.tok.pad_id()] = -1e4;
  model.bias[text.alias()] = -1e4;
  std::int64_t encodes = 0;
  const auto io = text.io(&encodes);
  episode_grpo<steered_gpt> learner{model, {.algorithm = {.agg = algo::loss_agg::token_mean}, .optim = {.lr = 1e-2}}};
  const auto [first, last] = train_until(
      model, digit_env{}, 8, io,
      {.format = tokenizers::chat_format::plain, .max_turns = 1, .max_turn_tokens = 2, .max_episode_tokens = 40}, 30, 0.8,
      [&](const episodes_result& out) {
        const auto s = learner.step(out.episodes, 8, text.tok.pad_id());
        CHECK(s.at("updates") == 1.0);
        CHECK(s.at("ratio_mean") == Approx(1.0).margin(1e-9));  // pi_old at the update's geometry
      });
  CHECK(first < 0.3);
  CHECK(last > 0.8);
}

namespace {
// GAE over the policy positions of each row by its definition, in float64: A_i = sum over the
// policy positions k >= i of (gamma lambda)^(k - i) delta_k, delta_k = r_k + gamma V_next(k) - V_k.
std::vector<std::vector<double>> gae_by_definition(const torch::Tensor& r, const torch::Tensor& v, const torch::Tensor& pm,
                                                   double gamma, double lambda) {
  std::vector<std::vector<double>> out(static_cast<std::size_t>(pm.size(0)), std::vector<double>(static_cast<std::size_t>(pm.size(1)), 0.0));
  for (std::int64_t b = 0; b < pm.size(0); ++b) {
    std::vector<std::int64_t> pos;
    for (std::int64_t t = 0; t < pm.size(1); ++t)
      if (pm[b][t].item<double>() != 0.0) pos.push_back(t);
    std::vector<double> delta;
    for (std::size_t k = 0; k < pos.size(); ++k) {
      const double next = k + 1 < pos.size() ? v[b][pos[k + 1]].item<double>() : 0.0;
      delta.push_back(r[b][pos[k]].item<double>() + gamma * next - v[b][pos[k]].item<double>());
    }
    for (std::size_t i = 0; i < pos.size(); ++i) {
      double a = 0;
      for (std::size_t k = i; k < pos.size(); ++k) a += std::pow(gamma * lambda, static_cast<double>(k - i)) * delta[k];
      out[static_cast<std::size_t>(b)][static_cast<std::size_t>(pos[i])] = a;
    }
  }
  return out;
}
// Three turns with context between them; each turn's reward is known.
std::vector<trajectory> ppo_episodes() {
  trajectory a, b;
  a.append_context({1, 2});
  a.append_policy({3, 4}, {-1.0, -1.5});
  a.end_turn(1.0);
  a.append_context({5, 6});
  a.append_policy({7}, {-0.5});
  a.end_turn(0.5);
  b.append_context({1, 2, 3});
  b.append_policy({8, 9, 10}, {-2.0, -1.0, -1.0});
  b.end_turn(-0.25);
  b.append_context({11});
  b.append_policy({4, 5}, {-0.5, -0.5});
  b.end_turn(0.0);
  b.append_context({6});
  b.append_policy({9}, {-1.0});
  b.end_turn(2.0);
  return {a, b};
}
}  // namespace

TEST_CASE("episode PPO: GAE over the policy tokens equals a float64 reference, turn rewards on each turn's last token",
          "[agents][cpu]") {
  const auto eps = ppo_episodes();
  const auto batch = make_episode_batch(eps, 0);
  const auto L = batch.ids.size(1);
  REQUIRE(L == 11);
  const auto r = turn_token_rewards(eps, L);
  // Episode a: tokens 3 and 6 end its turns (columns 2 and 5); b: tokens 5, 8 and 10 (columns 4, 7, 9).
  CHECK(r[0][2].item<double>() == 1.0);
  CHECK(r[0][5].item<double>() == 0.5);
  CHECK(r[1][4].item<double>() == -0.25);
  CHECK(r[1][7].item<double>() == 0.0);
  CHECK(r[1][9].item<double>() == 2.0);
  CHECK(r.abs().sum().item<double>() == 3.75);
  // Values off the policy mask are 9: they must not enter any advantage.
  auto v = torch::full({2, L - 1}, 9.0, torch::kDouble);
  v[0][1] = 0.2;
  v[0][2] = 0.4;
  v[0][5] = 0.3;
  torch::manual_seed(3);
  for (const auto c : {2, 3, 4, 6, 7, 9}) v[1][c] = torch::rand({}, torch::kDouble) - 0.5;
  for (const auto [gamma, lambda] : {std::pair{0.9, 0.8}, std::pair{1.0, 0.95}, std::pair{0.5, 0.0}}) {
    const auto g = masked_gae(r, v, batch.policy_mask, gamma, lambda);
    const auto want = gae_by_definition(r, v, batch.policy_mask, gamma, lambda);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t t = 0; t < L - 1; ++t) {
        CHECK(g.advantages[b][t].item<double>() == Approx(want[b][t]).margin(1e-14));
        const double ret = batch.policy_mask[b][t].item<double>() != 0.0 ? want[b][t] + v[b][t].item<double>() : 0.0;
        CHECK(g.returns[b][t].item<double>() == Approx(ret).margin(1e-14));
      }
    if (gamma == 0.9) {
      // By hand for episode a: delta = (0 + 0.9*0.4 - 0.2, 1 + 0.9*0.3 - 0.4, 0.5 - 0.3) = (0.16, 0.87, 0.2),
      // A = (0.16 + 0.72*1.014, 0.87 + 0.72*0.2, 0.2) = (0.89008, 1.014, 0.2).
      CHECK(g.advantages[0][1].item<double>() == Approx(0.89008).margin(1e-14));
      CHECK(g.advantages[0][2].item<double>() == Approx(1.014).margin(1e-14));
      CHECK(g.advantages[0][5].item<double>() == Approx(0.2).margin(1e-14));
      CHECK(g.returns[0][1].item<double>() == Approx(1.09008).margin(1e-14));
      CHECK(g.advantages[0][0].item<double>() == 0.0);
      CHECK(g.advantages[0][3].item<double>() == 0.0);  // a context token between the turns
    }
  }
  // A reward on a context token would be dropped: an error naming it.
  auto bad = r.clone();
  bad[0][3] = 1.0;
  CHECK_THROWS_WITH(masked_gae(bad, v, batch.policy_mask, 1.0, 1.0), Catch::Contains("position 3"));
}

TEST_CASE("episode PPO: a token off the policy mask gets no gradient (policy, entropy and value terms)", "[agents][cpu]") {
  auto model = make_policy(12, 64, 16);
  const auto eps = ppo_episodes();
  episode_ppo<steered_gpt> learner{model, {.algorithm = {.ent_coef = 0.01, .gamma = 0.9, .lambda = 0.8}}};
  const auto batch = make_episode_batch(eps, 0);
  const auto tg = learner.prepare(batch, eps);
  const auto pm = batch.policy_mask.to(torch::kDouble), off = 1.0 - pm;
  CHECK((tg.returns * off).abs().max().item<double>() == 0.0);  // no value target off the mask
  CHECK((tg.advantages * off).abs().max().item<double>() == 0.0);
  auto ev = learner.evaluate(batch, tg);
  ev.logp.retain_grad();
  ev.entropy.retain_grad();
  ev.values.retain_grad();
  const auto terms = learner.loss(ev);
  terms.total.backward();
  for (const auto* x : {&ev.logp, &ev.entropy, &ev.values}) {
    const auto g = x->grad().to(torch::kDouble);
    REQUIRE(g.defined());
    CHECK((g * off).abs().max().item<double>() == 0.0);
    CHECK((g * pm).abs().sum().item<double>() > 0.0);
  }
  CHECK(static_cast<double>(terms.ratio_mean) == Approx(1.0).margin(1e-12));  // pi_old at the update's geometry
  CHECK_THROWS_WITH((episode_ppo<steered_gpt>{model, {.algorithm = {.kl_coef = 0.1}}}), Catch::Contains("reference"));
}

namespace {
// Two turns; 0.5 for each turn whose first character is a digit.
struct digit_turns_env {
  int turn = 0;
  text_observation reset(std::uint64_t) {
    turn = 0;
    return {.text = "Say a digit."};
  }
  text_step step(const std::string& a) {
    ++turn;
    return {.observation = {.text = "Another."}, .reward = !a.empty() && a[0] >= '0' && a[0] <= '9' ? 0.5 : 0.0,
            .done = turn == 2};
  }
};
}  // namespace

TEST_CASE("episode PPO: the return of a two-turn episode improves (critic and GAE over the policy tokens)",
          "[agents][cpu]") {
  const aliased_text text;
  auto model = make_policy(text.vocab(), 96, 32);
  model.bias[text.tok.pad_id()] = -1e4;
  model.bias[text.alias()] = -1e4;
  model.bias[text.tok.id('\n')] = -20.0;  // a turn's one free character is never its end
  // Each turn: one free character, then "\n\n" (forced) ends it; the second turn starts after the
  // user's reply. An untrained policy writes a digit first ~10/95 of the time.
  using tokenizers::chat_format;
  const auto P = static_cast<std::int64_t>(
      text.tok.encode(tokenizers::apply_chat_template(chat_format::plain, {{"user", "Say a digit."}})).size());
  const auto C = static_cast<std::int64_t>(
      text.tok.encode(tokenizers::render_continuation(chat_format::plain, {{"user", "Another."}}).substr(2)).size());
  for (const auto at : {P + 1, P + 2, P + 4 + C, P + 5 + C}) (*model.force)[at] = text.tok.id('\n');
  std::int64_t encodes = 0;
  const auto io = text.io(&encodes);
  episode_ppo<steered_gpt> learner{model, {.algorithm = {.ent_coef = 0.0, .gamma = 1.0, .lambda = 0.95},
                                           .optim = {.lr = 1e-2}, .epochs = 2}};
  const auto [first, last] = train_until(
      model, digit_turns_env{}, 1, io,
      {.format = chat_format::plain, .max_turns = 2, .max_turn_tokens = 3, .max_episode_tokens = 90}, 40, 0.85,
      [&](const episodes_result& out) {
        CHECK(out.stats.at("turns_mean") == 2.0);
        const auto s = learner.step(out.episodes, text.tok.pad_id());
        CHECK(s.at("updates") == 2.0);
        CHECK(std::isfinite(s.at("value_loss")));
      });
  CHECK(first < 0.3);
  CHECK(last > 0.85);
}

namespace {
// Sleeps a fixed time (stopping early when asked): a tool that takes time.
struct delay_tool {
  std::chrono::microseconds delay{0};
  std::string name() const { return "wait"; }
  std::string description() const { return "Waits."; }
  json parameters() const { return {{"type", "object"}}; }
  std::string call(const json&, std::stop_token st) const {
    const auto until = std::chrono::steady_clock::now() + delay;
    while (std::chrono::steady_clock::now() < until && !st.stop_requested())
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    return "done";
  }
  std::string call(const json& a) const { return call(a, std::stop_token{}); }
};
// Four turns, then done; no reward (the benchmark measures the schedule).
struct four_turns {
  int turn = 0;
  text_observation reset(std::uint64_t) {
    turn = 0;
    return {.text = "Go."};
  }
  text_step step(const std::string&) { return {.observation = {.text = "More."}, .done = ++turn == 4}; }
};
}  // namespace

// Episodes/s with tools that take time, overlapped (the other sequences decode while a call
// runs) against lockstep (nothing decodes while any call runs), side by side on one machine.
// The policy is the built-in GPT steered to end a turn every few tokens; one id of its
// tokenizer decodes to a whole tool call, written with probability ~1/3 at each turn's end, so
// calls start at scattered times. docs/performance.md. Run by hand:
//   unit_agents "[bench]" --reporter compact
TEST_CASE("episodes: overlapped tool calls against lockstep (benchmark)", "[.][bench][agents]") {
  const aliased_text text;  // the alias id decodes to a tool call here
  const auto call_id = text.alias();
  const std::string call = tokenizers::tool_call_text("wait", json::object()) + "\n\n";
  agent_text io{.encode = [&](const std::string& s) { return text.tok.encode(s); },
                .decode = [&](const std::vector<std::int64_t>& ids) {
                  std::string out;
                  for (const auto i : ids) out += i == call_id ? call : text.tok.decode({i});
                  return out;
                }};
  auto model = make_policy(text.vocab(), 320, 64, torch::kFloat, 2);
  model.bias[text.tok.id('\n')] = 3.0;
  model.bias[call_id] = 2.5;
  model.bias[text.tok.pad_id()] = -1e4;
  const agent_options o{.format = tokenizers::chat_format::plain, .max_turns = 8, .max_turn_tokens = 24,
                        .max_episode_tokens = 300, .engine = {.max_sequences = 64}};
  std::vector<std::uint64_t> seeds(8);
  for (std::size_t i = 0; i < seeds.size(); ++i) seeds[i] = i + 1;
  torch::NoGradGuard ng;
  // A decode step's time: the same episodes with an instant tool.
  toolbox<delay_tool> instant{{.threads = 64}, delay_tool{}};
  torch::manual_seed(3);
  const auto base = run_episodes(model, four_turns{}, seeds, 8, instant, io, o);
  const double step_s = base.stats.at("seconds") / base.stats.at("engine_steps");
  std::printf("engine: %.0f steps, %.2f ms per step, %.1f tool calls per episode\n", base.stats.at("engine_steps"),
              1e3 * step_s, base.stats.at("tool/calls") / base.stats.at("episodes"));
  for (const double k : {1.0, 10.0}) {
    toolbox<delay_tool> tools{{.threads = 64},
                              delay_tool{std::chrono::microseconds(static_cast<std::int64_t>(k * step_s * 1e6))}};
    double eps[2];
    for (int lock = 0; lock < 2; ++lock) {
      auto ol = o;
      ol.lockstep = lock == 1;
      torch::manual_seed(3);
      const auto out = run_episodes(model, four_turns{}, seeds, 8, tools, io, ol);
      eps[lock] = out.stats.at("episodes_per_second");
      std::printf("delay %4.1f ms (%2.0fx a step), %s: %.1f episodes/s (%.0f calls, %.2f s)\n", 1e3 * k * step_s, k,
                  lock ? "lockstep  " : "overlapped", eps[lock], out.stats.at("tool/calls"), out.stats.at("seconds"));
    }
    std::printf("  overlapped / lockstep = %.2fx\n", eps[0] / eps[1]);
    CHECK(eps[0] > eps[1]);
  }
}

TEST_CASE("episodes: run_episodes over a remote environment (another process) equals the same rollout in process",
          "[agents][cpu][env_service]") {
  const aliased_text text;
  auto model = make_policy(text.vocab(), 400);
  model.bias[text.tok.id('\n')] = 3.0;                                // short turns
  for (char c = '0'; c <= '9'; ++c) model.bias[text.tok.id(c)] = 3.0;  // that often hold a number
  model.bias[text.tok.pad_id()] = -1e4;
  model.bias[text.alias()] = -1e4;
  const envs::guess_number game{{.low = 1, .high = 9, .max_guesses = 4}};
  env_service_test::child_env_server server{game, {}};
  const remote_environment remote{{.url = server.base(), .timeout_s = 10}};
  std::int64_t encodes = 0;
  const auto io = text.io(&encodes);
  const agent_options o{.format = tokenizers::chat_format::plain, .max_turns = 4, .max_turn_tokens = 8,
                        .max_episode_tokens = 360, .engine = {.block_size = 8}};
  torch::NoGradGuard ng;
  const std::vector<std::uint64_t> seeds{3, 4, 5};
  const auto here = run_episodes(model, game, seeds, /*group=*/4, io, o);
  const auto there = run_episodes(model, remote, seeds, /*group=*/4, io, o);
  REQUIRE(there.episodes.size() == here.episodes.size());
  std::int64_t turns = 0, won = 0;
  for (std::size_t i = 0; i < here.episodes.size(); ++i) {
    const auto& a = here.episodes[i];
    const auto& b = there.episodes[i];
    CHECK(b.tokens == a.tokens);  // the observations (tokenized once) and the policy's tokens
    CHECK(b.policy == a.policy);
    CHECK(b.logp == a.logp);
    CHECK(b.turn_rewards == a.turn_rewards);
    CHECK(b.turn_texts == a.turn_texts);
    CHECK(b.end == a.end);
    CHECK(b.reward == a.reward);
    turns += a.turns();
    won += a.reward == 1.0;
  }
  CHECK(turns > static_cast<std::int64_t>(here.episodes.size()));  // multi-turn: replies went back and forth
  INFO("episodes won: " << won << " of " << here.episodes.size());
  CHECK(there.stats.at("reward_mean") == here.stats.at("reward_mean"));
}
