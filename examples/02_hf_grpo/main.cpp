// unirl with a Hugging Face model, end to end, as a user with a checkpoint would run it:
//
//   hf_grpo --out runs/hf_grpo                 # defaults
//   hf_grpo --out runs/x seed=2 steps=300      # any option as key=value
//   hf_grpo --out runs/lora lora_rank=16 lr=3e-3   # GRPO on LoRA adapters (docs/lora.md)
//
// 1. Makes a "pretrained checkpoint" the way a user would have one: a byte-level BPE tokenizer
//    (Qwen's pre-tokenizer, ChatML special tokens) trained on the task's text, and a small
//    Qwen2-architecture decoder (grouped-query attention, q/k/v biases, RoPE, SwiGLU, RMSNorm,
//    tied embeddings) given a short supervised stage on two-number addition in ChatML until its
//    held-out accuracy enters a band; saved as a Hugging Face directory (config.json,
//    model.safetensors, tokenizer.json, tokenizer_config.json) in <out>/base.
// 2. Trains it with GRPO exactly as `unirl-train` would: a recipe (the one written to
//    <out>/recipe.json, runnable as `unirl-train --recipe <out>/recipe.json`) over JSONL prompts
//    that loads <out>/base from disk, scores exact answers, checkpoints, and exports the trained
//    policy back to <out>/rl/export in Hugging Face layout.
// Prints held-out accuracy before and after and writes <out>/summary.json.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/options.hpp>
#include <unirl/models/hf/pretrained.hpp>
#include <unirl/recipes/token_recipe.hpp>
#include <unirl/tokenizers/chat.hpp>
#include <unirl/tokenizers/train.hpp>
#include <unirl/train/report.hpp>
#include <unirl/train/sft.hpp>

#include "common/addition.hpp"

struct hf_grpo_options {
  std::int64_t max_operand = 99;     // operands drawn from [0, max_operand]
  std::int64_t vocab_size = 300;     // BPE vocabulary (256 bytes + merges + 3 special tokens)
  std::int64_t hidden_size = 64;
  std::int64_t layers = 2;
  std::int64_t heads = 4;
  std::int64_t kv_heads = 2;
  std::int64_t heldout = 300;
  double sft_lr = 2e-3;
  std::int64_t sft_batch = 64;
  std::int64_t sft_max_steps = 4000;
  std::int64_t eval_every = 25;
  double band_low = 0.25;            // stop the supervised stage once held-out accuracy is in the band
  double band_high = 0.40;
  std::int64_t steps = 600;          // GRPO steps
  std::int64_t prompts_per_step = 16;
  std::int64_t group_size = 8;
  double lr = 3e-4;
  std::int64_t train_records = 4000;  // JSONL training prompts written for the RL stage
  std::int64_t seed = 0;
  std::int64_t threads = 1;
  std::int64_t lora_rank = 0;        // > 0: GRPO trains rank-r LoRA adapters on every linear layer only
  double lora_alpha = 32.0;          // LoRA scaling alpha / rank
};
BOOST_HANA_ADAPT_STRUCT(hf_grpo_options, max_operand, vocab_size, hidden_size, layers, heads, kv_heads, heldout,
                        sft_lr, sft_batch, sft_max_steps, eval_every, band_low, band_high, steps, prompts_per_step,
                        group_size, lr, train_records, seed, threads, lora_rank, lora_alpha);

namespace {
using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }
namespace tk = unirl::tokenizers;
namespace hf = unirl::models::hf;

struct problem : examples::addition_problem {
  std::string prompt() const { return tk::apply_chat_template(tk::chat_format::chatml, {{"user", question()}}, true); }
};

struct task : examples::addition_task {
  using addition_task::addition_task;
  problem draw_any() { return {addition_task::draw_any()}; }
  problem draw_train() { return {addition_task::draw_train()}; }
};

template <class Problems>
void write_jsonl(const std::filesystem::path& path, const Problems& ps) {
  std::ofstream f(path);
  for (const auto& p : ps) f << nlohmann::json{{"question", p.question()}, {"answer", p.answer()}}.dump() << "\n";
}
}  // namespace

int main(int argc, char** argv) try {
  hf_grpo_options o;
  auto flags = unirl::options::parse_command_line(o, argc, argv, {{"out", "runs/hf_grpo"}, {"help", "false"}});
  if (flags["help"] == "true") {
    std::cout << "usage: hf_grpo [--out DIR] [key=value ...]\n" << unirl::options::to_string(o);
    return 0;
  }
  const std::filesystem::path out = flags["out"];
  std::filesystem::remove_all(out / "rl");  // a fresh RL run each time (the recipe would resume otherwise)
  std::filesystem::create_directories(out);
  torch::set_num_threads(static_cast<int>(std::max<std::int64_t>(1, o.threads)));
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));
  const auto t_start = clock_type::now();
  std::cout << std::fixed << std::setprecision(1);

  // ---- the user's checkpoint: a BPE tokenizer and a Qwen2-architecture model ----------------
  task t(o.max_operand, o.heldout, static_cast<std::uint64_t>(o.seed) * 7919 + 17);
  std::vector<std::string> corpus;
  for (int i = 0; i < 5000; ++i) {
    const auto p = t.draw_any();
    corpus.push_back(p.prompt() + p.answer() + "<|im_end|>\n");
  }
  auto tok = tk::train_bpe(corpus, o.vocab_size, tk::pre_tokenizer_kind::qwen2,
                           {"<|endoftext|>", "<|im_start|>", "<|im_end|>"});
  tok.set_special_tokens("<|im_end|>", "<|endoftext|>");
  const auto eos = *tok.eos_id();
  const problem first{t.heldout()[0]};
  std::cout << "tokenizer: byte-level BPE, " << tok.vocab_size() << " tokens (" << tok.num_merges()
            << " merges); \"" << first.question() << "\" in ChatML is " << tok.encode(first.prompt()).size() << " tokens\n";

  hf::decoder_config cfg;
  cfg.arch = hf::architecture::qwen2;
  cfg.vocab_size = tok.vocab_size();
  cfg.hidden_size = o.hidden_size;
  cfg.intermediate_size = 4 * o.hidden_size;
  cfg.num_hidden_layers = o.layers;
  cfg.num_attention_heads = o.heads;
  cfg.num_key_value_heads = o.kv_heads;
  cfg.max_position_embeddings = 64;
  cfg.rope_theta = 10000.0;
  cfg.tie_word_embeddings = true;
  cfg.eos_token_id = {eos};
  cfg.pad_token_id = tok.pad_id();
  cfg.validate("hf_grpo");
  hf::causal_lm model(cfg);

  std::vector<unirl::data::record> eval_records;
  for (const auto& p : t.heldout()) eval_records.push_back({.prompt = p.question(), .answer = p.answer()});
  unirl::recipes::token_recipe recipe;
  recipe.format = unirl::recipes::prompt_format::chatml;
  recipe.sampling = {.max_new_tokens = 6, .temperature = 1.0};
  auto accuracy = [&](const hf::causal_lm& m) { return unirl::recipes::greedy_accuracy(m, recipe, tok, eval_records); };

  std::cout << "stage 1: supervised, a " << o.layers << "-layer Qwen2 decoder (hidden " << o.hidden_size << ", "
            << o.heads << " heads, " << o.kv_heads << " KV heads) on a+b in ChatML until held-out accuracy is in ["
            << 100 * o.band_low << "%, " << 100 * o.band_high << "%]\n";
  // The library's SFT stage (AdamW, no weight decay, constant lr; cross-entropy on the answer and
  // its end-of-text token), stopped by the evaluation once held-out accuracy reaches the band.
  double acc = 0.0;
  unirl::train::sft_trainer<hf::causal_lm> sft(
      model, {.optim = {.lr = o.sft_lr}, .batch_size = o.sft_batch, .steps = o.sft_max_steps,
              .eval_every = o.eval_every, .progress = false});
  const auto sft_run = sft.run(
      [&](std::int64_t n) {
        std::vector<std::vector<std::int64_t>> prompts, answers;
        for (std::int64_t i = 0; i < n; ++i) {
          const auto p = t.draw_train();
          prompts.push_back(tok.encode(p.prompt()));
          auto a = tok.encode(p.answer());
          a.push_back(eos);
          answers.push_back(std::move(a));
        }
        return unirl::train::make_sft_batch(prompts, answers, tok.pad_id());
      },
      [&](const unirl::train::supervised_stats& s) {
        model.train(false);
        acc = accuracy(model);
        std::cout << "  step " << std::setw(5) << s.step + 1 << "  loss " << std::setprecision(3) << s.loss
                  << "  held-out accuracy " << std::setprecision(1) << 100 * acc << "%\n"
                  << std::flush;
        return acc >= o.band_low;
      });
  const std::int64_t sft_steps = sft_run.steps;
  const double sft_seconds = since(t_start);
  const auto base = out / "base";
  std::filesystem::remove_all(base);
  tok.save(base);
  hf::save_pretrained(model, base, {});
  std::cout << "saved the checkpoint to " << base.string() << " after " << sft_steps << " supervised steps ("
            << sft_seconds << " s)\n";

  // ---- stage 2: GRPO from the saved directory, through the recipe runner ----------------------
  std::vector<problem> train_ps;
  for (std::int64_t i = 0; i < o.train_records; ++i) train_ps.push_back(t.draw_train());
  write_jsonl(out / "train.jsonl", train_ps);
  write_jsonl(out / "heldout.jsonl", t.heldout());
  recipe.model = base.string();
  recipe.data = {.path = (out / "train.jsonl").string(), .prompt_key = "question", .answer_key = "answer",
                 .seed = o.seed};
  recipe.eval_data = (out / "heldout.jsonl").string();
  recipe.eval_records = o.heldout;
  recipe.algorithm = unirl::recipes::algorithm_name::dr_grpo;
  unirl::recipes::apply_preset(recipe);
  recipe.grpo.clip_high = 0.28;
  recipe.grpo.agg = unirl::algo::loss_agg::token_mean;
  recipe.reward.exact_answer = 1.0;
  recipe.reward.format = 0.1;
  recipe.reward.format_options.pattern = R"(\d{1,3})";
  recipe.optim.lr = o.lr;
  recipe.schedule = {.kind = unirl::train::schedule_kind::cosine, .warmup_steps = 10, .min_lr_ratio = 0.1};
  recipe.group_size = o.group_size;
  recipe.prompts_per_step = o.prompts_per_step;
  recipe.steps = o.steps;
  recipe.seed = o.seed;
  recipe.threads = o.threads;
  recipe.out = (out / "rl").string();
  recipe.checkpoint = {.every = 200, .keep = 1, .resume = true};
  recipe.lora.rank = o.lora_rank;  // 0: full fine-tuning; else the export is merged, the adapter in export/adapter
  recipe.lora.alpha = o.lora_alpha;
  std::ofstream(out / "recipe.json") << unirl::options::to_json(recipe).dump(2) << "\n";
  std::cout << "stage 2: GRPO (Dr.GRPO advantages, clip-higher) from " << base.string() << ", "
            << o.prompts_per_step << " prompts x " << o.group_size << " samples, " << o.steps
            << " steps (recipe: " << (out / "recipe.json").string() << ")\n";
  const auto res = unirl::recipes::run(recipe);

  // The export loads back as a user's tool would load it, and gives the accuracy the run reported.
  const auto exported = hf::from_pretrained(res.export_dir);
  const double acc_export = accuracy(exported);
  const double seconds = since(t_start);
  std::cout << "held-out accuracy: " << 100 * res.accuracy_before << "% -> " << 100 * res.accuracy_after << "% after "
            << res.steps << " GRPO steps (" << std::setprecision(0) << res.seconds_rl << " s RL, " << seconds
            << " s total); the export in " << res.export_dir << " scores " << std::setprecision(1) << 100 * acc_export
            << "%\n";
  nlohmann::json summary{{"accuracy_before", res.accuracy_before}, {"accuracy_after", res.accuracy_after},
                         {"accuracy_export", acc_export},          {"steps", res.steps},
                         {"sft_steps", sft_steps},                 {"sft_seconds", sft_seconds},
                         {"rl_seconds", res.seconds_rl},              {"seconds", seconds},
                         {"tokenizer_vocab", tok.vocab_size()},    {"export_dir", res.export_dir},
                         {"options", unirl::options::to_json(o)}};
  std::ofstream(out / "summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);  // the RL stage's own is rl/report.html
  std::cout << "wrote " << (out / "summary.json").string() << ", " << (out / "report.html").string() << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "hf_grpo: " << e.what() << "\n";
  return 1;
}
