// A small language model learns to use a calculator tool for multi-digit multiplication it cannot
// do reliably in its head (issue 25). The model (a character-level GPT built here, no download)
// first imitates demonstrations — most answer directly, some call the tool
// (`<tool_call>{"name": "calculator", "arguments": {"expression": "347*58"}}</tool_call>`, the
// reply comes back as a tool turn) — then GRPO over episodes on the rollout engine rewards the
// right final answer. Held-out success and the tool-call rate are measured before and after RL
// (greedy decoding). docs/agents.md.
//
//   calculator_tool [--out DIR] [--recipe FILE] [key=value ...]     e.g. rl_steps=60 sft_steps=1200
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/command_line.hpp>
#include <unirl/models/char_tokenizer.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/multi_turn.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/train/report.hpp>
#include <unirl/train/sft.hpp>

namespace ua = unirl::agents;
namespace ut = unirl::tokenizers;
using nlohmann::json;

struct example_options {
  std::int64_t sft_steps = 800;            // supervised steps on demonstrations
  std::int64_t sft_batch = 32;
  double sft_lr = 2e-3;
  double demo_tool_share = 0.3;            // share of demonstrations that call the tool (the rest answer directly)
  std::int64_t rl_steps = 40;              // GRPO steps
  std::int64_t tasks_per_step = 16;        // tasks per GRPO step, each answered group_size times
  std::int64_t group_size = 8;
  std::int64_t heldout = 200;              // held-out tasks (greedy)
  std::int64_t d_model = 64;
  std::int64_t n_layer = 2;
  std::int64_t seed = 1;
  ua::episode_grpo_options rl{.algorithm = {.clip_high = 0.28, .agg = unirl::algo::loss_agg::token_mean},
                              .optim = {.lr = 5e-4}};
};
BOOST_HANA_ADAPT_STRUCT(example_options, sft_steps, sft_batch, sft_lr, demo_tool_share, rl_steps, tasks_per_step,
                        group_size, heldout, d_model, n_layer, seed, rl);

namespace {
// The tool and the environment are the library's built-ins (agents/builtin.hpp): `calculator`
// and `arithmetic_env` ("What is A*B?", A of 3 digits and B of 2; the final answer scores 1).
using ua::arithmetic_env;
using ua::calculator;

std::string printable_ascii() {
  std::string s = "\n";
  for (char c = 32; c < 127; ++c) s += c;
  return s;
}

constexpr auto format = ut::chat_format::plain;

// A demonstration as a trajectory: the prompt and the tool's reply are context, the two answers
// (a call, then the result) or the one direct answer are the policy's.
ua::trajectory demonstration(const unirl::models::char_tokenizer& tok, std::uint64_t seed, bool use_tool) {
  arithmetic_env env;
  const auto obs = env.reset(seed);
  ua::trajectory t;
  auto policy = [&](const std::string& s) {
    const auto ids = tok.encode(s);
    t.append_policy(ids, std::vector<double>(ids.size(), 0.0));
  };
  t.append_context(tok.encode(ut::apply_chat_template(format, {{"user", obs.text}})));
  const auto answer = std::to_string(env.answer);
  if (use_tool) {
    policy(ut::tool_call_text("calculator", {{"expression", env.expression}}) + "\n\n");
    t.append_context(tok.encode(ut::render_continuation(format, {{"tool", answer}}).substr(2)));  // after the policy's "\n\n"
  }
  policy(answer + "\n\n");
  return t;
}

struct evaluation {
  double success = 0, tool_rate = 0, turns = 0;
};

template <class Tools>
evaluation evaluate_policy(const unirl::models::gpt& model, Tools& tools, const ua::agent_text& text,
                           const std::vector<std::uint64_t>& seeds) {
  torch::NoGradGuard ng;
  const auto out = ua::run_episodes(model, arithmetic_env{}, seeds, 1, tools, text,
                                    {.format = format, .max_turns = 3, .max_turn_tokens = 96, .max_episode_tokens = 190,
                                     .sampling = {.temperature = 0.0}});
  return {out.stats.at("reward_mean"), out.stats.at("tool_call_rate"), out.stats.at("turns_mean")};
}
}  // namespace

int main(int argc, char** argv) try {
  example_options opt;
  const std::string out_dir =
      unirl::options::parse_command_line(opt, argc, argv, {{"out", "runs/calculator_tool"}})["out"];
  std::filesystem::create_directories(out_dir);
  std::cout << unirl::options::to_string(opt) << "\n";
  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));
  const unirl::models::char_tokenizer tok(printable_ascii());
  const ua::agent_text text{.encode = [&](const std::string& s) { return tok.encode(s); },
                            .decode = [&](const std::vector<std::int64_t>& ids) { return tok.decode(ids); }};
  ua::toolbox<calculator> tools{{.timeout_seconds = 1.0, .threads = 4}, calculator{}};
  unirl::models::gpt model{unirl::models::gpt_options{
      .vocab_size = tok.vocab_size(), .max_len = 192, .n_layer = opt.n_layer, .n_head = 4, .d_model = opt.d_model}};
  // Training tasks draw seeds from [0, 2^40); held-out ones from above.
  std::vector<std::uint64_t> heldout;
  for (std::int64_t i = 0; i < opt.heldout; ++i) heldout.push_back((std::uint64_t{1} << 40) + static_cast<std::uint64_t>(i));
  std::mt19937_64 rng(static_cast<std::uint64_t>(opt.seed));
  auto train_seed = [&] { return rng() % (std::uint64_t{1} << 40); };
  std::ofstream metrics(out_dir + "/metrics.jsonl");
  const auto t0 = std::chrono::steady_clock::now();
  auto secs = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };

  // 1. Supervised stage on demonstrations (cross-entropy on the policy's tokens only).
  {
    unirl::train::optimizer optim(model.named_parameters(), {.lr = opt.sft_lr});
    std::bernoulli_distribution tool(opt.demo_tool_share);
    model.train(true);
    for (std::int64_t step = 0; step < opt.sft_steps; ++step) {
      std::vector<ua::trajectory> demos;
      for (std::int64_t i = 0; i < opt.sft_batch; ++i) demos.push_back(demonstration(tok, train_seed(), tool(rng)));
      optim.set_lr_multiplier(1.0 - static_cast<double>(step) / static_cast<double>(opt.sft_steps));
      const auto loss = unirl::train::sft_loss(model, ua::sft_batch_of(demos, tok.pad_id()));
      optim.zero_grad();
      loss.backward();
      unirl::train::clip_grad_norm(model.parameters(), 1.0);
      optim.step();
      if (step % 100 == 0 || step + 1 == opt.sft_steps) {
        std::cout << "sft step " << step << "  loss " << loss.item<double>() << "  (" << std::fixed
                  << std::setprecision(1) << secs() << " s)\n" << std::defaultfloat << std::setprecision(6);
        metrics << json{{"stage", "sft"}, {"step", step}, {"loss", loss.item<double>()}}.dump() << "\n";
      }
    }
    model.train(false);
  }
  const auto before = evaluate_policy(model, tools, text, heldout);
  std::cout << "after the supervised stage: held-out success " << 100 * before.success << "%, tool calls in "
            << 100 * before.tool_rate << "% of episodes\n";

  // 2. GRPO over episodes: groups of episodes of one task, reward = the right final answer.
  ua::episode_grpo<unirl::models::gpt> learner{model, opt.rl};
  double episodes_per_second = 0;
  for (std::int64_t step = 0; step < opt.rl_steps; ++step) {
    std::vector<std::uint64_t> seeds;
    for (std::int64_t i = 0; i < opt.tasks_per_step; ++i) seeds.push_back(train_seed());
    ua::episodes_result out;
    {
      torch::NoGradGuard ng;
      out = ua::run_episodes(model, arithmetic_env{}, seeds, opt.group_size, tools, text,
                             {.format = format, .max_turns = 3, .max_turn_tokens = 96, .max_episode_tokens = 190});
    }
    episodes_per_second = out.stats.at("episodes_per_second");
    auto s = learner.step(out.episodes, opt.group_size, tok.pad_id());
    json m{{"stage", "rl"}, {"step", step}};
    for (const auto& [k, v] : out.stats) m["rollout/" + k] = v;
    for (const auto& [k, v] : s) m[k] = v;
    metrics << m.dump() << "\n";
    if (step % 5 == 0 || step + 1 == opt.rl_steps)
      std::cout << "rl step " << step << "  reward " << out.stats.at("reward_mean") << "  tool calls "
                << out.stats.at("tool_call_rate") << "  turns " << out.stats.at("turns_mean") << "  loss " << s["loss"]
                << "  (" << std::fixed << std::setprecision(1) << secs() << " s)\n"
                << std::defaultfloat << std::setprecision(6);
  }
  const auto after = evaluate_policy(model, tools, text, heldout);
  const auto faults = tools.stats();
  std::cout << std::fixed << std::setprecision(1) << "held-out success: before RL " << 100 * before.success
            << "% (tool calls " << 100 * before.tool_rate << "%), after " << opt.rl_steps << " GRPO steps "
            << 100 * after.success << "% (tool calls " << 100 * after.tool_rate << "%); tool faults: "
            << faults.count(ua::tool_fault::malformed) << " malformed, " << faults.count(ua::tool_fault::bad_arguments)
            << " bad arguments, " << faults.count(ua::tool_fault::threw) << " threw, "
            << faults.count(ua::tool_fault::timed_out) << " timed out of " << faults.calls << " calls; "
            << std::setprecision(0) << episodes_per_second << " episodes/s; " << secs() << " s\n";
  metrics << json{{"stage", "result"},
                  {"success_before", before.success},
                  {"success_after", after.success},
                  {"tool_rate_before", before.tool_rate},
                  {"tool_rate_after", after.tool_rate}}
                 .dump()
          << "\n";
  metrics.close();
  std::ofstream(out_dir + "/summary.json") << json{{"success_before", before.success},
                                                   {"success_after", after.success},
                                                   {"tool_rate_before", before.tool_rate},
                                                   {"tool_rate_after", after.tool_rate},
                                                   {"tool_calls", faults.calls},
                                                   {"rl_steps", opt.rl_steps},
                                                   {"seconds", secs()},
                                                   {"options", unirl::options::to_json(opt)}}
                                                  .dump(2)
                                           << "\n";
  unirl::train::write_report(out_dir);
  std::cout << "wrote " << out_dir << "/{metrics.jsonl, summary.json, report.html}\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "calculator_tool: " << e.what() << "\n";
  return 1;
}
