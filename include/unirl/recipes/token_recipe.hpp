#pragma once
/// \file token_recipe.hpp
/// A whole RL run of a Hugging Face causal LM from one recipe: model directory, JSONL prompts,
/// algorithm (`grpo`, `dapo`, `dr_grpo`, `rloo`, `reinforce_pp`, `ppo`) and its options, rule rewards by
/// name with weights or a remote reward service, optimizer and schedule, steps, checkpoints with
/// resume, held-out evaluation and export back to a Hugging Face directory. `unirl-train` is
/// this function behind a command line; it composes the library's own pieces (`unirl::trainer`,
/// `models::hf::causal_lm`, `tokenizers::bpe_tokenizer`, `data::jsonl_dataset`,
/// `rewards::weighted`), so a recipe run is the same code path as a trainer written by hand.
///
/// ```cpp
/// unirl::recipes::token_recipe r;
/// unirl::recipes::load(r, "recipe.yaml", {"steps=50", "algorithm=dapo"});
/// auto result = unirl::recipes::run(r);     // result.accuracy_before / accuracy_after, result.steps
/// ```
///
/// The algorithm name is a preset of the GRPO options (see `apply_preset`), applied before the
/// recipe's own `grpo` values, so anything the recipe states wins.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/algorithms/ppo_token.hpp>
#include <unirl/core/options.hpp>
#include <unirl/data/jsonl.hpp>
#include <unirl/models/hf/pretrained.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/tokenizers/bpe.hpp>
#include <unirl/tokenizers/chat.hpp>
#include <unirl/train/report.hpp>
#include <unirl/train/run_directory.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/trainer.hpp>

namespace unirl::recipes {

/// The algorithm of a recipe: GRPO presets, or PPO with a critic on the same backbone.
enum class algorithm_name { grpo, dapo, dr_grpo, rloo, reinforce_pp, ppo };

/// How prompts become text for the model.
enum class prompt_format { automatic, chatml, llama3, plain, none };

}  // namespace unirl::recipes

template <>
inline constexpr std::array unirl::enum_names<unirl::recipes::algorithm_name>{
    std::string_view{"grpo"}, std::string_view{"dapo"}, std::string_view{"dr_grpo"},
    std::string_view{"rloo"}, std::string_view{"reinforce_pp"}, std::string_view{"ppo"}};
template <>
inline constexpr std::array unirl::enum_names<unirl::recipes::prompt_format>{
    std::string_view{"auto"}, std::string_view{"chatml"}, std::string_view{"llama3"}, std::string_view{"plain"},
    std::string_view{"none"}};

namespace unirl::recipes {

/// The rule rewards by name, each with a weight (0 = off; negative = a penalty), and an optional
/// remote reward service.
struct reward_recipe {
  double exact_answer = 1.0;              // weight of the exact-answer reward
  rewards::exact_answer_options answer{};  // how the answer is extracted and compared
  double format = 0.0;                    // weight of the format reward
  rewards::regex_format_options format_options{};
  double remote = 0.0;                    // weight of the remote reward service (needs remote_options.url)
  rewards::remote_options remote_options{};

  void validate(const std::string& p) const {
    options::require(std::isfinite(exact_answer) && std::isfinite(format) && std::isfinite(remote), p + "exact_answer",
                     exact_answer, "finite weights");
    options::require(exact_answer != 0.0 || format != 0.0 || remote != 0.0, p + "exact_answer", exact_answer,
                     "at least one non-zero reward weight (exact_answer, format or remote)");
  }
};

/// Checkpoints of a run directory.
struct checkpoint_recipe {
  std::int64_t every = 0;   // steps between checkpoints; 0 = only at the end
  std::int64_t keep = 2;    // complete checkpoints kept (older ones deleted)
  bool resume = true;       // continue from the latest complete checkpoint of `out` when there is one

  void validate(const std::string& p) const {
    options::require(every >= 0, p + "every", every, ">= 0");
    options::require(keep >= 1, p + "keep", keep, ">= 1");
  }
};

/// The supervised stage before RL (off with steps = 0): cross-entropy on the answers of a JSONL
/// file (prompt as the RL stage formats it, then the answer and the end-of-sequence token),
/// through `train::sft_trainer`; its checkpoints are `<out>/sft/checkpoints/` (a finished stage
/// loads instead of training), its metrics `<out>/sft_metrics.jsonl`.
struct sft_recipe {
  std::int64_t steps = 0;                    // optimizer steps; 0: no supervised stage
  std::string data{};                        // JSONL with prompt and answer (same keys as `data`); empty: `data`'s file
  std::int64_t batch_size = 8;               // sequences per step
  train::optimizer_options optim{.lr = 1e-5};
  train::schedule_options schedule{};
  train::clip_options clip{};
  train::sft_layout layout = train::sft_layout::padded;  // padded, or packed (sequence packing)

  void validate(const std::string& p) const {
    options::require(steps >= 0, p + "steps", steps, ">= 0 (0: no supervised stage)");
    options::require(batch_size >= 1, p + "batch_size", batch_size, ">= 1");
  }
};

/// A recipe (the file `unirl-train --recipe` reads; every key may be overridden as key=value).
struct token_recipe {
  std::string model{};                       // Hugging Face directory: config.json, *.safetensors, tokenizer
  data::jsonl_options data{};                // training prompts
  std::string eval_data{};                   // optional JSONL of held-out prompts (same keys): greedy accuracy
  std::int64_t eval_records = 200;           // at most this many held-out records
  prompt_format format = prompt_format::automatic;  // auto: ChatML when the tokenizer has <|im_start|>, else plain
  std::string system_prompt{};               // a system message for chat formats (empty: none)
  std::string prompt_suffix{};               // appended to a text prompt (e.g. "=" or " Answer:")
  sft_recipe sft{};                          // supervised stage before RL (steps = 0: none)
  algorithm_name algorithm = algorithm_name::grpo;
  algo::grpo_options grpo{};                 // the GRPO family's options (after the preset)
  algo::ppo<>::for_track<token_track>::options ppo{};  // PPO's options (track.sampling: from `sampling`)
  sampling_options sampling{.max_new_tokens = 32, .temperature = 1.0};  // stop: the tokenizer's eos
  std::vector<std::string> stop{};           // extra stop tokens, as text of single tokens
  reward_recipe reward{};
  train::optimizer_options optim{.lr = 1e-5};
  train::schedule_options schedule{};
  train::clip_options clip{};
  train::memory_options memory{};            // activation checkpointing, reference placement, log-prob chunks
  lora::options lora{};                      // LoRA adapters (rank > 0): only they train; export merged + adapter/
  ::unirl::precision precision = ::unirl::precision::fp32;  // fp32, bf16, fp16 (autocast; float32 master weights)
  train::loss_scale_options loss_scale{};    // dynamic loss scaling (fp16; loss_scale.mode=on for any precision)
  std::int64_t group_size = 8;
  std::int64_t prompts_per_step = 8;
  std::int64_t steps = 100;
  std::int64_t epochs = 1;
  std::int64_t minibatches = 1;
  std::int64_t micro_batch_size = 0;         // gradient accumulation: samples per forward/backward; 0: whole minibatch
  std::int64_t seed = 0;
  std::int64_t threads = 0;                  // LibTorch intra-op threads; 0 = LibTorch's default
  std::string device = "cpu";
  std::string out = "runs/unirl-train";      // metrics.jsonl, checkpoints/, summary.json, export/
  checkpoint_recipe checkpoint{};
  std::string export_dir{};                  // empty: <out>/export; "none": no export
  bool progress = true;

  void validate(const std::string& p) const {
    options::require(!model.empty(), p + "model", model, "a Hugging Face model directory");
    options::require(group_size >= 1, p + "group_size", group_size, ">= 1");
    options::require(prompts_per_step >= 1, p + "prompts_per_step", prompts_per_step, ">= 1");
    options::require(steps >= 0, p + "steps", steps, ">= 0");
    options::require(eval_records >= 0, p + "eval_records", eval_records, ">= 0");
    options::require(threads >= 0, p + "threads", threads, ">= 0");
    options::require(!out.empty(), p + "out", out, "a run directory");
    // The samplers take the top-level `sampling`; a value under grpo / ppo would be ignored.
    const auto unset = options::to_json(sampling_options{});
    if (options::to_json(grpo.sampling) != unset)
      throw config_error(p + "grpo.sampling", "is set, but a recipe's sampling options live at the top level: use "
                                              "sampling.* (e.g. sampling.max_new_tokens)");
    if (options::to_json(ppo.track.sampling) != unset)
      throw config_error(p + "ppo.track.sampling", "is set, but a recipe's sampling options live at the top level: "
                                                   "use sampling.* (e.g. sampling.max_new_tokens)");
  }
};

}  // namespace unirl::recipes

BOOST_HANA_ADAPT_STRUCT(unirl::recipes::reward_recipe, exact_answer, answer, format, format_options, remote,
                        remote_options);
BOOST_HANA_ADAPT_STRUCT(unirl::recipes::checkpoint_recipe, every, keep, resume);
BOOST_HANA_ADAPT_STRUCT(unirl::recipes::sft_recipe, steps, data, batch_size, optim, schedule, clip, layout);
BOOST_HANA_ADAPT_STRUCT(unirl::recipes::token_recipe, model, data, eval_data, eval_records, format, system_prompt,
                        prompt_suffix, sft, algorithm, grpo, ppo, sampling, stop, reward, optim, schedule, clip, memory, lora,
                        precision, loss_scale, group_size, prompts_per_step, steps, epochs, minibatches,
                        micro_batch_size, seed, threads, device, out, checkpoint, export_dir, progress);

namespace unirl::recipes {

/// The GRPO options an algorithm name stands for (the recipe's own `grpo` values come after):
/// - `grpo`: group-normalised advantages, sequence-mean token-mean loss (DeepSeekMath);
/// - `dapo`: clip-higher 0.28, token-mean loss, dynamic sampling (DAPO, arXiv 2503.14476);
/// - `dr_grpo`: advantages not divided by the group's std, sequence-mean token-sum-norm loss (Dr.GRPO);
/// - `rloo`: leave-one-out baseline; `reinforce_pp`: REINFORCE++ returns; `ppo`: nothing here.
inline void apply_preset(token_recipe& r) {
  auto& g = r.grpo;
  switch (r.algorithm) {
    case algorithm_name::grpo: g.advantage = algo::advantage_kind::group; break;
    case algorithm_name::dapo:
      g.advantage = algo::advantage_kind::group;
      g.clip_high = 0.28;
      g.agg = algo::loss_agg::token_mean;
      g.dynamic_sampling = true;
      break;
    case algorithm_name::dr_grpo:
      g.advantage = algo::advantage_kind::dr_grpo;
      g.agg = algo::loss_agg::seq_mean_token_sum_norm;
      break;
    case algorithm_name::rloo: g.advantage = algo::advantage_kind::rloo; break;
    case algorithm_name::reinforce_pp: g.advantage = algo::advantage_kind::reinforce_pp; break;
    case algorithm_name::ppo: break;
  }
}

/// Fills `r` from a recipe file (JSON, or YAML when built with yaml-cpp; empty path: none) and
/// `key=value` overrides: the algorithm is read first, its preset applied, then the recipe and the
/// overrides (so explicit values win), then everything is validated.
inline void load(token_recipe& r, const std::string& path, const std::vector<std::string>& overrides) {
  const auto file = path.empty() ? nlohmann::json::object() : options::read_recipe(path);
  auto read = [&](token_recipe& into) {
    ::unirl::options::from_json(into, file);
    for (const auto& a : overrides) {
      const auto eq = a.find('=');
      if (eq == std::string::npos || eq == 0) throw config_error(a, "expected an override of the form key=value");
      options::set(into, a.substr(0, eq), a.substr(eq + 1));
    }
  };
  token_recipe probe;
  read(probe);  // an error here is the same error the real pass would give
  r.algorithm = probe.algorithm;
  apply_preset(r);
  read(r);
  options::validate(r);
}

/// What a run reports.
struct run_result {
  double accuracy_before = -1.0, accuracy_after = -1.0;  // greedy held-out accuracy (-1: no eval_data)
  double accuracy_after_sft = -1.0;                       // ... after the supervised stage (-1: none)
  std::int64_t sft_steps = 0;                             // supervised steps done by this process
  std::int64_t steps = 0;                                 // steps done by this process
  std::int64_t first_step = 0;                            // 0, or the step a resumed run continued from
  double reward_first = 0.0, reward_last = 0.0;           // mean reward of the first and last step run
  double seconds = 0.0;
  std::string export_dir{};
};

namespace detail {

inline tokenizers::chat_format chat_format_of(prompt_format f, const tokenizers::bpe_tokenizer& tok) {
  switch (f) {
    case prompt_format::chatml: return tokenizers::chat_format::chatml;
    case prompt_format::llama3: return tokenizers::chat_format::llama3;
    case prompt_format::plain: return tokenizers::chat_format::plain;
    default: break;
  }
  if (tok.token_to_id("<|im_start|>")) return tokenizers::chat_format::chatml;
  if (tok.token_to_id("<|start_header_id|>")) return tokenizers::chat_format::llama3;
  return tokenizers::chat_format::plain;
}

// The prompt text the model sees for one record.
inline std::string prompt_text(const token_recipe& r, const tokenizers::bpe_tokenizer& tok, const data::record& rec) {
  if (r.format == prompt_format::none) {
    UNIRL_CHECK(rec.messages.empty(), "recipe: format = none but line ", rec.line,
                " gives the prompt as chat messages; choose a chat format");
    return rec.prompt + r.prompt_suffix;
  }
  std::vector<tokenizers::chat_message> msgs;
  if (!r.system_prompt.empty()) msgs.push_back({"system", r.system_prompt});
  if (rec.messages.empty()) msgs.push_back({"user", rec.prompt + r.prompt_suffix});
  for (const auto& m : rec.messages) msgs.push_back({m.role, m.content});
  return tokenizers::apply_chat_template(chat_format_of(r.format, tok), msgs, /*add_generation_prompt=*/true);
}

// A scorer for the remote service that is off (zeros) when no URL is configured.
struct optional_remote {
  static constexpr std::string_view name = "remote";
  std::optional<rewards::remote_scorer> scorer;
  template <class B>
  torch::Tensor operator()(const B& b) {
    if (!scorer) return torch::zeros({b.size()}, torch::kFloat);
    return (*scorer)(b);
  }
};

using reward_type = rewards::weighted<rewards::exact_answer, rewards::regex_format, optional_remote>;

inline reward_type make_reward(const reward_recipe& r) {
  optional_remote remote;
  if (r.remote != 0.0) remote.scorer.emplace(r.remote_options);
  return reward_type{{.weights = {r.exact_answer, r.format, r.remote}},
                     rewards::exact_answer{r.answer},
                     rewards::regex_format{r.format_options},
                     std::move(remote)};
}

}  // namespace detail

/// Greedy accuracy of `model` on `records` under the recipe's prompt format and answer reward
/// (a sample is right when the exact-answer scorer gives it its `correct` value).
template <CausalLM M>
double greedy_accuracy(const M& model, const token_recipe& r, const tokenizers::bpe_tokenizer& tok,
                       const std::vector<data::record>& records, std::int64_t batch = 64) {
  if (records.empty()) return -1.0;
  torch::NoGradGuard ng;
  rewards::exact_answer judge{r.reward.answer};
  std::int64_t right = 0;
  auto s = r.sampling;
  s.top_k = 1;
  s.temperature = 1.0;
  if (const auto eos = tok.eos_id()) s.stop_tokens.push_back(*eos);
  for (const auto& t : r.stop)
    if (const auto id = tok.token_to_id(t)) s.stop_tokens.push_back(*id);
  for (std::size_t start = 0; start < records.size(); start += static_cast<std::size_t>(batch)) {
    const auto end = std::min(records.size(), start + static_cast<std::size_t>(batch));
    prompt_batch in{.decode = tok.decoder(), .pad_id = tok.pad_id()};
    for (std::size_t i = start; i < end; ++i) {
      const auto text = detail::prompt_text(r, tok, records[i]);
      in.tokens.push_back(tok.encode(text));
      in.texts.push_back(text);
      in.references.push_back(records[i].answer);
    }
    const auto b = sample_tokens(model, in, 1, s);
    const auto scores = judge(b);
    right += (scores == static_cast<float>(r.reward.answer.correct)).sum().template item<std::int64_t>();
  }
  return static_cast<double>(right) / static_cast<double>(records.size());
}

namespace detail {

template <class Algorithm>
typename Algorithm::options algorithm_options(const token_recipe& r, const sampling_options& s) {
  if constexpr (std::is_same_v<typename Algorithm::options, algo::grpo_options>) {
    auto o = r.grpo;
    o.sampling = s;
    return o;
  } else {
    auto o = r.ppo;
    o.track.sampling = s;
    return o;
  }
}

// The supervised stage of a recipe (`sft_recipe`) on `model`; returns the steps it ran.
inline std::int64_t run_sft(const token_recipe& r, const tokenizers::bpe_tokenizer& tok, models::hf::causal_lm& model,
                            const std::filesystem::path& out) {
  auto dopts = r.data;
  if (!r.sft.data.empty()) dopts.path = r.sft.data;
  data::jsonl_dataset records(dopts);
  const auto eos = tok.eos_id();
  train::sft_trainer<models::hf::causal_lm> stage(
      model, {.objective = {.layout = r.sft.layout},
              .optim = r.sft.optim,
              .schedule = r.sft.schedule,
              .clip = r.sft.clip,
              .batch_size = r.sft.batch_size,
              .steps = r.sft.steps,
              .seed = r.seed,
              .device = r.device,
              .metrics_path = (out / "sft_metrics.jsonl").string(),
              .progress = r.progress,
              .out = (out / "sft").string(),
              .checkpoint_every = r.checkpoint.every,
              .keep = r.checkpoint.keep,
              .resume = r.checkpoint.resume});
  const auto res = stage.run(
      [&](std::int64_t n) {
        std::vector<std::vector<std::int64_t>> prompts, answers;
        for (const auto& rec : records.next(n)) {
          UNIRL_CHECK(!rec.answer.empty(), "recipe: sft: line ", rec.line, " of '", dopts.path,
                      "' has no answer: the supervised stage needs one per record");
          prompts.push_back(tok.encode(prompt_text(r, tok, rec)));
          answers.push_back(tok.encode(rec.answer));
          if (eos) answers.back().push_back(*eos);
        }
        return train::make_sft_batch(prompts, answers, tok.pad_id());
      },
      nullptr, records);
  if (res.resumed) std::cout << "sft: resumed at step " << res.first_step << "\n";
  return res.steps;
}

template <class Algorithm>
run_result run_with(const token_recipe& r) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const std::filesystem::path out(r.out);
  std::filesystem::create_directories(out / "checkpoints");
  if (r.threads > 0) torch::set_num_threads(static_cast<int>(r.threads));
  torch::manual_seed(static_cast<std::uint64_t>(r.seed));

  auto tok = tokenizers::bpe_tokenizer::from_dir(r.model);
  auto model = models::hf::from_pretrained(r.model, {.dtype = models::hf::weight_dtype::float32, .device = r.device});
  if (r.lora.rank > 0) lora::apply(model, r.lora);
  auto s = r.sampling;
  if (const auto eos = tok.eos_id()) s.stop_tokens.push_back(*eos);
  for (const auto& t : r.stop) {
    const auto id = tok.token_to_id(t);
    UNIRL_CHECK(id.has_value(), "recipe: stop = \"", t, "\" is not a single token of the tokenizer");
    s.stop_tokens.push_back(*id);
  }
  std::vector<data::record> eval;
  if (!r.eval_data.empty()) {
    auto eo = r.data;
    eo.path = r.eval_data;
    eo.max_records = r.eval_records;
    eval = data::read_jsonl(eo);
  }
  data::jsonl_dataset train_data(r.data);

  using trainer_t = trainer<models::hf::causal_lm, Algorithm, reward_type>;
  typename trainer_t::options topts{};
  topts.algorithm = algorithm_options<Algorithm>(r, s);
  topts.optim = r.optim;
  topts.schedule = r.schedule;
  topts.clip = r.clip;
  topts.memory = r.memory;
  topts.group_size = r.group_size;
  topts.epochs = r.epochs;
  topts.minibatches = r.minibatches;
  topts.micro_batch_size = r.micro_batch_size;
  topts.precision = r.precision;
  topts.loss_scale = r.loss_scale;
  topts.seed = r.seed;
  topts.device = r.device;
  topts.metrics_path = (out / "metrics.jsonl").string();
  topts.samples_path = (out / "samples.jsonl").string();
  topts.progress = r.progress;
  topts.total_steps = r.steps;
  run_result res;
  model.train(false);
  res.accuracy_before = greedy_accuracy(model, r, tok, eval);
  if (r.sft.steps > 0) {
    res.sft_steps = run_sft(r, tok, model, out);
    model.train(false);
    res.accuracy_after_sft = greedy_accuracy(model, r, tok, eval);
  }
  trainer_t t{std::move(model), make_reward(r.reward), topts};

  // <out>/checkpoints/step-<n>.pt: the latest complete one resumes (a damaged newer one is skipped
  // with a warning), the newest `keep` are kept.
  const train::run_directory run_dir(out, {.keep = r.checkpoint.keep});
  if (r.checkpoint.resume) {
    run_dir.remove_temporaries();
    if (const auto last = run_dir.latest()) {
      t.load(last->path.string(), train_data);
      res.first_step = t.step_count();
      std::cout << "resumed from " << last->path.filename().string() << " at step " << res.first_step << "\n";
    }
  }
  auto save = [&] { run_dir.save(t.step_count(), [&](const std::string& path) { t.save(path, train_data); }); };
  for (std::int64_t step = t.step_count(); step < r.steps; ++step) {
    prompt_batch in{.decode = tok.decoder(), .pad_id = tok.pad_id()};
    for (const auto& rec : train_data.next(r.prompts_per_step)) {
      const auto text = prompt_text(r, tok, rec);
      in.tokens.push_back(tok.encode(text));
      in.texts.push_back(text);
      in.references.push_back(rec.answer);
    }
    const auto st = t.step(in);
    if (res.steps == 0) res.reward_first = st.reward_mean;
    res.reward_last = st.reward_mean;
    ++res.steps;
    if (r.checkpoint.every > 0 && t.step_count() % r.checkpoint.every == 0) save();
  }
  if (r.progress) std::cerr << "\n";
  if (res.steps > 0 && (r.checkpoint.every == 0 || t.step_count() % r.checkpoint.every != 0)) save();
  auto& policy = t.models().policy;
  policy.train(false);
  res.accuracy_after = greedy_accuracy(policy, r, tok, eval);
  if (r.export_dir != "none") {
    res.export_dir = r.export_dir.empty() ? (out / "export").string() : r.export_dir;
    models::hf::save_pretrained(policy, res.export_dir, {.copy_tokenizer_from = r.model});  // LoRA: merged
    if (r.lora.rank > 0)  // the adapter alone, in PEFT's layout
      lora::save_adapter(policy, std::filesystem::path(res.export_dir) / "adapter", {.base_model_name_or_path = r.model});
  }
  res.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  nlohmann::json summary{{"accuracy_before", res.accuracy_before}, {"accuracy_after", res.accuracy_after},
                         {"sft_steps", res.sft_steps},             {"accuracy_after_sft", res.accuracy_after_sft},
                         {"steps", res.steps},                     {"first_step", res.first_step},
                         {"reward_first", res.reward_first},       {"reward_last", res.reward_last},
                         {"seconds", res.seconds},                 {"export_dir", res.export_dir},
                         {"recipe", options::to_json(r)}};
  std::ofstream(out / "summary.json") << summary.dump(2) << "\n";
  train::write_report(out);
  return res;
}

}  // namespace detail

/// Runs a recipe end to end (see the file comment); writes metrics.jsonl, samples.jsonl,
/// checkpoints/, summary.json, report.html and the export under `r.out`.
inline run_result run(const token_recipe& r) {
  options::validate(r);
  if (r.algorithm == algorithm_name::ppo) return detail::run_with<algo::ppo<>::for_track<token_track>>(r);
  return detail::run_with<algo::grpo<>>(r);
}

}  // namespace unirl::recipes
