// Vision-language tasks on real images (issue 13): the built-in small VLM (CLIP-style vision
// tower + LLaVA projector + character-level models::gpt, include/unirl/vlm.hpp) learns one of
// three tasks on the real 8x8 digits (examples/data/digits.csv.gz), first supervised into a modest
// band, then with GRPO on the task's rule reward — the trainer, sampler and rewards of the text
// track, unchanged; the images enter the prompts as image-slot tokens.
//
//   vlm_tasks --task vqa        --out runs/vqa     # "which digit is this?"        -> "7"
//   vlm_tasks --task grounding  --out runs/ground  # canvas, "where is the 7?"     -> "[x1, y1, x2, y2]"
//   vlm_tasks --task agent      --out runs/agent   # canvas, "click the 7"         -> "click(x, y)"
//   vlm_tasks --task vqa rl_steps=20 seed=3        # any option as key=value (--help lists them)
//
// Rewards: vqa = exact answer + 0.1 format; grounding = 0.7 IoU + 0.3 format (seed 003's
// grounding recipe, the format check in place of its CLIP similarity; the answer must be the box
// alone, as iou_reward reads the first four numbers); agent = click_reward (1 inside the target
// box, 0 otherwise, 0 and counted when the text is not exactly one action).
// Held-out figures (greedy, digit images never trained on): accuracy / mean IoU / click success,
// before and after GRPO. Every GRPO step encodes each prompt's image once (the vision cache):
// the program checks vision_tower_calls == prompts for each step. Writes summary.json,
// metrics.jsonl and canvases.png (held-out canvases before / after: true boxes green, predicted
// boxes red, clicks blue) in --out.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/core/command_line.hpp>
#include <unirl/data/canvas.hpp>
#include <unirl/models/char_tokenizer.hpp>
#include <unirl/rewards/action_parser.hpp>
#include <unirl/rewards/actions.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/rollout/engine_sampler.hpp>
#include <unirl/rollout/token_logprob.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/train/report.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/train/supervised.hpp>
#include <unirl/trainer.hpp>
#include <unirl/vlm.hpp>

#include "common/digits.hpp"

namespace vlm = unirl::models::vlm;

struct vlm_tasks_options {
  std::int64_t canvas = 32;            // grounding / agent canvas side, pixels (digits 8x8 at scale 1)
  std::int64_t min_digits = 2;         // digits per canvas
  std::int64_t max_digits = 3;
  std::int64_t vqa_scale = 2;          // vqa: the 8x8 digit drawn at this scale (16x16)
  std::int64_t patch = 4;              // vision tower patch side
  std::int64_t vision_hidden = 64;
  std::int64_t vision_layers = 2;
  std::int64_t d_model = 64;           // language model
  std::int64_t n_layer = 2;
  std::int64_t n_head = 4;
  std::int64_t heldout_digits = 297;   // the last digit images of the set: held out (never trained on)
  std::int64_t heldout = 200;          // held-out prompts
  double sft_lr = 2e-3;
  std::int64_t sft_batch = 32;
  std::int64_t sft_max_steps = 3000;
  std::int64_t eval_every = 25;        // SFT steps between held-out evaluations
  double sft_seconds = 300;            // stop the supervised stage at the first evaluation after this many seconds
  bool sft_train_tower = true;         // the vision tower trains in SFT (frozen in GRPO: features cached per step)
  double band = -1;                    // stop SFT once the held-out figure reaches it (-1: the task's default)
  std::int64_t rl_steps = 2500;
  std::int64_t prompts_per_step = 16;
  std::int64_t group_size = 8;
  double rl_lr = -1;                   // -1: the task's default (vqa 1e-3, grounding 3e-4, agent 1e-4)
  double temperature = 1.0;
  bool engine = true;                  // sample (GRPO and the greedy evaluations) on the rollout engine; false: the static batch
  double kl_coef = 0.0;                // > 0: a reference model (it shares the vision cache)
  double format_weight = -1;           // -1: the task's default (vqa 0.1, grounding 0.3)
  double rl_seconds = -1;              // stop GRPO after this many seconds (-1: the task's default: vqa and
                                       // grounding 200 s, agent 600 s)
  std::int64_t rl_eval_every = 250;
  std::int64_t grid = 8;               // held-out canvases drawn in canvases.png (before and after)
  std::int64_t seed = 0;
  std::int64_t threads = 1;
  std::string pretrained = "";         // weights file after the supervised stage: loaded when it exists, else written
};
BOOST_HANA_ADAPT_STRUCT(vlm_tasks_options, canvas, min_digits, max_digits, vqa_scale, patch, vision_hidden,
                        vision_layers, d_model, n_layer, n_head, heldout_digits, heldout, sft_lr, sft_batch,
                        sft_max_steps, eval_every, sft_seconds, sft_train_tower, band, rl_steps, prompts_per_step, group_size,
                        rl_lr, temperature, engine, kl_coef, format_weight, rl_seconds, rl_eval_every, grid, seed, threads, pretrained);

namespace {
using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

enum class task_kind { vqa, grounding, agent };

// One example: an image, the question's digit, and the reference answer (text the reward reads).
struct example {
  torch::Tensor image;               // (1, H, W)
  std::int64_t digit = 0;            // the digit asked about (vqa: the answer)
  unirl::data::pixel_box box{};      // its box (grounding / agent)
  std::string reference;             // vqa: "7"; grounding / agent: "[x1, y1, x2, y2]"
  std::vector<unirl::data::pixel_box> boxes;  // every digit's box (drawn in the grid)
};

struct task {
  task_kind kind;
  unirl::models::char_tokenizer tok{"0123456789abcdefghijklmnopqrstuvwxyz[](),.:? \n"};
  unirl::data::digit_canvas train_set, heldout_set;
  std::mt19937_64 rng;
  std::vector<example> heldout;

  task(task_kind k, const examples::digits& d, const vlm_tasks_options& o)
      : kind(k),
        train_set(d.images.slice(0, 0, d.images.size(0) - o.heldout_digits),
                  d.labels.slice(0, 0, d.images.size(0) - o.heldout_digits), canvas_opts(k, o)),
        heldout_set(d.images.slice(0, d.images.size(0) - o.heldout_digits),
                    d.labels.slice(0, d.images.size(0) - o.heldout_digits), canvas_opts(k, o)),
        rng(static_cast<std::uint64_t>(o.seed) * 7919 + 17) {
    std::mt19937_64 h(1000003 + static_cast<std::uint64_t>(o.seed));
    for (std::int64_t i = 0; i < o.heldout; ++i) heldout.push_back(draw(heldout_set, h));
  }

  static unirl::data::canvas_options canvas_opts(task_kind k, const vlm_tasks_options& o) {
    if (k == task_kind::vqa)
      return {.size = 8 * o.vqa_scale, .min_digits = 1, .max_digits = 1, .min_scale = o.vqa_scale, .max_scale = o.vqa_scale};
    return {.size = o.canvas, .min_digits = o.min_digits, .max_digits = o.max_digits};
  }

  example draw(const unirl::data::digit_canvas& set, std::mt19937_64& g) const {
    example e;
    const auto c = kind == task_kind::vqa ? set.single(g()) : set(g());
    const auto which = static_cast<std::size_t>(g() % c.labels.size());
    e.image = c.image;
    e.digit = c.labels[which];
    e.box = c.boxes[which];
    e.boxes = c.boxes;
    e.reference = kind == task_kind::vqa ? std::to_string(e.digit) : unirl::data::box_text(e.box);
    return e;
  }
  example draw_train() { return draw(train_set, rng); }

  // The prompt around the image (a chat-like template).
  std::string question(const example& e) const {
    const auto d = std::to_string(e.digit);
    switch (kind) {
      case task_kind::vqa: return "which digit is this?";
      case task_kind::grounding: return "where is the " + d + "?";
      default: return "click the " + d;
    }
  }
  // "user: <image>\n<question>\nassistant: " with the image's placeholder ids in place of <image>.
  std::vector<std::int64_t> prompt_ids(const example& e, vlm::vision_cache& images) const {
    auto ids = tok.encode("user: ");
    const auto img = images.add(e.image);
    ids.insert(ids.end(), img.begin(), img.end());
    const auto rest = tok.encode("\n" + question(e) + "\nassistant: ");
    ids.insert(ids.end(), rest.begin(), rest.end());
    return ids;
  }
  // The answer the supervised stage teaches.
  std::string target(const example& e) const {
    if (kind == task_kind::agent) {
      const auto cx = (e.box.x1 + e.box.x2) / 2, cy = (e.box.y1 + e.box.y2) / 2;
      return "click(" + std::to_string(cx) + ", " + std::to_string(cy) + ")";
    }
    return e.reference;
  }

  unirl::prompt_batch prompts(const std::vector<example>& es, vlm::vision_cache& images) const {
    unirl::prompt_batch in{.decode = tok.decoder(), .pad_id = tok.pad_id()};
    for (const auto& e : es) {
      in.tokens.push_back(prompt_ids(e, images));
      in.texts.push_back(question(e));
      in.references.push_back(e.reference);
    }
    return in;
  }
  bool engine = true;
  unirl::sampling_options sampling(double temperature) const {
    const std::int64_t n = kind == task_kind::vqa ? 3 : kind == task_kind::grounding ? 20 : 16;
    return {.max_new_tokens = n, .temperature = temperature, .stop_tokens = {tok.id('\n')}, .engine = engine};
  }
  std::string figure_name() const {
    return kind == task_kind::vqa ? "accuracy" : kind == task_kind::grounding ? "mean IoU" : "click success";
  }
};

// The answer formats (the whole completion, stop token excluded).
const char* format_pattern(task_kind k) {
  switch (k) {
    case task_kind::vqa: return R"(\d)";
    case task_kind::grounding: return R"(\[\d{1,3}, \d{1,3}, \d{1,3}, \d{1,3}\])";
    default: return R"(click\(\d{1,3}, \d{1,3}\))";
  }
}

struct evaluation {
  double figure = 0.0;                      // accuracy / mean IoU / click success
  double malformed = 0.0;                   // fraction of answers out of format
  std::vector<std::string> completions;
};

// Greedy held-out evaluation, in chunks of `chunk` prompts (the image table is cleared before
// each: clip_vision::features_packed runs a chunk's images as one sequence with a block-diagonal
// mask, whose cost grows with the square of the images encoded together).
evaluation evaluate(const vlm::vlm<unirl::models::gpt>& model, const task& t, std::size_t chunk = 25) {
  torch::NoGradGuard ng;
  auto s = t.sampling(1.0);
  s.top_k = 1;
  std::vector<std::string> completions;
  std::vector<torch::Tensor> scores, formats;
  unirl::rewards::regex_format fmt{{.pattern = format_pattern(t.kind)}};
  const unirl::rewards::iou_reward iou{};
  const unirl::rewards::click_reward click{{.whole = true}};
  for (std::size_t at = 0; at < t.heldout.size(); at += chunk) {
    const std::vector<example> part(t.heldout.begin() + static_cast<std::ptrdiff_t>(at),
                                    t.heldout.begin() + static_cast<std::ptrdiff_t>(std::min(at + chunk, t.heldout.size())));
    model.images().clear();
    const auto b = unirl::rollout::sample_completions(model, t.prompts(part, model.images()), 1, s);
    formats.push_back(fmt(b));
    if (t.kind == task_kind::vqa) {
      std::vector<float> right;
      for (std::size_t i = 0; i < b.completions.size(); ++i) right.push_back(b.completions[i] == b.references[i]);
      scores.push_back(torch::tensor(right));
    } else if (t.kind == task_kind::grounding) {
      scores.push_back(iou(b));
    } else {
      scores.push_back(click(b));
    }
    completions.insert(completions.end(), b.completions.begin(), b.completions.end());
  }
  model.images().clear();
  evaluation ev;
  ev.completions = std::move(completions);
  ev.figure = torch::cat(scores).to(torch::kDouble).mean().item<double>();
  ev.malformed = 1.0 - torch::cat(formats).to(torch::kDouble).mean().item<double>();
  return ev;
}

// What canvases.png shows for one held-out answer: its box (grounding) or click (agent).
void draw_answer(const task& t, const std::string& completion, std::vector<unirl::data::pixel_box>& boxes,
                 std::vector<unirl::data::pixel_point>& clicks) {
  if (t.kind == task_kind::grounding) {
    const auto n = unirl::rewards::detail::numbers_in(completion);
    if (n.size() >= 4 && std::all_of(n.begin(), n.begin() + 4, [](double v) { return std::abs(v) < 1e6; }))
      boxes.push_back({static_cast<std::int64_t>(n[0]), static_cast<std::int64_t>(n[1]), static_cast<std::int64_t>(n[2]),
                       static_cast<std::int64_t>(n[3])});
  } else if (t.kind == task_kind::agent) {
    const auto a = unirl::rewards::parse_action(completion);
    if (a && a.action->type == unirl::rewards::action_type::click) clicks.push_back({a.action->x, a.action->y});
  }
}
}  // namespace

int main(int argc, char** argv) try {
  vlm_tasks_options o;
  auto flags = unirl::options::parse_command_line(o, argc, argv,
                                                  {{"out", "runs/vlm_tasks"}, {"task", "vqa"}, {"help", "false"}});
  if (flags["help"] == "true") {
    std::cout << "usage: vlm_tasks [--task vqa|grounding|agent] [--out DIR] [key=value ...]\n"
              << unirl::options::to_string(o);
    return 0;
  }
  const std::string task_name = flags["task"];
  UNIRL_CHECK(task_name == "vqa" || task_name == "grounding" || task_name == "agent", "vlm_tasks: --task '", task_name,
              "': expected vqa, grounding or agent");
  const auto kind = task_name == "vqa" ? task_kind::vqa : task_name == "grounding" ? task_kind::grounding : task_kind::agent;
  const std::string out = flags["out"];
  std::filesystem::create_directories(out);
  torch::set_num_threads(static_cast<int>(std::max<std::int64_t>(1, o.threads)));
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));
  const auto t_start = clock_type::now();
  std::cout << std::fixed;

  const auto digits = examples::load_digits(std::string(UNIRL_DATA_DIR) + "/digits.csv.gz");
  UNIRL_CHECK(o.heldout_digits >= 10 && o.heldout_digits + 100 <= digits.images.size(0), "vlm_tasks: heldout_digits = ",
              o.heldout_digits, ": expected in [10, ", digits.images.size(0) - 100, "]");
  task t(kind, digits, o);
  t.engine = o.engine;
  const double band = o.band >= 0 ? o.band : kind == task_kind::vqa ? 0.35 : kind == task_kind::grounding ? 0.30 : 0.15;
  const double rl_lr = o.rl_lr > 0 ? o.rl_lr : kind == task_kind::vqa ? 1e-3 : kind == task_kind::agent ? 1e-4 : 3e-4;
  const double rl_budget = o.rl_seconds >= 0 ? o.rl_seconds : kind == task_kind::agent ? 600.0 : 200.0;
  const double format_weight = o.format_weight >= 0 ? o.format_weight : kind == task_kind::vqa ? 0.1 : 0.3;

  // The built-in small VLM: grey images (1 channel) of the task's size, 4x4 patches.
  const std::int64_t side = kind == task_kind::vqa ? 8 * o.vqa_scale : o.canvas;
  auto model = vlm::make_small({.vocab_size = t.tok.vocab_size(),
                                .max_len = 48 + (side / o.patch) * (side / o.patch) + 24,
                                .n_layer = o.n_layer,
                                .n_head = o.n_head,
                                .d_model = o.d_model,
                                .image_size = side,
                                .patch_size = o.patch,
                                .num_channels = 1,
                                .vision_hidden = o.vision_hidden,
                                .vision_layers = o.vision_layers,
                                .vision_heads = 4,
                                .vision_intermediate = 2 * o.vision_hidden,
                                .model = {.freeze_vision_tower = !o.sft_train_tower}});
  std::cout << "task " << task_name << ": " << side << "x" << side << " images, " << model.images().vocab_size()
            << " text tokens, " << (side / o.patch) * (side / o.patch) << " image tokens per prompt\n";

  // ---- stage 1: supervised, into the band ------------------------------------------------------
  std::cout << "stage 1: supervised (train::sft_trainer) until the held-out " << t.figure_name() << " reaches "
            << std::setprecision(2) << band << "\n";
  double figure = 0.0;
  const bool cached = !o.pretrained.empty() && std::filesystem::exists(o.pretrained);
  if (cached) {
    torch::load(model.net(), o.pretrained);
    std::cout << "  loaded the supervised weights from " << o.pretrained << "\n";
    o.sft_max_steps = 0;
  }
  unirl::train::sft_trainer<vlm::vlm<unirl::models::gpt>> sft(
      model, {.optim = {.lr = o.sft_lr}, .batch_size = o.sft_batch, .steps = o.sft_max_steps,
              .eval_every = o.eval_every, .progress = false});
  const auto r = sft.run(
      [&](std::int64_t n) {
        model.images().clear();  // this batch's image table
        std::vector<std::vector<std::int64_t>> prompts, answers;
        for (std::int64_t i = 0; i < n; ++i) {
          const auto e = t.draw_train();
          prompts.push_back(t.prompt_ids(e, model.images()));
          answers.push_back(t.tok.encode(t.target(e) + "\n"));
        }
        return unirl::train::make_sft_batch(prompts, answers, t.tok.pad_id());
      },
      [&](const unirl::train::supervised_stats& s) {
        model.train(false);
        const auto ev = evaluate(model, t);
        figure = ev.figure;
        std::cout << "  step " << std::setw(5) << s.step + 1 << "  loss " << std::setprecision(3) << s.loss
                  << "  held-out " << t.figure_name() << " " << std::setprecision(3) << figure << "  out of format "
                  << ev.malformed << "\n"
                  << std::flush;
        return figure >= band || since(t_start) >= o.sft_seconds;
      });
  const double sft_seconds = since(t_start);
  if (!cached && !o.pretrained.empty()) torch::save(model.net(), o.pretrained);
  // GRPO keeps the tower frozen: each step's images are encoded once and cached.
  for (auto& p : model.vision_tower()->parameters()) p.set_requires_grad(false);
  model.train(false);
  model.images().clear();
  const auto before = evaluate(model, t);
  std::cout << "supervised: " << r.steps << " steps, " << std::setprecision(1) << sft_seconds << " s: held-out "
            << t.figure_name() << " " << std::setprecision(3) << before.figure << "\n";

  // ---- stage 2: GRPO on the task reward ----------------------------------------------------------
  unirl::rewards::click_reward click{{.whole = true}};
  auto grpo_options = [&] {
    return unirl::trainer_options<unirl::algo::grpo<>>{
        .algorithm = {.clip_high = 0.28,
                      .kl_coef = o.kl_coef,
                      .agg = unirl::algo::loss_agg::token_mean,
                      .advantage = unirl::algo::advantage_kind::dr_grpo,
                      .sampling = t.sampling(o.temperature)},
        .optim = {.lr = rl_lr},
        .schedule = {.kind = unirl::train::schedule_kind::cosine, .warmup_steps = 10, .min_lr_ratio = 0.1},
        .group_size = o.group_size,
        .seed = o.seed,
        .metrics_path = (std::filesystem::path(out) / "metrics.jsonl").string(),
        .samples_path = (std::filesystem::path(out) / "samples.jsonl").string(),
        .progress = false,
        .total_steps = o.rl_steps};
  };
  std::int64_t rl_steps = 0, tower_calls = 0, prompts_total = 0, cache_mismatches = 0, malformed_total = 0;
  const auto t_rl = clock_type::now();
  auto run_grpo = [&](auto& trainer) {
    auto& policy = trainer.models().policy;
    std::cout << "stage 2: GRPO, " << o.prompts_per_step << " prompts x " << o.group_size << " samples per step, up to "
              << o.rl_steps << " steps / " << std::setprecision(0) << rl_budget << " s\n";
    for (; rl_steps < o.rl_steps && since(t_rl) < rl_budget; ++rl_steps) {
      policy.images().clear();
      (void)policy.images().take_vision_tower_calls();  // forget the evaluation's encodings
      std::vector<example> es;
      for (std::int64_t i = 0; i < o.prompts_per_step; ++i) es.push_back(t.draw_train());
      const auto st = trainer.step(t.prompts(es, policy.images()));
      const auto calls = static_cast<std::int64_t>(st.extra.at("vision_tower_calls"));
      tower_calls += calls;
      prompts_total += o.prompts_per_step;
      cache_mismatches += calls != o.prompts_per_step;
      if (kind == task_kind::agent) malformed_total += static_cast<std::int64_t>(click.last_components().at("malformed"));
      if (rl_steps == 0 || (rl_steps + 1) % o.rl_eval_every == 0) {
        policy.train(false);
        std::cout << "  step " << std::setw(4) << rl_steps + 1 << "  reward " << std::setprecision(3) << st.reward_mean
                  << "  vision_tower_calls " << calls << " (prompts " << o.prompts_per_step << ")";
        if (kind == task_kind::agent) std::cout << "  malformed " << click.last_components().at("malformed");
        if ((rl_steps + 1) % o.rl_eval_every == 0) {
          policy.images().clear();
          std::cout << "  held-out " << t.figure_name() << " " << std::setprecision(3) << evaluate(policy, t).figure;
        }
        std::cout << "\n" << std::flush;
      }
    }
    policy.train(false);
    policy.images().clear();
    return evaluate(policy, t);
  };
  evaluation after;
  if (kind == task_kind::vqa) {
    using reward_t = unirl::rewards::weighted<unirl::rewards::exact_answer, unirl::rewards::regex_format>;
    reward_t reward{{.weights = {1.0, format_weight}}, unirl::rewards::exact_answer{},
                    unirl::rewards::regex_format{{.pattern = format_pattern(kind)}}};
    unirl::trainer<vlm::vlm<unirl::models::gpt>, unirl::algo::grpo<>, reward_t> trainer{model, reward, grpo_options()};
    after = run_grpo(trainer);
  } else if (kind == task_kind::grounding) {
    using reward_t = unirl::rewards::weighted<unirl::rewards::iou_reward, unirl::rewards::regex_format>;
    reward_t reward{{.weights = {0.7, format_weight}}, unirl::rewards::iou_reward{},
                    unirl::rewards::regex_format{{.pattern = format_pattern(kind)}}};
    unirl::trainer<vlm::vlm<unirl::models::gpt>, unirl::algo::grpo<>, reward_t> trainer{model, reward, grpo_options()};
    after = run_grpo(trainer);
  } else {
    using reward_t = unirl::rewards::weighted<unirl::rewards::click_reward>;
    reward_t reward{{.weights = {1.0}}, click};  // copies of `click` share its counts
    unirl::trainer<vlm::vlm<unirl::models::gpt>, unirl::algo::grpo<>, reward_t> trainer{model, reward, grpo_options()};
    after = run_grpo(trainer);
  }
  const double rl_seconds = since(t_rl);
  const double seconds = since(t_start);
  std::cout << "vision_tower_calls " << tower_calls << " for " << prompts_total << " prompts over " << rl_steps
            << " GRPO steps (" << cache_mismatches << " steps differ)\n";
  std::cout << "held-out " << t.figure_name() << ": " << std::setprecision(3) << before.figure << " -> " << after.figure
            << " after " << rl_steps << " GRPO steps (" << std::setprecision(0) << rl_seconds << " s RL, " << seconds
            << " s total)\n";

  // ---- canvases.png: held-out canvases before (first row) and after (second row) -----------------
  std::vector<torch::Tensor> imgs;
  std::vector<std::vector<unirl::data::pixel_box>> pred, truth;
  std::vector<std::vector<unirl::data::pixel_point>> clicks;
  const auto g = std::min<std::int64_t>(o.grid, static_cast<std::int64_t>(t.heldout.size()));
  for (const evaluation* ev : std::initializer_list<const evaluation*>{&before, &after})
    for (std::int64_t i = 0; i < g; ++i) {
      const auto& e = t.heldout[static_cast<std::size_t>(i)];
      imgs.push_back(e.image);
      truth.push_back({e.box});
      pred.emplace_back();
      clicks.emplace_back();
      draw_answer(t, ev->completions[static_cast<std::size_t>(i)], pred.back(), clicks.back());
    }
  std::string png = "canvases.png";
  try {
    if (g > 0)
      unirl::data::save_canvas_grid((std::filesystem::path(out) / png).string(), imgs, pred, truth, clicks,
                                    {.zoom = kind == task_kind::vqa ? 8 : 4, .columns = g});
  } catch (const unirl::error& e) {
    std::cout << "no canvases image: " << e.what() << "\n";
    png.clear();
  }
  nlohmann::json summary{{"task", task_name},
                         {"figure", t.figure_name()},
                         {"before", before.figure},
                         {"after", after.figure},
                         {"malformed_before", before.malformed},
                         {"malformed_after", after.malformed},
                         {"vision_tower_calls", tower_calls},
                         {"prompts", prompts_total},
                         {"cache_mismatched_steps", cache_mismatches},
                         {"seconds", seconds},
                         {"sft_seconds", sft_seconds},
                         {"rl_seconds", rl_seconds},
                         {"steps", rl_steps},
                         {"sft_steps", r.steps},
                         {"options", unirl::options::to_json(o)}};
  if (kind == task_kind::agent) summary["malformed_rl_samples"] = malformed_total;
  std::ofstream(std::filesystem::path(out) / "summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);
  std::cout << "wrote " << out << "/summary.json, metrics.jsonl, samples.jsonl, report.html"
            << (png.empty() ? "" : ", canvases.png") << "\n";
  std::cout << "vlm_tasks " << task_name << " done: " << t.figure_name() << " " << std::setprecision(3)
            << before.figure << " -> " << after.figure << "\n";
  if (cache_mismatches > 0) {  // the vision cache failed: some step encoded an image more than once
    std::cerr << "vlm_tasks: " << cache_mismatches << " GRPO step(s) with vision_tower_calls != prompts\n";
    return 2;
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "vlm_tasks: " << e.what() << "\n";
  return 1;
}
