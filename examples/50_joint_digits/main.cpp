// Joint training on the real 8x8 digits: a language model learns to choose the conditioning of
// a flow model (a prompt enhancer) for a reward on the images that it never sees.
//
// 1. A digit classifier is trained on the digits (examples/common/flow_example.hpp).
// 2. A flow model conditioned on 20 conditions = class x style (style: thin / thick, the ink mass
//    below / above the median of the image's class) is pretrained by the library's
//    flow-matching stage, and a tiny character GPT is taught by the library's SFT stage to answer
//    the prompt "draw:" with a uniformly random condition, written as a digit and a style letter
//    ("7T." = a thick 7, "3t." = a thin 3). Both are cached in the output root.
// 3. The hidden reward, on the generated images only: "a digit the classifier reads as 7, drawn
//    thick" = p_classifier(7 | x) * sigmoid((ink(x) - median ink of the real 7s) / (std / 2)).
//    The LM is rewarded through a `unirl::joint::link`: its completion is decoded into a
//    condition, the flow model draws its group for it, the LM sample gets their mean reward (an
//    unreadable completion gets 0, never reaches the generator).
// 4. Four runs from the same starting models, each a `unirl::joint::chain` (GRPO on the LM,
//    Flow-GRPO on the flow model):
//      lm         the LM learns, the generator is frozen
//      generator  the LM only samples, the generator learns on its conditions
//      joint      both learn in every step
//      staged     the stages of a recipe file (stages.yaml next to this file: LM alone, then the
//                 generator alone, then both)
//    Each writes a checkpoint of the whole chain midway (`--resume` continues from it, in its stage).
// 5. Before and after each run: the expected reward of the pair, exact over the LM's 21 outcomes
//    (20 conditions + unreadable) times the mean reward of 16 ODE samples per condition from fixed
//    noise; the LM's KL to its starting point (exact over the same 21 outcomes); the flow model's
//    path KL to its pretrained weights; seconds; a grid of 64 samples of the pair (LM draws,
//    then one ODE sample each, fixed seeds; an unreadable completion is a black tile).
//
// 6. multitask: three tasks of two modalities in one `unirl::joint::multitask` run — the chain
//    (joint), digit generation (a second flow model, Flow-GRPO, reward: the classifier reads the
//    digit asked for) and addition up to 19 (a char GPT after a short SFT stage, GRPO, exact
//    answer) — one task drawn per step by fixed weights or by reward progress (`weighting`);
//    each task's figure before and after, its step count and final probability.
//
//   joint_digits [--mode all|lm|generator|joint|staged|multitask] [--out DIR] [--stages FILE] [--resume]
//                [key=value ...]                                 e.g. steps=300 lm_lr=3e-4
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <unirl/train/plot.hpp>  // first: brings the stb_image_write implementation

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/command_line.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/flow.hpp>
#include <unirl/joint.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/token.hpp>
#include <unirl/train/report.hpp>
#include <unirl/train/sft.hpp>

#include "common/addition.hpp"
#include "common/digits.hpp"
#include "common/flow_example.hpp"

namespace {

struct example_options {
  std::int64_t steps = 300;                  // chain steps of the lm, generator and joint runs
  std::vector<std::int64_t> stage_steps{};   // staged: replaces the recipe's stage lengths (as many)
  std::int64_t checkpoint_at = 0;            // chain step after which the checkpoint is written; 0: midway
  std::int64_t stop_after = 0;               // stop a run after this many chain steps (0: run to the end)
  std::int64_t prompts = 2;                  // prompts "draw:" per step
  std::int64_t lm_group = 16;                // LM completions per prompt (GRPO group)
  std::int64_t gen_group = 4;                // flow samples per condition (Flow-GRPO group)
  double lm_lr = 1e-3;
  double gen_lr = 3e-5;
  double kl_beta = 0.1;                      // Flow-GRPO's KL-to-reference coefficient
  std::int64_t minibatches = 4;              // generator optimizer steps per rollout batch
  std::int64_t sampler_steps = 10;           // SDE steps of the generator's sampler
  std::int64_t pretrain_iters = 1500;        // flow-matching iterations (cached)
  std::int64_t hidden = 128;
  std::int64_t sft_steps = 300;              // SFT steps of the LM on uniform conditions (cached)
  std::int64_t d_model = 32;
  std::int64_t eval_samples = 16;            // ODE samples per condition in the evaluation
  std::int64_t log_every = 25;
  std::int64_t seed = 1;
  std::int64_t threads = 1;                  // LibTorch intra-op threads (tiny tensors: 1 is fastest)
  // multitask mode: the chain, digit generation and one-digit addition in one run
  std::int64_t multitask_steps = 600;        // multitask steps (one task each)
  std::string weighting = "progress";        // fixed | progress (unirl::joint::task_weighting)
  std::int64_t arith_sft_steps = 300;        // SFT steps of the addition GPT (cached)
  double arith_lr = 3e-4;
};

using flow_t = unirl::models::flow_model<unirl::models::mlp_velocity_net>;
using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

constexpr std::int64_t num_conditions = 20;  // condition = 2 * digit + (style == thick)
constexpr std::int64_t target_condition = 15;  // "7T": what the hidden reward favours (for the reports)
const std::string prompt_text = "draw:";

// ---- the language side -------------------------------------------------------------------

/// The LM's characters: digits, 't' (thin), 'T' (thick), '.' (stop), and the prompt's letters.
const unirl::models::char_tokenizer& tokenizer() {
  static const unirl::models::char_tokenizer tok{"0123456789tT.draw:"};
  return tok;
}
std::string condition_text(std::int64_t c) { return std::to_string(c / 2) + (c % 2 ? "T" : "t"); }

/// What the LM wrote, as a condition: exactly a digit, a style letter and the stop token ("7T.");
/// anything else (other characters, too short, no stop) is invalid. Untrusted text: every
/// completion is checked, nothing is assumed about its length or ids.
struct condition_decoder {
  unirl::joint::decoded operator()(const unirl::token_rollout& b) const {
    const auto& tok = tokenizer();
    const std::int64_t n = b.size();
    auto conditions = torch::zeros({n}, torch::kInt64);
    auto valid = torch::zeros({n}, torch::kBool);
    if (n == 0) return {conditions, valid};
    UNIRL_CHECK(b.completion_ids.dim() == 2 && b.completion_mask.sizes() == b.completion_ids.sizes(),
                "condition_decoder: completion_ids ", b.completion_ids.sizes(), " and completion_mask ",
                b.completion_mask.sizes(), ": expected two (B, T) tensors of one shape");
    const auto ids = b.completion_ids.to(torch::kCPU, torch::kInt64).contiguous();
    const auto len = b.completion_mask.to(torch::kCPU).sum(1).round().to(torch::kInt64).contiguous();
    const std::int64_t T = ids.size(1);
    const auto* p = ids.data_ptr<std::int64_t>();
    const auto* l = len.data_ptr<std::int64_t>();
    auto* c = conditions.data_ptr<std::int64_t>();
    auto* v = valid.data_ptr<bool>();
    const std::int64_t zero = tok.id('0'), thin = tok.id('t'), thick = tok.id('T'), stop = tok.id('.');
    for (std::int64_t i = 0; i < n; ++i) {
      if (T < 3 || l[i] != 3) continue;
      const std::int64_t d = p[i * T] - zero, s = p[i * T + 1], e = p[i * T + 2];
      if (d < 0 || d > 9 || (s != thin && s != thick) || e != stop) continue;
      c[i] = 2 * d + (s == thick ? 1 : 0);
      v[i] = true;
    }
    return {conditions, valid};
  }
};

unirl::prompt_batch prompts(std::int64_t n) {
  const auto& tok = tokenizer();
  unirl::prompt_batch in{.decode = tok.decoder(), .pad_id = tok.pad_id()};
  for (std::int64_t i = 0; i < n; ++i) {
    in.tokens.push_back(tok.encode(prompt_text));
    in.texts.push_back(prompt_text);
  }
  return in;
}
unirl::sampling_options lm_sampling() { return {.max_new_tokens = 3, .stop_tokens = {tokenizer().id('.')}}; }

/// The LM's exact distribution over its 21 outcomes: [0, 20) the conditions (prompt, digit,
/// style, stop), [20] anything else. (21,) float64.
torch::Tensor outcome_distribution(unirl::models::gpt& lm) {
  torch::NoGradGuard ng;
  lm.train(false);
  const auto& tok = tokenizer();
  std::vector<std::int64_t> rows;
  for (std::int64_t c = 0; c < num_conditions; ++c) {
    auto ids = tok.encode(prompt_text + condition_text(c) + ".");
    rows.insert(rows.end(), ids.begin(), ids.end());
  }
  const auto P = static_cast<std::int64_t>(prompt_text.size());
  const auto ids = torch::tensor(rows, torch::kInt64).reshape({num_conditions, P + 3});
  const auto logp = torch::log_softmax(lm.logits(ids, torch::ones(ids.sizes())).to(torch::kFloat64), -1);
  // Position t predicts token t + 1: the completion's three tokens are predicted at P-1, P, P+1.
  const auto lp = logp.slice(1, P - 1, P + 2).gather(2, ids.slice(1, P, P + 3).unsqueeze(2)).squeeze(2).sum(1);
  const auto p = lp.exp();
  return torch::cat({p, (1.0 - p.sum()).clamp_min(0.0).reshape({1})});
}

double kl_divergence(const torch::Tensor& p, const torch::Tensor& q) {
  const auto mask = p > 0;
  return (p.masked_select(mask) * (p.masked_select(mask).log() - q.masked_select(mask).clamp_min(1e-300).log()))
      .sum()
      .item<double>();
}

// ---- the image side ----------------------------------------------------------------------

/// Ink mass of (N, 1, 8, 8) images in [-1, 1]: the sum of the pixels mapped to [0, 1].
torch::Tensor ink(const torch::Tensor& x) { return ((x.clamp(-1, 1) + 1) / 2).flatten(1).sum(1); }

/// The hidden reward: "a digit the classifier reads as 7, drawn thick". It ignores the condition.
struct thick_seven {
  examples::digit_classifier clf;
  double center = 0, scale = 1;  // median and half the standard deviation of the real 7s' ink
  torch::Tensor operator()(const unirl::flow_rollout& b) {
    torch::NoGradGuard ng;
    const auto x = b.samples().clamp(-1, 1);
    const auto p7 = torch::softmax(clf->forward(x), 1).select(1, 7);
    return (p7 * torch::sigmoid((ink(x) - center) / scale)).to(torch::kFloat32);
  }
};

/// The flow model's condition of each real image: 2 * class + (ink above the class's median).
torch::Tensor style_conditions(const torch::Tensor& images, const torch::Tensor& labels) {
  const auto m = ink(images);
  auto thick = torch::zeros_like(labels);
  for (std::int64_t d = 0; d < 10; ++d) {
    const auto in = labels == d;
    const auto median = std::get<0>(m.masked_select(in).median(0)).item<double>();
    thick.masked_fill_(in & (m > median), 1);
  }
  return 2 * labels + thick;
}

// ---- the chain -----------------------------------------------------------------------------

using gen_t = unirl::trainer<flow_t, unirl::algo::flow_grpo<>, thick_seven>;
using link_t = unirl::joint::link<gen_t, condition_decoder>;
using lm_t = unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, link_t>;
using chain_t = unirl::joint::chain<lm_t, gen_t>;

struct shared_setup {
  examples::digit_setup digits;
  torch::Tensor conditions;  // (N,) the 20-way condition of every real image
  thick_seven reward;
  double pretrain_seconds = 0, sft_seconds = 0;
  std::string root;
};

/// A fresh pair of starting models: the pretrained flow model and the SFT'd LM, each loaded
/// from its cache in the output root (trained there the first time).
struct start_models {
  flow_t flow;
  unirl::models::gpt lm;
};

start_models load_start(shared_setup& s, const example_options& opt) {
  torch::manual_seed(static_cast<std::uint64_t>(opt.seed));
  unirl::models::mlp_velocity_net net(unirl::models::flow_net_options{
      .shape = {1, 8, 8}, .num_classes = num_conditions, .hidden = opt.hidden, .depth = 3, .embed_dim = 64});
  s.pretrain_seconds += examples::pretrain_flow(
      flow_t(net, {1, 8, 8}),
      {.objective = {.p_uncond = 0.1},
       .optim = {.lr = 1e-3},
       .schedule = {.kind = unirl::train::schedule_kind::cosine},
       .batch_size = 256,
       .steps = opt.pretrain_iters,
       .progress = false,
       .out = s.root + "/pretrained_flow_h" + std::to_string(opt.hidden) + "_i" + std::to_string(opt.pretrain_iters) +
              "_s" + std::to_string(opt.seed)},
      [&](std::int64_t n) {
        const auto idx = torch::randint(0, s.digits.images.size(0), {n}, torch::kInt64);
        return unirl::train::flow_matching_batch{s.digits.images.index_select(0, idx),
                                                 s.conditions.index_select(0, idx)};
      });

  const auto& tok = tokenizer();
  unirl::models::gpt lm(unirl::models::gpt_options{
      .vocab_size = tok.vocab_size(), .max_len = 8, .n_layer = 2, .n_head = 4, .d_model = opt.d_model});
  // The library's SFT stage on uniformly random conditions: the LM starts about uniform over them.
  const std::string sft_out =
      s.root + "/sft_lm_d" + std::to_string(opt.d_model) + "_i" + std::to_string(opt.sft_steps) + "_s" +
      std::to_string(opt.seed);
  unirl::train::sft_trainer<unirl::models::gpt> sft(
      lm, {.optim = {.lr = 2e-3}, .batch_size = 64, .steps = opt.sft_steps, .seed = opt.seed, .progress = false,
           .out = sft_out});
  const auto r = sft.run([&](std::int64_t n) {
    const auto c = torch::randint(0, num_conditions, {n}, torch::kInt64);
    std::vector<std::vector<std::int64_t>> ps, cs;
    for (std::int64_t i = 0; i < n; ++i) {
      ps.push_back(tok.encode(prompt_text));
      cs.push_back(tok.encode(condition_text(c[i].item<std::int64_t>()) + "."));
    }
    return unirl::train::make_sft_batch(ps, cs, tok.pad_id());
  });
  if (r.steps > 0) {
    s.sft_seconds += r.seconds;
    std::cout << "LM: " << r.steps << " SFT steps in " << r.seconds << " s (loss " << r.loss_first << " -> "
              << r.loss_last << "), checkpoint in " << sft_out << "\n";
  }
  lm.train(false);
  return {flow_t(net, {1, 8, 8}), lm};
}

struct evaluation {
  double reward = 0;                // E over the LM's outcomes of the generator's mean reward (invalid: 0)
  double p_target = 0;              // the LM's probability of "7T"
  double p_invalid = 0;             // ... of an unreadable completion
  double lm_kl = 0;                 // KL(LM || starting LM) over the 21 outcomes
  double flow_kl = 0;               // path KL of the flow model to its pretrained weights
  double grid_reward = 0;           // mean reward of the 64 grid samples (a Monte-Carlo check)
  std::vector<double> per_condition;  // mean reward of each condition's ODE samples
  torch::Tensor distribution;       // (21,)
  torch::Tensor grid;               // (64, 8, 8)
};

evaluation evaluate(unirl::models::gpt& lm, flow_t& flow, flow_t& flow_reference, const torch::Tensor& lm_reference,
                    thick_seven& reward, const example_options& opt, double invalid_reward) {
  torch::NoGradGuard ng;
  evaluation e;
  e.distribution = outcome_distribution(lm);
  e.p_target = e.distribution[target_condition].item<double>();
  e.p_invalid = e.distribution[num_conditions].item<double>();
  e.lm_kl = lm_reference.defined() ? kl_divergence(e.distribution, lm_reference) : 0.0;
  {
    const examples::scoped_seed fixed(1234);  // the runs' own random streams are left as they were
    const auto n = opt.eval_samples;
    const auto labels = torch::arange(num_conditions, torch::kInt64).repeat_interleave(n);
    const auto noise = torch::randn({n, 1, 8, 8}).repeat({num_conditions, 1, 1, 1});  // the same noise per condition
    const auto b = unirl::sample_trajectory(unirl::ode::euler({.steps = 20}), flow, labels, noise);
    const auto r = reward(b).to(torch::kFloat64).reshape({num_conditions, n}).mean(1);
    for (std::int64_t c = 0; c < num_conditions; ++c) e.per_condition.push_back(r[c].item<double>());
    e.reward = (e.distribution.slice(0, 0, num_conditions) * r).sum().item<double>() + e.p_invalid * invalid_reward;
    const auto kl_labels = torch::arange(num_conditions, torch::kInt64).repeat_interleave(8);
    e.flow_kl = examples::path_kl(flow, flow_reference, kl_labels, opt.sampler_steps);
  }
  {
    const examples::scoped_seed fixed(4321);
    const auto b = unirl::sample_tokens(lm, prompts(1), 64, lm_sampling());
    const auto d = condition_decoder{}(b);
    const auto noise = torch::randn({64, 1, 8, 8});
    const auto f = unirl::sample_trajectory(unirl::ode::euler({.steps = 20}), flow, d.conditions, noise);
    const auto r = torch::where(d.valid, reward(f), torch::full({64}, static_cast<float>(invalid_reward)));
    e.grid_reward = r.to(torch::kFloat64).mean().item<double>();
    e.grid = torch::where(d.valid.reshape({64, 1, 1}), f.samples().reshape({64, 8, 8}), torch::full({64, 8, 8}, -1.0f));
  }
  return e;
}

nlohmann::json evaluation_json(const evaluation& e) {
  std::map<std::string, double> dist;
  for (std::int64_t c = 0; c < num_conditions; ++c) dist[condition_text(c)] = e.distribution[c].item<double>();
  dist["invalid"] = e.p_invalid;
  std::map<std::string, double> per;
  for (std::int64_t c = 0; c < num_conditions; ++c)
    per[condition_text(c)] = e.per_condition[static_cast<std::size_t>(c)];
  return {{"reward", e.reward},         {"p_7T", e.p_target},          {"p_invalid", e.p_invalid},
          {"lm_kl", e.lm_kl},           {"flow_path_kl", e.flow_kl},   {"grid_reward", e.grid_reward},
          {"lm_distribution", dist},    {"generator_reward_per_condition", per}};
}

std::string most_likely(const evaluation& e) {
  const auto c = e.distribution.slice(0, 0, num_conditions).argmax().item<std::int64_t>();
  std::ostringstream os;
  os << condition_text(c) << " (" << std::fixed << std::setprecision(2) << e.distribution[c].item<double>() << ")";
  return os.str();
}

/// One run of the chain in `mode` with `stages`; returns its summary.
nlohmann::json run_mode(shared_setup& s, const std::string& mode, const unirl::joint::chain_options& stages,
                        const example_options& opt, bool resume) {
  const std::string out = s.root + "/" + mode;
  std::filesystem::create_directories(out);
  std::filesystem::remove(out + "/fingerprint.txt");
  const std::string ckpt = out + "/checkpoint.pt", metrics_path = out + "/metrics.jsonl";
  UNIRL_CHECK(!resume || std::filesystem::exists(ckpt), "--resume: no checkpoint '", ckpt,
              "': expected one from an earlier run of --mode ", mode, " in this output root");
  std::int64_t total = 0;
  for (const auto& st : stages.stages) total += st.steps;
  if (stages.stages.back().steps == 0) total += opt.steps;  // a last stage that runs on: `steps` more
  const std::int64_t checkpoint_at = opt.checkpoint_at > 0 ? opt.checkpoint_at : std::max<std::int64_t>(1, total / 2);
  const std::int64_t last = opt.stop_after > 0 ? std::min(total, opt.stop_after) : total;

  std::cout << "\n== " << mode << ": " << unirl::options::to_json(stages).dump() << ", " << total << " steps\n";
  auto [flow, lm] = load_start(s, opt);
  gen_t gen(flow, s.reward,
            {.algorithm = {.clip_range = 1e-3, .beta = opt.kl_beta, .sampler = {.steps = opt.sampler_steps}},
             .optim = {.lr = opt.gen_lr},
             .clip = {.max_grad_norm = 1.0},
             .group_size = opt.gen_group,
             .minibatches = opt.minibatches,
             .seed = opt.seed,
             .progress = false});
  const unirl::joint::link_options link_opts{.invalid_reward = 0.0};
  lm_t up(lm, link_t{gen, condition_decoder{}, link_opts},
          {.algorithm = {.sampling = lm_sampling()},
           .optim = {.lr = opt.lm_lr},
           .clip = {.max_grad_norm = 1.0},
           .group_size = opt.lm_group,
           .seed = opt.seed + 1,
           .progress = false});
  chain_t chain(up, gen, stages);
  flow_t flow_reference = gen.models().policy.clone();

  const auto start_dist = outcome_distribution(up.models().policy);
  const auto before = evaluate(up.models().policy, gen.models().policy, flow_reference, start_dist, s.reward, opt,
                               link_opts.invalid_reward);
  std::cout << "before: reward " << std::setprecision(4) << before.reward << "  p(7T) " << before.p_target
            << "  p(invalid) " << before.p_invalid << "  most likely " << most_likely(before) << "\n";

  nlohmann::json resumed = nullptr;
  if (resume) {
    chain.load(ckpt);
    resumed = {{"step", chain.step_count()}, {"stage", chain.current_stage().name},
               {"stage_index", chain.stage_index(chain.step_count())}};
    std::cout << "resumed from step " << chain.step_count() << " in stage '" << chain.current_stage().name << "' ("
              << chain.stage_index(chain.step_count()) + 1 << " of " << chain.settings().stages.size() << ")\n";
    // The metrics of the steps after the checkpoint (if the earlier run went on) are dropped.
    std::vector<std::string> kept;
    if (std::ifstream in(metrics_path); in)
      for (std::string line; std::getline(in, line);)
        if (!line.empty() && nlohmann::json::parse(line, nullptr, false).value("step", -1) < chain.step_count())
          kept.push_back(line);
    std::ofstream o(metrics_path, std::ios::trunc);
    for (const auto& l : kept) o << l << "\n";
  } else {
    std::filesystem::remove(metrics_path);
    std::filesystem::remove(ckpt);
  }

  std::ofstream metrics(metrics_path, std::ios::app);
  const auto t0 = clock_type::now();
  std::map<std::string, std::int64_t> steps_per_stage;
  while (chain.step_count() < last) {
    const auto st = chain.step(prompts(opt.prompts));
    ++steps_per_stage[st.stage];
    metrics << st.to_json().dump() << "\n";
    if (chain.step_count() == checkpoint_at) {
      chain.save(ckpt);
      std::cout << "checkpoint after step " << chain.step_count() << " (next stage '" << chain.current_stage().name
                << "') in " << ckpt << "\n";
    }
    if (chain.step_count() % opt.log_every == 0 || chain.step_count() == last) {
      const auto d = outcome_distribution(up.models().policy);
      std::cout << "  step " << std::setw(4) << chain.step_count() << "  " << std::setw(10) << st.stage
                << "  reward " << std::fixed << std::setprecision(3) << st.reward_mean << "  p(7T) "
                << d[target_condition].item<double>();
      if (st.generator) std::cout << "  generator reward " << st.generator->reward_mean;
      std::cout << "\n" << std::flush;
    }
  }
  metrics.close();
  const double seconds = since(t0);
  const auto after = evaluate(up.models().policy, gen.models().policy, flow_reference, start_dist, s.reward, opt,
                              link_opts.invalid_reward);
  std::cout << "after:  reward " << std::setprecision(4) << after.reward << "  p(7T) " << after.p_target
            << "  LM KL " << after.lm_kl << "  flow path KL " << after.flow_kl << "  most likely " << most_likely(after)
            << "  (" << chain.step_count() << " steps, " << std::setprecision(1) << seconds << " s)\n";

  // The final weights of both models, exactly (hexadecimal floating point): equal files = equal
  // runs (the resume test compares a resumed run with an uninterrupted one).
  {
    std::ofstream f(out + "/fingerprint.txt");
    f << "step " << chain.step_count() << "\n" << std::hexfloat;
    auto write = [&](const char* name, const auto& model) {
      torch::NoGradGuard ng;
      double sum = 0, sq = 0;
      for (const torch::Tensor& p : model.parameters()) {
        const torch::Tensor d = p.detach().to(torch::kFloat64);
        sum += d.sum().item<double>();
        sq += d.square().sum().item<double>();
      }
      f << name << " " << sum << " " << sq << "\n";
    };
    write("lm", up.models().policy);
    write("flow", gen.models().policy);
  }
  examples::write_grid_png(out + "/samples_before.png", before.grid, 8, 8, 4);
  examples::write_grid_png(out + "/samples_after.png", after.grid, 8, 8, 4);
  try {
    unirl::train::plot_metrics(metrics_path, out + "/reward_curve.png", {"reward_mean"});
  } catch (const unirl::error& e) {
    std::cout << "no reward curve image: " << e.what() << "\n";
  }
  nlohmann::json summary{{"mode", mode},
                         {"stages", unirl::options::to_json(stages)},
                         {"steps", chain.step_count()},
                         {"steps_this_run", steps_per_stage},
                         {"final_stage", chain.current_stage().name},
                         {"checkpoint", std::filesystem::exists(ckpt) ? nlohmann::json(ckpt) : nlohmann::json(nullptr)},
                         {"checkpoint_at", checkpoint_at},
                         {"resumed_from", resumed},
                         {"seconds", seconds},
                         {"reward_before", before.reward},
                         {"reward_after", after.reward},
                         {"p_7T_before", before.p_target},
                         {"p_7T_after", after.p_target},
                         {"lm_kl", after.lm_kl},
                         {"flow_path_kl", after.flow_kl},
                         {"before", evaluation_json(before)},
                         {"after", evaluation_json(after)}};
  std::ofstream(out + "/summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);
  std::cout << "wrote " << out << "/{summary.json, metrics.jsonl, reward_curve.png, samples_before.png, "
            << "samples_after.png, report.html, fingerprint.txt, checkpoint.pt}\n";
  return summary;
}

// ---- multi-task: three tasks, two modalities, one run ---------------------------------------

/// Digit generation: the classifier's probability that a sample shows the digit of its condition.
struct asked_digit {
  examples::digit_classifier clf;
  torch::Tensor operator()(const unirl::flow_rollout& b) {
    torch::NoGradGuard ng;
    const auto p = torch::softmax(clf->forward(b.samples().clamp(-1, 1)), 1);
    return p.gather(1, torch::div(b.conditions.reshape({-1, 1}).to(torch::kInt64), 2, "floor")).squeeze(1).to(torch::kFloat32);
  }
};
using digits_t = unirl::trainer<flow_t, unirl::algo::flow_grpo<>, asked_digit>;
using arith_t = unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, unirl::rewards::exact_answer>;

/// Addition of numbers up to 19 ("13+5=" -> "18."), the quickstart's task at a smaller size; 50
/// held-out problems never trained on.
struct addition {
  examples::addition_task problems{19, 50, 7};
  unirl::models::char_tokenizer tok{"0123456789+=."};
  unirl::prompt_batch prompts(const std::vector<examples::addition_problem>& ps) const {
    unirl::prompt_batch in{.decode = tok.decoder(), .pad_id = tok.pad_id()};
    for (const auto& p : ps) {
      in.tokens.push_back(tok.encode(p.question() + "="));
      in.texts.push_back(p.question() + "=");
      in.references.push_back(p.answer());
    }
    return in;
  }
  unirl::sampling_options sampling() const { return {.max_new_tokens = 3, .stop_tokens = {tok.id('.')}}; }
  /// Greedy held-out accuracy.
  double accuracy(const unirl::models::gpt& m) const {
    torch::NoGradGuard ng;
    auto s = sampling();
    s.top_k = 1;
    const auto b = unirl::sample_tokens(m, prompts(problems.heldout()), 1, s);
    std::int64_t right = 0;
    for (std::size_t i = 0; i < b.completions.size(); ++i) right += b.completions[i] == b.references[i];
    return static_cast<double>(right) / static_cast<double>(b.completions.size());
  }
};

/// Mean asked-digit reward of ODE samples from fixed noise, `n` per condition.
double digits_score(flow_t& flow, asked_digit& reward, std::int64_t n) {
  torch::NoGradGuard ng;
  const examples::scoped_seed fixed(2468);
  const auto labels = torch::arange(num_conditions, torch::kInt64).repeat_interleave(n);
  const auto b = unirl::sample_trajectory(unirl::ode::euler({.steps = 20}), flow, labels,
                                          torch::randn({num_conditions * n, 1, 8, 8}));
  return reward(b).to(torch::kFloat64).mean().item<double>();
}

/// The chain (joint mode), digit generation and addition as three tasks of one
/// `unirl::joint::multitask`, chosen per step by `weighting`.
nlohmann::json run_multitask(shared_setup& s, const example_options& opt) {
  const std::string out = s.root + "/multitask";
  std::filesystem::create_directories(out);
  std::cout << "\n== multitask: enhancer (chain, joint) + digits (Flow-GRPO) + addition (GRPO), "
            << opt.multitask_steps << " steps, weighting " << opt.weighting << "\n";
  // Task 1: the chain of the other modes, both models learning.
  auto [flow, lm] = load_start(s, opt);
  gen_t gen(flow, s.reward,
            {.algorithm = {.clip_range = 1e-3, .beta = opt.kl_beta, .sampler = {.steps = opt.sampler_steps}},
             .optim = {.lr = opt.gen_lr}, .clip = {.max_grad_norm = 1.0}, .group_size = opt.gen_group,
             .minibatches = opt.minibatches, .seed = opt.seed, .progress = false});
  lm_t up(lm, link_t{gen, condition_decoder{}, {.invalid_reward = 0.0}},
          {.algorithm = {.sampling = lm_sampling()}, .optim = {.lr = opt.lm_lr}, .clip = {.max_grad_norm = 1.0},
           .group_size = opt.lm_group, .seed = opt.seed + 1, .progress = false});
  chain_t chain(up, gen, {.stages = {{.name = "joint", .steps = 0, .train = unirl::joint::stage_mode::joint}}});
  flow_t flow_reference = gen.models().policy.clone();
  const auto start_dist = outcome_distribution(up.models().policy);
  // Task 2: digit generation, its own copy of the pretrained flow model.
  asked_digit digit_reward{s.digits.clf};
  digits_t digits(load_start(s, opt).flow, digit_reward,
                  {.algorithm = {.clip_range = 1e-3, .beta = opt.kl_beta, .sampler = {.steps = opt.sampler_steps}},
                   .optim = {.lr = opt.gen_lr}, .clip = {.max_grad_norm = 1.0}, .group_size = opt.gen_group,
                   .minibatches = opt.minibatches, .seed = opt.seed + 2, .progress = false});
  // Task 3: addition, a char GPT taught by the SFT stage first (cached).
  addition arith;
  unirl::models::gpt arith_lm(unirl::models::gpt_options{
      .vocab_size = arith.tok.vocab_size(), .max_len = 12, .n_layer = 2, .n_head = 4, .d_model = 64});
  {
    unirl::train::sft_trainer<unirl::models::gpt> sft(
        arith_lm, {.optim = {.lr = 2e-3}, .batch_size = 64, .steps = opt.arith_sft_steps, .seed = opt.seed,
                   .progress = false,
                   .out = s.root + "/sft_addition_d64_i" +
                          std::to_string(opt.arith_sft_steps) + "_s" + std::to_string(opt.seed)});
    sft.run([&](std::int64_t n) {
      std::vector<std::vector<std::int64_t>> ps, cs;
      for (std::int64_t i = 0; i < n; ++i) {
        const auto p = arith.problems.draw_train();
        ps.push_back(arith.tok.encode(p.question() + "="));
        cs.push_back(arith.tok.encode(p.answer() + "."));
      }
      return unirl::train::make_sft_batch(ps, cs, arith.tok.pad_id());
    });
  }
  arith_t adder(arith_lm, unirl::rewards::exact_answer{},
                {.algorithm = {.sampling = arith.sampling()}, .optim = {.lr = opt.arith_lr},
                 .clip = {.max_grad_norm = 1.0}, .group_size = 8, .seed = opt.seed + 3, .progress = false});

  auto snapshot = [&] {
    const auto e = evaluate(up.models().policy, gen.models().policy, flow_reference, start_dist, s.reward, opt, 0.0);
    return nlohmann::json{{"enhancer_reward", e.reward},
                          {"digits_reward", digits_score(digits.models().policy, digit_reward, opt.eval_samples)},
                          {"addition_accuracy", arith.accuracy(adder.models().policy)}};
  };
  const auto before = snapshot();
  std::cout << "before: " << before.dump() << "\n";

  unirl::joint::multitask_options mo{.seed = static_cast<std::uint64_t>(opt.seed)};
  mo.weighting = unirl::options::parse_value<unirl::joint::task_weighting>("weighting", opt.weighting);
  unirl::joint::multitask run{
      mo,
      unirl::joint::task{"enhancer", 1.0, &chain, [&](std::int64_t) { return prompts(opt.prompts); }},
      unirl::joint::task{"digits", 1.0, &digits,
                         [&](std::int64_t) { return torch::randint(0, num_conditions, {8}, torch::kInt64); }},
      unirl::joint::task{"addition", 1.0, &adder, [&](std::int64_t) {
                           std::vector<examples::addition_problem> ps;
                           for (int i = 0; i < 8; ++i) ps.push_back(arith.problems.draw_train());
                           return arith.prompts(ps);
                         }}};
  const std::string metrics_path = out + "/metrics.jsonl";
  std::ofstream metrics(metrics_path, std::ios::trunc);
  const auto t0 = clock_type::now();
  for (std::int64_t k = 0; k < opt.multitask_steps; ++k) {
    const auto st = run.step();
    metrics << st.to_json().dump() << "\n";
    if ((k + 1) % (opt.log_every * 4) == 0 || k + 1 == opt.multitask_steps) {
      std::cout << "  step " << std::setw(4) << k + 1;
      for (const auto& t : run.statistics())
        std::cout << "  " << t.name << " p=" << std::fixed << std::setprecision(2) << t.probability << " n=" << t.steps
                  << " r=" << std::setprecision(3) << t.reward;
      std::cout << "\n" << std::flush;
    }
  }
  metrics.close();
  const double seconds = since(t0);
  const auto after = snapshot();
  std::cout << "after:  " << after.dump() << "  (" << seconds << " s)\n";
  nlohmann::json tasks = nlohmann::json::array();
  for (const auto& t : run.statistics())
    tasks.push_back({{"name", t.name}, {"steps", t.steps}, {"final_probability", t.probability},
                     {"reward_last_ema", t.reward_fast}});
  nlohmann::json summary{{"mode", "multitask"}, {"weighting", opt.weighting}, {"steps", opt.multitask_steps},
                         {"seconds", seconds},  {"before", before},              {"after", after},
                         {"tasks", tasks}};
  std::ofstream(out + "/summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);
  std::cout << "| task | steps | before | after |\n|---|---|---|---|\n";
  for (const auto& [name, key] : {std::pair{"enhancer", "enhancer_reward"}, std::pair{"digits", "digits_reward"},
                                  std::pair{"addition", "addition_accuracy"}}) {
    std::int64_t n = 0;
    for (const auto& t : run.statistics())
      if (t.name == name) n = t.steps;
    std::cout << "| " << name << " | " << n << " | " << std::setprecision(3) << before[key].get<double>() << " | "
              << after[key].get<double>() << " |\n";
  }
  std::cout << "wrote " << out << "/{summary.json, metrics.jsonl, report.html}\n";
  return summary;
}

unirl::joint::chain_options single_stage(const std::string& mode) {
  const auto m = unirl::options::parse_value<unirl::joint::stage_mode>(
      "--mode", mode == "lm" ? "upstream" : mode);
  return {.stages = {{.name = mode, .steps = 0, .train = m}}};
}

}  // namespace

BOOST_HANA_ADAPT_STRUCT(example_options, steps, stage_steps, checkpoint_at, stop_after, prompts, lm_group, gen_group,
                        lm_lr, gen_lr, kl_beta, minibatches, sampler_steps, pretrain_iters, hidden, sft_steps, d_model,
                        eval_samples, log_every, seed, threads, multitask_steps, weighting, arith_sft_steps, arith_lr);

int main(int argc, char** argv) try {
  example_options opt;
  auto flags = unirl::options::parse_command_line(
      opt, argc, argv,
      {{"mode", "all"}, {"out", "runs/50_joint_digits"}, {"stages", std::string(UNIRL_EXAMPLE_DIR) + "/stages.yaml"},
       {"resume", "false"}, {"help", "false"}});
  if (flags["help"] == "true") {
    std::cout << "usage: joint_digits [--mode all|lm|generator|joint|staged|multitask] [--out DIR] [--stages FILE] [--resume] "
                 "[key=value ...]\n"
              << unirl::options::to_string(opt);
    return 0;
  }
  const std::string mode = flags["mode"];
  std::vector<std::string> modes;
  if (mode == "all") modes = {"lm", "generator", "joint", "staged", "multitask"};
  else if (mode == "lm" || mode == "generator" || mode == "joint" || mode == "staged" || mode == "multitask")
    modes = {mode};
  else
    throw unirl::config_error("--mode",
                              "value '" + mode + "': expected all, lm, generator, joint, staged or multitask");
  std::cout << unirl::options::to_string(opt) << "\n";
  torch::set_num_threads(static_cast<int>(std::max<std::int64_t>(1, opt.threads)));

  // The staged schedule: the recipe file (a unirl::joint::chain_options), its lengths optionally
  // replaced by stage_steps.
  unirl::joint::chain_options staged;
  if (std::find(modes.begin(), modes.end(), "staged") != modes.end()) {
    unirl::options::load_recipe(staged, flags["stages"]);
    UNIRL_CHECK(!staged.stages.empty(), "--stages '", flags["stages"], "' declares no stages: expected at least one");
    if (!opt.stage_steps.empty()) {
      if (opt.stage_steps.size() != staged.stages.size())
        throw unirl::config_error("stage_steps", "has " + std::to_string(opt.stage_steps.size()) + " lengths for the " +
                                                     std::to_string(staged.stages.size()) + " stages of '" +
                                                     flags["stages"] + "': expected as many");
      for (std::size_t i = 0; i < staged.stages.size(); ++i) staged.stages[i].steps = opt.stage_steps[i];
      unirl::options::validate(staged);
    }
  }

  shared_setup s;
  s.root = flags["out"];
  std::filesystem::create_directories(s.root);
  s.digits = examples::prepare_digits(std::string(UNIRL_DATA_DIR) + "/digits.csv.gz");
  s.conditions = style_conditions(s.digits.images, s.digits.labels);
  {
    const auto sevens = ink(s.digits.images).masked_select(s.digits.labels == 7);
    s.reward = thick_seven{s.digits.clf, std::get<0>(sevens.median(0)).item<double>(), sevens.std().item<double>() / 2};
    std::cout << "reward: p(7 | x) * sigmoid((ink - " << s.reward.center << ") / " << s.reward.scale << ")\n";
  }

  nlohmann::json all = nlohmann::json::object();
  for (const auto& m : modes)
    if (m != "multitask")
      all[m] = run_mode(s, m, m == "staged" ? staged : single_stage(m), opt, flags["resume"] == "true");

  std::cout << "\n| mode | reward before | reward after | p(7T) before -> after | LM KL | flow path KL | seconds |\n"
            << "|---|---|---|---|---|---|---|\n";
  for (const auto& m : modes) {
    if (m == "multitask") continue;
    const auto& r = all[m];
    std::cout << std::fixed << "| " << m << " | " << std::setprecision(4) << r["reward_before"].get<double>() << " | "
              << r["reward_after"].get<double>() << " | " << std::setprecision(3) << r["p_7T_before"].get<double>()
              << " -> " << r["p_7T_after"].get<double>() << " | " << r["lm_kl"].get<double>() << " | "
              << r["flow_path_kl"].get<double>() << " | " << std::setprecision(1) << r["seconds"].get<double>()
              << " |\n";
  }
  if (std::find(modes.begin(), modes.end(), "multitask") != modes.end()) all["multitask"] = run_multitask(s, opt);
  nlohmann::json summary{{"modes", all},
                         {"classifier_accuracy", s.digits.accuracy},
                         {"pretrain_seconds", s.pretrain_seconds},
                         {"sft_seconds", s.sft_seconds},
                         {"reward", {{"center", s.reward.center}, {"scale", s.reward.scale}}},
                         {"options", unirl::options::to_json(opt)}};
  std::ofstream(s.root + "/summary.json") << summary.dump(2) << "\n";
  // The root's report overlays the modes' runs (one colour per mode).
  std::vector<std::filesystem::path> runs;
  for (const auto& m : modes) runs.emplace_back(s.root + "/" + m);
  unirl::train::write_report(runs, s.root + "/report.html", {.title = "joint_digits: " + std::to_string(modes.size()) + " mode(s)"});
  std::cout << "wrote " << s.root << "/summary.json, " << s.root << "/report.html\njoint_digits done: " << modes.size()
            << " run(s)\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "joint_digits: " << e.what() << "\n";
  return 2;
}
