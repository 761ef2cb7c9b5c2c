// A small language model learns a multi-turn text game (issue 25): the environment
// (`envs::guess_number`) thinks of a number from 1 to 100 and answers each guess with "Higher." or
// "Lower." until the guess is right or 7 guesses are spent. The model (a character-level GPT built
// here, no download) first imitates demonstrations of two players — most count up from the bottom
// (1, 2, 3, ...: a game of 7 guesses wins 7 % of the time), a few halve the range that the replies
// leave (binary search: always wins) — then GRPO over episodes on the rollout engine rewards the
// won games. Each game is one token sequence: the model's guesses as it sampled them, the
// environment's replies tokenized once and appended (never trained). Held-out games (seeds never
// seen in training) are played greedily before and after RL: games won and guesses used.
// docs/agents.md.
//
//   guess_number [--out DIR] [key=value ...]     e.g. rl_steps=60 demo_search_share=0.2 game.high=60
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/core/command_line.hpp>
#include <unirl/envs/guess_number.hpp>
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
  unirl::envs::guess_number_options game{};  // the range and the number of guesses
  std::int64_t sft_steps = 600;               // supervised steps on demonstrations
  std::int64_t sft_batch = 32;
  double sft_lr = 2e-3;
  double demo_search_share = 0.3;             // share of demonstrations that halve the range (the rest count up)
  std::int64_t rl_steps = 40;                 // GRPO steps
  std::int64_t tasks_per_step = 16;           // games per GRPO step, each played group_size times
  std::int64_t group_size = 8;
  std::int64_t heldout = 200;                 // held-out games (greedy)
  std::int64_t d_model = 64;
  std::int64_t n_layer = 2;
  std::int64_t seed = 1;
  ua::episode_grpo_options rl{.algorithm = {.clip_high = 0.28, .agg = unirl::algo::loss_agg::token_mean},
                              .optim = {.lr = 5e-4}};
};
BOOST_HANA_ADAPT_STRUCT(example_options, game, sft_steps, sft_batch, sft_lr, demo_search_share, rl_steps,
                        tasks_per_step, group_size, heldout, d_model, n_layer, seed, rl);

namespace {
using unirl::envs::guess_number;

// The example's tokenizer: greedy longest match over pieces — every printable ASCII character
// (so any text encodes), the game's words and phrases, and each number of the range — so that a
// guess is one token and a whole game about 70 (a character tokenizer makes it 380). The
// rollout never re-encodes what the model wrote: a guess sampled as digits stays digits.
class piece_tokenizer {
 public:
  explicit piece_tokenizer(const guess_number::options& game) {
    add("\n");
    for (char c = 32; c < 127; ++c) add(std::string(1, c));
    for (const char* p : {"\n\n", "User: ", "Assistant:", "Higher.", "Lower.", "Correct!", " guesses left.",
                          " guess left.", "I am thinking of a number from ", " to ", ". Guess it: reply with one number.",
                          " You have ", " guesses.", "That is not a number from ", ". Reply with one number. ",
                          "No guesses left; the number was "})
      add(p);
    if (game.high - game.low <= 2000)
      for (auto n = game.low; n <= game.high; ++n) add(std::to_string(n));
  }
  std::int64_t pad_id() const { return static_cast<std::int64_t>(pieces_.size()); }
  std::int64_t vocab_size() const { return pad_id() + 1; }
  std::vector<std::int64_t> encode(const std::string& s) const {
    std::vector<std::int64_t> ids;
    for (std::size_t i = 0; i < s.size();) {
      std::size_t n = std::min(longest_, s.size() - i);
      for (; n > 0; --n)
        if (const auto it = index_.find(s.substr(i, n)); it != index_.end()) {
          ids.push_back(it->second);
          break;
        }
      UNIRL_CHECK(n > 0, "piece_tokenizer: character ", static_cast<int>(static_cast<unsigned char>(s[i])),
                  " at offset ", i, " is not printable ASCII");
      i += n;
    }
    return ids;
  }
  std::string decode(const std::vector<std::int64_t>& ids) const {
    std::string s;
    for (const auto i : ids) {
      UNIRL_CHECK(i >= 0 && i <= pad_id(), "piece_tokenizer: id ", i, " is outside [0, ", pad_id(), "]");
      if (i != pad_id()) s += pieces_[static_cast<std::size_t>(i)];
    }
    return s;
  }

 private:
  void add(std::string p) {
    if (index_.count(p)) return;
    longest_ = std::max(longest_, p.size());
    index_.emplace(p, static_cast<std::int64_t>(pieces_.size()));
    pieces_.push_back(std::move(p));
  }
  std::vector<std::string> pieces_;
  std::map<std::string, std::int64_t> index_;
  std::size_t longest_ = 0;
};

constexpr auto format = ut::chat_format::plain;

// A demonstration as a trajectory, played against the environment itself so that every reply is
// the game's own text: the prompt and the replies are context, the guesses are the policy's.
// `search`: guess the middle of the range the replies leave; otherwise count up from the bottom.
ua::trajectory demonstration(const piece_tokenizer& tok, const guess_number::options& game,
                             std::uint64_t seed, bool search) {
  guess_number env{game};
  const auto obs = env.reset(seed);
  ua::trajectory t;
  t.append_context(tok.encode(ut::apply_chat_template(format, {{"user", obs.text}})));
  std::int64_t lo = game.low, hi = game.high, next = game.low;
  while (true) {
    const std::int64_t g = search ? lo + (hi - lo) / 2 : next++;
    const auto ids = tok.encode(std::to_string(g) + "\n\n");
    t.append_policy(ids, std::vector<double>(ids.size(), 0.0));
    const auto st = env.step(std::to_string(g));
    t.end_turn(st.reward, std::to_string(g) + "\n\n");
    if (st.done) break;
    if (g < env.target()) lo = g + 1;
    else hi = g - 1;
    // The turn's "\n\n" is the policy's; the continuation's copy of it is dropped.
    t.append_context(tok.encode(ut::render_continuation(format, {{"user", st.observation.text}}).substr(2)));
  }
  return t;
}

ua::agent_options agent(const example_options& o, const unirl::models::gpt& model, double temperature) {
  return {.format = format,
          .max_turns = o.game.max_guesses,
          .max_turn_tokens = 6,
          .max_episode_tokens = static_cast<std::int64_t>(model.max_length()),
          .sampling = {.temperature = temperature}};
}

struct evaluation {
  double won = 0, guesses = 0;
};

evaluation evaluate_policy(const unirl::models::gpt& model, const example_options& o, const ua::agent_text& text,
                           const std::vector<std::uint64_t>& seeds) {
  torch::NoGradGuard ng;
  const auto out = ua::run_episodes(model, guess_number{o.game}, seeds, 1, text, agent(o, model, 0.0));
  return {out.stats.at("reward_mean"), out.stats.at("turns_mean")};
}
}  // namespace

int main(int argc, char** argv) try {
  example_options opt;
  const std::string out_dir =
      unirl::options::parse_command_line(opt, argc, argv, {{"out", "runs/guess_number"}})["out"];
  std::filesystem::create_directories(out_dir);
  std::cout << unirl::options::to_string(opt) << "\n";
  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));
  const piece_tokenizer tok(opt.game);
  const ua::agent_text text{.encode = [&](const std::string& s) { return tok.encode(s); },
                            .decode = [&](const std::vector<std::int64_t>& ids) { return tok.decode(ids); }};
  // The context holds the longest game: the prompt, then per guess its digits, the turn's end and
  // the reply (the longest demonstration is measured, with room for one guess that fails to parse).
  std::int64_t longest = 0;
  for (std::uint64_t s = 0; s < 64; ++s)
    for (bool search : {false, true})
      longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(demonstration(tok, opt.game, s, search).size()));
  unirl::models::gpt model{unirl::models::gpt_options{.vocab_size = tok.vocab_size(),
                                                      .max_len = longest + 48,
                                                      .n_layer = opt.n_layer,
                                                      .n_head = 4,
                                                      .d_model = opt.d_model}};
  // Training games draw seeds from [0, 2^40); held-out ones from above.
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
    std::bernoulli_distribution search(opt.demo_search_share);
    model.train(true);
    for (std::int64_t step = 0; step < opt.sft_steps; ++step) {
      std::vector<ua::trajectory> demos;
      for (std::int64_t i = 0; i < opt.sft_batch; ++i) demos.push_back(demonstration(tok, opt.game, train_seed(), search(rng)));
      optim.set_lr_multiplier(1.0 - static_cast<double>(step) / static_cast<double>(opt.sft_steps));
      const auto loss = unirl::train::sft_loss(model, ua::sft_batch_of(demos, tok.pad_id()));
      optim.zero_grad();
      loss.backward();
      unirl::train::clip_grad_norm(model.parameters(), 1.0);
      optim.step();
      if (step % 100 == 0 || step + 1 == opt.sft_steps) {
        std::cout << "sft step " << step << "  loss " << loss.item<double>() << "  (" << std::fixed
                  << std::setprecision(1) << secs() << " s)\n" << std::defaultfloat << std::setprecision(6);
        metrics << json{{"stage", "sft"}, {"step", step}, {"sft_loss", loss.item<double>()}}.dump() << "\n";
      }
    }
    model.train(false);
  }
  const auto before = evaluate_policy(model, opt, text, heldout);
  std::cout << "after the supervised stage: held-out games won " << 100 * before.won << "%, "
            << before.guesses << " guesses per game\n";

  // 2. GRPO over episodes: a group is group_size games of one number; a won game scores 1.
  ua::episode_grpo<unirl::models::gpt> learner{model, opt.rl};
  double episodes_per_second = 0;
  for (std::int64_t step = 0; step < opt.rl_steps; ++step) {
    std::vector<std::uint64_t> seeds;
    for (std::int64_t i = 0; i < opt.tasks_per_step; ++i) seeds.push_back(train_seed());
    ua::episodes_result out;
    {
      torch::NoGradGuard ng;
      out = ua::run_episodes(model, guess_number{opt.game}, seeds, opt.group_size, text, agent(opt, model, 1.0));
    }
    episodes_per_second = out.stats.at("episodes_per_second");
    auto s = learner.step(out.episodes, opt.group_size, tok.pad_id());
    json m{{"stage", "rl"}, {"step", step}};
    for (const auto& [k, v] : out.stats) m["rollout/" + k] = v;
    for (const auto& [k, v] : s) m[k] = v;
    metrics << m.dump() << "\n";
    if (step % 5 == 0 || step + 1 == opt.rl_steps)
      std::cout << "rl step " << step << "  won " << out.stats.at("reward_mean") << "  guesses "
                << out.stats.at("turns_mean") << "  loss " << s["loss"] << "  (" << std::fixed << std::setprecision(1)
                << secs() << " s)\n"
                << std::defaultfloat << std::setprecision(6);
  }
  const auto after = evaluate_policy(model, opt, text, heldout);
  std::cout << std::fixed << std::setprecision(1) << "held-out games won: before RL " << 100 * before.won << "% in "
            << std::setprecision(2) << before.guesses << " guesses, after " << opt.rl_steps << " GRPO steps "
            << std::setprecision(1) << 100 * after.won << "% in " << std::setprecision(2) << after.guesses
            << " guesses; " << std::setprecision(0) << episodes_per_second << " episodes/s; " << secs() << " s\n";
  metrics.close();
  std::ofstream(out_dir + "/summary.json") << json{{"won_before", before.won},
                                                   {"won_after", after.won},
                                                   {"guesses_before", before.guesses},
                                                   {"guesses_after", after.guesses},
                                                   {"rl_steps", opt.rl_steps},
                                                   {"seconds", secs()},
                                                   {"options", unirl::options::to_json(opt)}}
                                                  .dump(2)
                                           << "\n";
  unirl::train::write_report(out_dir);
  std::cout << "wrote " << out_dir << "/{metrics.jsonl, summary.json, report.html}\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "guess_number: " << e.what() << "\n";
  return 1;
}
