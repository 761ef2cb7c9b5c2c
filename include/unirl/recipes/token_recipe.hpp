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
///
/// With `environment.name` set the run is a multi-turn agent's (`environment_recipe`,
/// `preflight_agent`): episodes of a built-in text environment with the built-in `tools`
/// (agents/builtin.hpp) on the rollout engine, trained by `agents::episode_grpo` or
/// `agents::episode_ppo`.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/agents/builtin.hpp>
#include <unirl/agents/demonstration.hpp>
#include <unirl/agents/episode_grpo.hpp>
#include <unirl/agents/episode_ppo.hpp>
#include <unirl/agents/rollout.hpp>
#include <unirl/algorithms/grpo.hpp>
#include <unirl/algorithms/ppo.hpp>
#include <unirl/algorithms/ppo_token.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/signals.hpp>
#include <unirl/data/jsonl.hpp>
#include <unirl/models/hf/pretrained.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/recipes/common.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/tokenizers/bpe.hpp>
#include <unirl/tokenizers/chat.hpp>
#include <unirl/train/model_set_builder.hpp>
#include <unirl/train/report.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/run_directory.hpp>
#include <unirl/train/schedule.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/trainer.hpp>

namespace unirl::recipes {

/// The algorithm of a recipe: GRPO presets, or PPO with a critic on the same backbone.
enum class algorithm_name { grpo, dapo, dr_grpo, rloo, reinforce_pp, ppo };

/// How prompts become text for the model.
enum class prompt_format { automatic, chatml, llama3, plain, none };

/// What pre-flight does with a record too long for the model's context: stop with an error
/// naming it, leave it out (counted), or keep its last tokens (counted).
enum class overlong_policy { error, drop, truncate };

/// The dtype the model's weights are loaded in: the checkpoint's `torch_dtype`, or a given one.
enum class model_dtype { automatic, float32, bfloat16 };

}  // namespace unirl::recipes

template <>
inline constexpr std::array unirl::enum_names<unirl::recipes::algorithm_name>{
    std::string_view{"grpo"}, std::string_view{"dapo"}, std::string_view{"dr_grpo"},
    std::string_view{"rloo"}, std::string_view{"reinforce_pp"}, std::string_view{"ppo"}};
template <>
inline constexpr std::array unirl::enum_names<unirl::recipes::prompt_format>{
    std::string_view{"auto"}, std::string_view{"chatml"}, std::string_view{"llama3"}, std::string_view{"plain"},
    std::string_view{"none"}};
template <>
inline constexpr std::array unirl::enum_names<unirl::recipes::overlong_policy>{
    std::string_view{"error"}, std::string_view{"drop"}, std::string_view{"truncate"}};
template <>
inline constexpr std::array unirl::enum_names<unirl::recipes::model_dtype>{
    std::string_view{"auto"}, std::string_view{"float32"}, std::string_view{"bfloat16"}};

namespace unirl::recipes {

/// The rule rewards by name, each with a weight (0 = off; negative = a penalty), and an optional
/// remote reward service.
struct reward_recipe {
  double exact_answer = 1.0;
  rewards::exact_answer_options answer{};
  double format = 0.0;
  rewards::regex_format_options format_options{};
  double remote = 0.0;
  rewards::remote_options remote_options{};

  void validate(const std::string& p) const {
    options::require(std::isfinite(exact_answer) && std::isfinite(format) && std::isfinite(remote), p + "exact_answer",
                     exact_answer, "finite weights");
    options::require(exact_answer != 0.0 || format != 0.0 || remote != 0.0, p + "exact_answer", exact_answer,
                     "at least one non-zero reward weight (exact_answer, format or remote)");
  }
};

/// The supervised stage before RL (off with steps = 0): cross-entropy on the answers of a JSONL
/// file (prompt as the RL stage formats it, then the answer and the end-of-sequence token),
/// through `train::sft_trainer`; its checkpoints are `<out>/sft/checkpoints/` (a finished stage
/// loads instead of training), its metrics `<out>/sft_metrics.jsonl`.
struct sft_recipe {
  std::int64_t steps = 0;
  std::string data{};
  std::int64_t batch_size = 8;
  train::optimizer_options optim{.lr = 1e-5};
  train::schedule_options schedule{};
  train::clip_options clip{};
  train::sft_layout layout = train::sft_layout::padded;

  void validate(const std::string& p) const {
    options::require(steps >= 0, p + "steps", steps, ">= 0 (0: no supervised stage)");
    options::require(batch_size >= 1, p + "batch_size", batch_size, ">= 1");
  }
};

/// A multi-turn agent run (`environment.name` set, docs/agents.md): episodes of a built-in text
/// environment (`agents::builtin_environments`) with the built-in tools the recipe's `tools` names,
/// trained by GRPO over episodes (the grpo-family algorithms: groups of `group_size` episodes of
/// one task, `prompts_per_step` tasks a step) or PPO over episodes (`algorithm = ppo`).
struct environment_recipe {
  std::string name{};                     // a built-in text environment; empty: prompts from `data`
  std::int64_t max_turns = 4;             // policy turns per episode
  std::int64_t max_turn_tokens = 64;      // tokens per policy turn
  std::int64_t max_episode_tokens = 512;  // tokens per episode (prompt, turns and replies)
  bool stop_at_tool_call = false;         // a turn also ends at </tool_call>
  std::int64_t heldout = 0;               // held-out tasks: greedy mean return before / after RL (0: none)
  agents::toolbox_options tool_options{};

  void validate(const std::string& p) const {
    if (!name.empty()) agents::check_builtin_environment(name, p + "name");
    options::require(max_turns >= 1, p + "max_turns", max_turns, ">= 1");
    options::require(max_turn_tokens >= 1, p + "max_turn_tokens", max_turn_tokens, ">= 1");
    options::require(max_episode_tokens >= 2, p + "max_episode_tokens", max_episode_tokens, ">= 2");
    options::require(heldout >= 0, p + "heldout", heldout, ">= 0");
  }
};

/// A recipe (the file `unirl-train --recipe` reads; every key may be overridden as key=value).
/// Each key's description is in `field_docs<token_recipe>` below (`unirl-train --help`).
struct token_recipe {
  std::string model{};
  model_dtype dtype = model_dtype::float32;
  data::jsonl_options data{};
  std::string eval_data{};
  std::int64_t eval_records = 200;
  overlong_policy overlong = overlong_policy::error;
  prompt_format format = prompt_format::automatic;
  std::string system_prompt{};
  std::string prompt_suffix{};
  sft_recipe sft{};
  algorithm_name algorithm = algorithm_name::grpo;
  algo::grpo_options grpo{};
  algo::ppo<>::for_track<token_track>::options ppo{};
  sampling_options sampling{.max_new_tokens = 32, .temperature = 1.0};
  std::vector<std::string> stop{};
  reward_recipe reward{};
  std::vector<std::string> tools{};
  environment_recipe environment{};
  train::optimizer_options optim{.lr = 1e-5};
  train::schedule_options schedule{};
  train::clip_options clip{};
  train::memory_options memory{};
  lora::options lora{};
  ::unirl::precision precision = ::unirl::precision::fp32;
  train::loss_scale_options loss_scale{};
  std::int64_t group_size = 8;
  std::int64_t prompts_per_step = 8;
  std::int64_t steps = 100;
  std::int64_t epochs = 1;
  std::int64_t minibatches = 1;
  std::int64_t micro_batch_size = 0;
  std::int64_t seed = 0;
  std::int64_t threads = 0;
  std::string device = "cpu";
  std::string out = "runs/unirl-train";
  checkpoint_recipe checkpoint{};
  std::string export_dir{};
  bool progress = true;

  void validate(const std::string& p) const {
    options::require(!model.empty(), p + "model", model, "a Hugging Face model directory");
    options::require(group_size >= 1, p + "group_size", group_size, ">= 1");
    options::require(prompts_per_step >= 1, p + "prompts_per_step", prompts_per_step, ">= 1");
    options::require(steps >= 0, p + "steps", steps, ">= 0");
    options::require(eval_records >= 0, p + "eval_records", eval_records, ">= 0");
    options::require(threads >= 0, p + "threads", threads, ">= 0");
    options::require(!out.empty(), p + "out", out, "a run directory");
    agents::check_builtin_tools(tools, p + "tools");
    if (!tools.empty() && environment.name.empty())
      throw config_error(p + "tools", "names tools, but no environment.name is set: tools are called in multi-turn "
                                      "episodes of a built-in environment (" +
                                          agents::detail::listed(agents::builtin_environment_names()) + ")");
    // The samplers take the top-level `sampling`; a value under grpo / ppo would be ignored
    // (`field_docs<token_recipe>` hides these keys from --help).
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
BOOST_HANA_ADAPT_STRUCT(unirl::recipes::sft_recipe, steps, data, batch_size, optim, schedule, clip, layout);
BOOST_HANA_ADAPT_STRUCT(unirl::recipes::environment_recipe, name, max_turns, max_turn_tokens, max_episode_tokens,
                        stop_at_tool_call, heldout, tool_options);
BOOST_HANA_ADAPT_STRUCT(unirl::recipes::token_recipe, model, dtype, data, eval_data, eval_records, overlong, format,
                        system_prompt, prompt_suffix, sft, algorithm, grpo, ppo, sampling, stop, reward, tools, environment, optim, schedule, clip, memory, lora,
                        precision, loss_scale, group_size, prompts_per_step, steps, epochs, minibatches,
                        micro_batch_size, seed, threads, device, out, checkpoint, export_dir, progress);

template <>
inline constexpr std::array unirl::options::field_docs<unirl::recipes::reward_recipe>{
    unirl::options::field_doc{"exact_answer", "weight of the exact-answer reward (0 = off; negative = a penalty)"},
    unirl::options::field_doc{"format", "weight of the format (regex) reward"},
    unirl::options::field_doc{"remote", "weight of the remote reward service (needs remote_options.url)"}};
template <>
inline constexpr std::array unirl::options::field_docs<unirl::recipes::sft_recipe>{
    unirl::options::field_doc{"steps", "optimizer steps of the supervised stage before RL; 0 = no supervised stage"},
    unirl::options::field_doc{"data", "JSONL with prompt and answer (the keys of `data`; empty = `data.path`); a multi-turn run: one {\"messages\": [...]} conversation per line"},
    unirl::options::field_doc{"batch_size", "sequences per supervised step"},
    unirl::options::field_doc{"layout", "padded rows, or packed (sequence packing)"}};
template <>
inline constexpr std::array unirl::options::field_docs<unirl::recipes::environment_recipe>{
    unirl::options::field_doc{"name", "a built-in text environment (arithmetic): a multi-turn agent run; empty = prompts from data"},
    unirl::options::field_doc{"max_turns", "policy turns per episode"},
    unirl::options::field_doc{"max_turn_tokens", "tokens per policy turn"},
    unirl::options::field_doc{"max_episode_tokens", "tokens per episode (prompt, turns, tool replies, observations)"},
    unirl::options::field_doc{"stop_at_tool_call", "a turn also ends at </tool_call> (one call per turn)"},
    unirl::options::field_doc{"heldout", "held-out tasks: greedy mean return before and after RL (0 = none)"},
    unirl::options::field_doc{"tool_options", "the tools' time limit, worker threads and size limits"}};
template <>
inline constexpr std::array unirl::options::field_docs<unirl::recipes::token_recipe>{
    unirl::options::field_doc{"model", "Hugging Face model directory: config.json, *.safetensors, tokenizer files"},
    unirl::options::field_doc{"dtype", "weights' dtype on load: auto = the checkpoint's torch_dtype (float32 master weights need float32)"},
    unirl::options::field_doc{"eval_data", "JSONL of held-out prompts (the keys of `data`): greedy accuracy before and after"},
    unirl::options::field_doc{"eval_records", "at most this many held-out records (0 = all)"},
    unirl::options::field_doc{"overlong", "a record whose prompt (+ sampling.max_new_tokens) exceeds the context: error, drop or truncate (keep its last tokens)"},
    unirl::options::field_doc{"format", "prompt format; auto = the one the model's export recorded, else ChatML / Llama 3 by the tokenizer's tokens, else plain"},
    unirl::options::field_doc{"system_prompt", "a system message for the chat formats (empty = none)"},
    unirl::options::field_doc{"prompt_suffix", "text appended to each prompt (e.g. \"=\" or \" Answer:\")"},
    unirl::options::field_doc{"algorithm", "the RL algorithm: a preset of the grpo.* options, or PPO with a critic"},
    unirl::options::field_doc{"stop", "extra stop tokens, each the text of one token (the tokenizer's eos always stops)"},
    unirl::options::field_doc{"tools", "built-in tools the agent may call in a multi-turn run (calculator); needs environment.name"},
    unirl::options::field_doc{"precision", "autocast precision of forward / backward (float32 master weights)"},
    unirl::options::field_doc{"group_size", "completions sampled per prompt"},
    unirl::options::field_doc{"prompts_per_step", "prompts per RL step"},
    unirl::options::field_doc{"steps", "RL steps (a resumed run continues to this count)"},
    unirl::options::field_doc{"epochs", "update epochs over each step's rollouts"},
    unirl::options::field_doc{"minibatches", "minibatches per update epoch"},
    unirl::options::field_doc{"micro_batch_size", "gradient accumulation: samples per forward / backward; 0 = the whole minibatch"},
    unirl::options::field_doc{"seed", "seed of LibTorch's generators"},
    unirl::options::field_doc{"threads", "LibTorch intra-op threads; 0 = LibTorch's default"},
    unirl::options::field_doc{"device", "cpu, cuda or cuda:N (checked before any work)"},
    unirl::options::field_doc{"out", "run directory: metrics.jsonl, checkpoints/, summary.json, export/"},
    unirl::options::field_doc{"export_dir", "where the trained model is written; empty = <out>/export; none = no export"},
    unirl::options::field_doc{"progress", "a progress line on stderr"},
    unirl::options::field_doc{"grpo.sampling", "", true},
    unirl::options::field_doc{"ppo.track.sampling", "", true}};

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
/// overrides (so explicit values win), then everything is validated. Every unknown key of the
/// file and of the overrides is named in one `config_error`. `require_model = false` leaves an
/// empty `model` unchecked (`unirl-train --print-recipe`).
inline void load(token_recipe& r, const std::string& path, const std::vector<std::string>& overrides,
                 bool require_model = true) {
  const auto file = path.empty() ? nlohmann::json::object() : options::read_recipe(path);
  std::vector<std::string> unknown = options::unknown_keys<token_recipe>(file);
  for (const auto& a : overrides) {
    const auto eq = a.find('=');
    if (eq == std::string::npos || eq == 0) throw config_error(a, "expected an override of the form key=value");
    const auto key = a.substr(0, eq);
    if (!options::has_key<token_recipe>(key)) unknown.push_back(key + options::key_suggestion<token_recipe>(key));
  }
  if (!unknown.empty()) {
    std::string all;
    for (const auto& k : unknown) all += (all.empty() ? "" : ", ") + k;
    throw config_error(unknown.front().substr(0, unknown.front().find(';')),
                       std::to_string(unknown.size()) + " unknown key" + (unknown.size() > 1 ? "s" : "") + ": " + all +
                           " (unirl-train --help lists every key)");
  }
  auto read = [&](token_recipe& into) {
    ::unirl::options::from_json(into, file);
    for (const auto& a : overrides) {
      const auto eq = a.find('=');
      options::set(into, a.substr(0, eq), a.substr(eq + 1));
    }
  };
  token_recipe probe;
  read(probe);  // an error here is the same error the real pass would give
  r.algorithm = probe.algorithm;
  apply_preset(r);
  read(r);
  if (!require_model && r.model.empty()) {
    r.model = "-";
    options::validate(r);
    r.model.clear();
  } else {
    options::validate(r);
  }
}

/// What a run reports.
struct run_result {
  double accuracy_before = -1.0, accuracy_after = -1.0;  // greedy held-out accuracy (-1: no eval_data)
  double accuracy_after_sft = -1.0;                       // ... after the supervised stage (-1: none)
  std::int64_t sft_steps = 0;                             // supervised steps done by this process
  std::int64_t sft_steps_total = 0;                       // supervised steps of the run directory
  std::int64_t steps = 0;                                 // RL steps done by this process
  std::int64_t steps_total = 0;                           // RL steps of the run directory (the trainer's step)
  std::int64_t first_step = 0;                            // 0, or the step a resumed run continued from
  double reward_first = 0.0, reward_last = 0.0;           // mean reward of the run's first step, of the last one
  double seconds = 0.0;                                   // this process, all of it
  double seconds_sft = 0.0, seconds_rl = 0.0, seconds_eval = 0.0;  // ... its supervised, RL and evaluation parts
  int interrupted_by = 0;                                 // the signal that stopped the run early (0: none)
  std::string checkpoint{};                               // the last checkpoint written ("" if none)
  std::string prompt_format{};                            // the format the prompts were given in
  std::string weights_dtype{};                            // the dtype the weights were loaded in (dtype)
  std::string export_dir{};
};

/// The file an export records its prompt format in (beside config.json): `{"format": "chatml",
/// "system_prompt": "", "prompt_suffix": ""}`. A run with `format = auto` on that directory
/// uses it. (Hugging Face's own `chat_template` cannot say "no template" or a suffix.)
inline constexpr std::string_view prompt_format_file = "unirl_prompt.json";

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

// The concrete format `f` stands for with `tok` (auto resolved).
inline prompt_format concrete_format(prompt_format f, const tokenizers::bpe_tokenizer& tok) {
  if (f != prompt_format::automatic) return f;
  switch (chat_format_of(f, tok)) {
    case tokenizers::chat_format::chatml: return prompt_format::chatml;
    case tokenizers::chat_format::llama3: return prompt_format::llama3;
    default: return prompt_format::plain;
  }
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

// A prompt's token ids fitted to `limit` tokens under `policy`: as they are, their last `limit`
// (truncate), or nothing (drop). Pre-flight has turned `error` into a message before any work.
inline std::optional<std::vector<std::int64_t>> fit_prompt(std::vector<std::int64_t> ids, std::int64_t limit,
                                                           overlong_policy policy) {
  if (static_cast<std::int64_t>(ids.size()) <= limit) return ids;
  if (policy != overlong_policy::truncate || limit < 1) return std::nullopt;
  ids.erase(ids.begin(), ids.end() - limit);
  return ids;
}

// The sampling options of the run: the recipe's, with the tokenizer's eos and `stop` tokens.
inline sampling_options run_sampling(const token_recipe& r, const tokenizers::bpe_tokenizer& tok) {
  auto s = r.sampling;
  if (const auto eos = tok.eos_id()) s.stop_tokens.push_back(*eos);
  for (const auto& t : r.stop) {
    const auto id = tok.token_to_id(t);
    if (!id) throw config_error("stop", "\"" + t + "\" is not a single token of the tokenizer of '" + r.model + "'");
    s.stop_tokens.push_back(*id);
  }
  return s;
}

}  // namespace detail

/// The recipe with its prompt format as the model directory recorded it (`prompt_format_file`,
/// written by an export): when `r.format` is auto, the recorded format, and the recorded system
/// prompt and suffix where the recipe leaves them empty. Returns whether a record was used.
inline bool apply_recorded_format(token_recipe& r) {
  const auto file = std::filesystem::path(r.model) / std::string(prompt_format_file);
  if (r.format != prompt_format::automatic || !std::filesystem::is_regular_file(file)) return false;
  nlohmann::json j;
  try {
    std::ifstream in(file);
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw error("recipe: " + file.string() + " is not valid JSON: " + e.what());
  }
  UNIRL_CHECK(j.is_object() && j.contains("format") && j["format"].is_string(), "recipe: ", file.string(),
              ": expected an object with a string \"format\"");
  r.format = options::parse_value<prompt_format>(file.string() + ": format", j["format"].get<std::string>());
  auto take = [&](std::string& into, const char* key) {
    if (into.empty() && j.contains(key) && j[key].is_string()) into = j[key].get<std::string>();
  };
  take(r.system_prompt, "system_prompt");
  take(r.prompt_suffix, "prompt_suffix");
  return true;
}

/// Greedy accuracy of `model` on `records` under the recipe's prompt format and answer reward
/// (a sample is right when the exact-answer scorer gives it its `correct` value). A prompt longer
/// than `max_prompt_tokens` (> 0) keeps its last tokens.
template <CausalLM M>
double greedy_accuracy(const M& model, const token_recipe& r, const tokenizers::bpe_tokenizer& tok,
                       const std::vector<data::record>& records, std::int64_t batch = 64,
                       std::int64_t max_prompt_tokens = 0) {
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
      auto ids = tok.encode(text);
      if (max_prompt_tokens > 0 && static_cast<std::int64_t>(ids.size()) > max_prompt_tokens)
        ids.erase(ids.begin(), ids.end() - max_prompt_tokens);
      in.tokens.push_back(std::move(ids));
      in.texts.push_back(text);
      in.references.push_back(records[i].answer);
    }
    const auto b = sample_tokens(model, in, 1, s);
    const auto scores = judge(b);
    right += (scores == static_cast<float>(r.reward.answer.correct)).sum().template item<std::int64_t>();
  }
  return static_cast<double>(right) / static_cast<double>(records.size());
}

/// What pre-flight (`preflight`) found: the model's context, the prompt budget, the held-out
/// records a run evaluates on (over-long ones dropped under `overlong = drop`), and one line per
/// data file with its counts.
struct preflight_report {
  std::int64_t context = 0;       // the model's max_position_embeddings
  std::int64_t prompt_limit = 0;  // context - sampling.max_new_tokens: longest RL / eval prompt
  std::vector<data::record> eval{};
  std::vector<std::string> lines{};
};

/// Pre-flight of a run, before any weights are loaded or any training: the device exists, `out`
/// and the export directory can be written, and every record of the training, held-out and
/// supervised data reads and fits the model's context (prompt + `sampling.max_new_tokens`; for
/// the supervised stage prompt + answer + eos). Over-long records are an error naming file:line,
/// the length, the limit and the recipe key, unless `overlong` drops or truncates them (counted in
/// the report). Every problem of one file is listed (the first 10), not only the first.
inline preflight_report preflight(const token_recipe& r, const tokenizers::bpe_tokenizer& tok) {
  preflight_report rep;
  detail::checked_device(r.device);
  detail::check_writable(std::filesystem::path(r.out) / "checkpoints", "out");
  if (r.export_dir != "none")
    detail::check_writable(r.export_dir.empty() ? std::filesystem::path(r.out) / "export" : std::filesystem::path(r.export_dir),
                           "export_dir");
  const auto cfg = models::hf::decoder_config::load(std::filesystem::path(r.model) / "config.json");
  rep.context = cfg.max_position_embeddings;
  rep.prompt_limit = rep.context - r.sampling.max_new_tokens;
  if (rep.prompt_limit < 1)
    throw config_error("sampling.max_new_tokens", "value " + std::to_string(r.sampling.max_new_tokens) +
                                                      " leaves no room for a prompt in the model's context of " +
                                                      std::to_string(rep.context) + " tokens (max_position_embeddings of " +
                                                      r.model + "/config.json)");
  detail::run_sampling(r, tok);  // the stop tokens exist

  auto check = [&](const data::jsonl_options& o, const char* what, bool sft) {
    const auto records = data::read_jsonl(o);
    UNIRL_CHECK(!records.empty(), "recipe: ", what, " '", o.path, "' has no records");
    std::vector<data::record> kept;
    std::vector<std::string> errors;
    std::int64_t dropped = 0, truncated = 0;
    for (const auto& rec : records) {
      const auto n = static_cast<std::int64_t>(tok.encode(detail::prompt_text(r, tok, rec)).size());
      std::int64_t limit = rep.prompt_limit, answer = 0;
      if (sft) {
        UNIRL_CHECK(!rec.answer.empty(), "recipe: sft: ", o.path, ":", rec.line,
                    " has no answer: the supervised stage needs one per record");
        answer = static_cast<std::int64_t>(tok.encode(rec.answer).size()) + (tok.eos_id() ? 1 : 0);
        limit = rep.context - answer;
      }
      if (n <= limit) {
        kept.push_back(rec);
        continue;
      }
      if (r.overlong == overlong_policy::truncate && limit >= 1) ++truncated, kept.push_back(rec);
      else if (r.overlong != overlong_policy::error) ++dropped;
      else if (errors.size() >= 10) errors.emplace_back();
      else if (sft)
        errors.push_back(o.path + ":" + std::to_string(rec.line) + ": the prompt and its answer are " +
                         std::to_string(n + answer) + " tokens (" + std::to_string(n) + " + " + std::to_string(answer) +
                         " with eos); the model's context is " + std::to_string(rep.context));
      else
        errors.push_back(o.path + ":" + std::to_string(rec.line) + ": the prompt is " + std::to_string(n) +
                         " tokens; the limit is " + std::to_string(limit) + " (the model's context of " +
                         std::to_string(rep.context) + " minus sampling.max_new_tokens = " +
                         std::to_string(r.sampling.max_new_tokens) + ")");
    }
    if (!errors.empty()) {
      std::string msg = std::to_string(errors.size()) + " record(s) of the " + what + " do not fit the context:";
      for (const auto& e : errors)
        if (!e.empty()) msg += "\n  " + e;
      if (errors.size() > 10) msg += "\n  ...";
      const char* fix = sft ? "\nshorten them, or set overlong=drop or overlong=truncate (the prompt keeps its last tokens)"
                            : "\nshorten them, lower sampling.max_new_tokens, or set overlong=drop or overlong=truncate";
      throw config_error(sft ? "overlong" : "sampling.max_new_tokens", msg + fix);
    }
    UNIRL_CHECK(!kept.empty(), "recipe: every record of the ", what, " '", o.path, "' is over-long (overlong = drop)");
    std::string line = "pre-flight: " + std::string(what) + " " + o.path + ": " + std::to_string(records.size()) + " records";
    if (dropped > 0) line += ", " + std::to_string(dropped) + " over-long dropped";
    if (truncated > 0) line += ", " + std::to_string(truncated) + " over-long truncated to their last tokens";
    rep.lines.push_back(line);
    return kept;
  };
  check(r.data, "training data", false);
  if (!r.eval_data.empty()) {
    auto eo = r.data;
    eo.path = r.eval_data;
    eo.max_records = r.eval_records;
    rep.eval = check(eo, "held-out data", false);
  }
  if (r.sft.steps > 0) {
    auto so = r.data;
    if (!r.sft.data.empty()) so.path = r.sft.data;
    check(so, "supervised data", true);
  }
  return rep;
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

// Thrown by the supervised stage's batch source when a stop was requested: the step before it
// finished, its checkpoint is written by the caller.
struct sft_stopped {};

// The supervised stage of a recipe (`sft_recipe`) on `model`; returns (steps run, total steps).
inline std::pair<std::int64_t, std::int64_t> run_sft(const token_recipe& r, const tokenizers::bpe_tokenizer& tok,
                                                     models::hf::causal_lm& model, const std::filesystem::path& out,
                                                     std::int64_t context, const stop_request* stop) {
  auto dopts = r.data;
  if (!r.sft.data.empty()) dopts.path = r.sft.data;
  data::jsonl_dataset records(dopts);
  const auto eos = tok.eos_id();
  const auto sft_dir = out / "sft";
  // A resumed stage appends to its metrics: the rows after its checkpoint go first.
  if (r.checkpoint.resume) {
    const train::run_directory d(sft_dir, {.keep = r.checkpoint.keep});
    if (const auto last = d.latest()) truncate_metrics(out / "sft_metrics.jsonl", last->step);
  }
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
              .out = sft_dir.string(),
              .checkpoint_every = r.checkpoint.every,
              .keep = r.checkpoint.keep,
              .resume = r.checkpoint.resume});
  const auto next = [&](std::int64_t n) {
    if (stop && stop->requested()) throw sft_stopped{};
    std::vector<std::vector<std::int64_t>> prompts, answers;
    while (static_cast<std::int64_t>(prompts.size()) < n) {
      for (const auto& rec : records.next(1)) {
        auto answer = tok.encode(rec.answer);
        if (eos) answer.push_back(*eos);
        auto prompt = fit_prompt(tok.encode(prompt_text(r, tok, rec)), context - static_cast<std::int64_t>(answer.size()),
                                 r.overlong);
        if (!prompt) continue;  // over-long, dropped (pre-flight counted it)
        prompts.push_back(std::move(*prompt));
        answers.push_back(std::move(answer));
      }
    }
    return train::make_sft_batch(prompts, answers, tok.pad_id());
  };
  try {
    const auto res = stage.run(next, nullptr, records);
    if (res.resumed) std::cout << "sft: resumed at step " << res.first_step << "\n";
    return {res.steps, stage.step_count()};
  } catch (const sft_stopped&) {
    const train::run_directory d(sft_dir, {.keep = r.checkpoint.keep});
    const bool saved = d.latest() && d.latest()->step == stage.step_count();
    if (!saved && stage.step_count() > 0)
      d.save(stage.step_count(), [&](const std::string& p) { stage.save(p, records); });
    return {-1, stage.step_count()};
  }
}

// summary.json of a run directory: cumulative over the invocations that resumed it.
struct run_summary {
  nlohmann::json previous = nlohmann::json::object();  // what an earlier invocation wrote ({} if none)

  // Reads the summary an earlier invocation wrote in `out` (none, or one damaged by a kill: {}).
  void continue_from(const std::filesystem::path& out) { previous = detail::previous_summary(out); }
  double prev(const char* key, double fallback) const {
    return previous.contains(key) && previous[key].is_number() ? previous[key].get<double>() : fallback;
  }
  nlohmann::json make(const token_recipe& r, const run_result& res) const {
    const double before = res.accuracy_before >= 0 ? res.accuracy_before : prev("accuracy_before", -1.0);
    const double after_sft = res.accuracy_after_sft >= 0 ? res.accuracy_after_sft : prev("accuracy_after_sft", -1.0);
    nlohmann::json j{{"accuracy_before", before},
                     {"accuracy_after_sft", after_sft},
                     {"accuracy_after", res.accuracy_after},
                     {"sft_steps", res.sft_steps_total},
                     {"steps", res.steps_total},
                     {"sft_steps_run", res.sft_steps},
                     {"steps_run", res.steps},
                     {"first_step", res.first_step},
                     {"reward_first", res.reward_first},
                     {"reward_last", res.reward_last},
                     {"seconds", prev("seconds", 0.0) + res.seconds},
                     {"seconds_sft", prev("seconds_sft", 0.0) + res.seconds_sft},
                     {"seconds_rl", prev("seconds_rl", 0.0) + res.seconds_rl},
                     {"seconds_eval", prev("seconds_eval", 0.0) + res.seconds_eval},
                     {"invocations", static_cast<std::int64_t>(prev("invocations", 0.0)) + 1},
                     {"interrupted", res.interrupted_by != 0},
                     {"prompt_format", res.prompt_format},
                     {"weights_dtype", res.weights_dtype},
                     {"export_dir", res.export_dir},
                     {"recipe", options::to_json(r)}};
    return j;
  }
  void write(const std::filesystem::path& out, const token_recipe& r, const run_result& res,
             const std::string& export_error = {}) const {
    auto j = make(r, res);
    if (!export_error.empty()) j["export_error"] = export_error;
    const auto tmp = (out / "summary.json.tmp").string();
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << j.dump(2) << "\n";
    }
    std::filesystem::rename(tmp, out / "summary.json");
  }
};

// The recipe's model in its dtype on its device, with LoRA adapters when `lora.rank > 0`; its
// dtype goes into `res`.
inline models::hf::causal_lm load_policy(const token_recipe& r, run_result& res) {
  const auto dtype = r.dtype == model_dtype::bfloat16 ? models::hf::weight_dtype::bfloat16
                     : r.dtype == model_dtype::float32 ? models::hf::weight_dtype::float32
                                                       : models::hf::weight_dtype::as_config;
  auto model = models::hf::from_pretrained(r.model, {.dtype = dtype, .device = r.device});
  res.weights_dtype = c10::toString(model.dtype());
  if (r.lora.rank > 0) lora::apply(model, r.lora);
  return model;
}

// Writes `policy` to `res.export_dir` in Hugging Face layout (LoRA merged; the adapter alone in
// PEFT's layout under adapter/), with the prompt format it was trained with (`prompt_format_file`).
inline void export_policy(models::hf::causal_lm& policy, const token_recipe& r, const run_result& res) {
  models::hf::save_pretrained(policy, res.export_dir, {.copy_tokenizer_from = r.model});  // LoRA: merged
  if (r.lora.rank > 0)  // the adapter alone, in PEFT's layout
    lora::save_adapter(policy, std::filesystem::path(res.export_dir) / "adapter", {.base_model_name_or_path = r.model});
  std::ofstream f(std::filesystem::path(res.export_dir) / std::string(prompt_format_file));
  f << nlohmann::json{{"format", res.prompt_format}, {"system_prompt", r.system_prompt}, {"prompt_suffix", r.prompt_suffix}}
           .dump(2)
    << "\n";
  UNIRL_CHECK(static_cast<bool>(f), "recipe: cannot write ", res.export_dir, "/", prompt_format_file);
}

template <class Algorithm>
run_result run_with(const token_recipe& r, const tokenizers::bpe_tokenizer& tok, const preflight_report& pf,
                    const stop_request* stop) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  auto since = [](clock::time_point a) { return std::chrono::duration<double>(clock::now() - a).count(); };
  const std::filesystem::path out(r.out);
  std::filesystem::create_directories(out / "checkpoints");
  if (r.threads > 0) torch::set_num_threads(static_cast<int>(r.threads));
  torch::manual_seed(static_cast<std::uint64_t>(r.seed));
  auto stopped = [&] { return stop != nullptr && stop->requested(); };

  run_result res;
  res.prompt_format = std::string(enum_to_string(concrete_format(r.format, tok)));
  const train::run_directory run_dir(out, {.keep = r.checkpoint.keep});
  const train::run_directory sft_dir(out / "sft", {.keep = r.checkpoint.keep});
  if (r.checkpoint.resume) run_dir.remove_temporaries();
  const auto last = r.checkpoint.resume ? run_dir.latest() : std::nullopt;
  // An invocation that resumes adds to the summary of the ones before; a fresh one starts it.
  run_summary summary;
  if (r.checkpoint.resume && (last || sft_dir.latest())) summary.continue_from(out);

  auto model = load_policy(r, res);
  const auto s = run_sampling(r, tok);
  const auto& eval = pf.eval;
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
  auto evaluate = [&](const auto& m) {
    const auto te = clock::now();
    const double a = greedy_accuracy(m, r, tok, eval, 64, pf.prompt_limit);
    res.seconds_eval += since(te);
    return a;
  };
  auto finish = [&] {
    res.seconds = since(t0);
    summary.write(out, r, res);
    train::write_report(out);
    return res;
  };
  model.train(false);
  // The base model's accuracy is measured once per run directory.
  res.accuracy_before = summary.prev("accuracy_before", -1.0);
  if (res.accuracy_before < 0) res.accuracy_before = evaluate(model);
  if (r.sft.steps > 0) {
    const auto ts = clock::now();
    const auto [ran, total] = run_sft(r, tok, model, out, pf.context, stop);
    res.seconds_sft = since(ts);
    res.sft_steps = ran < 0 ? 0 : ran;
    res.sft_steps_total = total;
    if (ran < 0) {
      res.interrupted_by = stop->signal();
      res.checkpoint = sft_dir.latest() ? sft_dir.latest()->path.string() : "";
      return finish();
    }
    model.train(false);
    res.accuracy_after_sft = ran > 0 ? -1.0 : summary.prev("accuracy_after_sft", -1.0);
    if (res.accuracy_after_sft < 0) res.accuracy_after_sft = evaluate(model);
  }
  trainer_t t{std::move(model), make_reward(r.reward), topts};
  if constexpr (requires { t.algorithm().set_filter_reward(std::ref(t.reward())); }) {
    // DAPO's dynamic sampling filters candidate groups by the run's own reward.
    if (r.grpo.dynamic_sampling) t.algorithm().set_filter_reward(std::ref(t.reward()));
  }

  // <out>/checkpoints/step-<n>.pt: the latest complete one resumes (a damaged newer one is skipped
  // with a warning), the newest `keep` are kept; metrics.jsonl keeps the rows up to it.
  if (last) {
    t.load(last->path.string(), train_data);
    res.first_step = t.step_count();
    const auto rows = truncate_metrics(out / "metrics.jsonl", res.first_step);
    truncate_metrics(out / "samples.jsonl", res.first_step);
    if (!rows.empty() && rows.front().contains("reward_mean") && rows.front()["reward_mean"].is_number())
      res.reward_first = rows.front()["reward_mean"].get<double>();
    std::cout << "resumed from " << last->path.filename().string() << " at step " << res.first_step << "\n";
  }
  res.steps_total = t.step_count();
  std::int64_t saved_at = last ? t.step_count() : -1;
  auto save = [&] {
    run_dir.save(t.step_count(), [&](const std::string& path) { t.save(path, train_data); });
    saved_at = t.step_count();
    res.checkpoint = run_dir.path_for(saved_at).string();
    res.seconds = since(t0);
    summary.write(out, r, res);
  };
  const auto tr = clock::now();
  for (std::int64_t step = t.step_count(); step < r.steps && !stopped(); ++step) {
    prompt_batch in{.decode = tok.decoder(), .pad_id = tok.pad_id()};
    while (static_cast<std::int64_t>(in.tokens.size()) < r.prompts_per_step) {
      for (const auto& rec : train_data.next(1)) {
        const auto text = prompt_text(r, tok, rec);
        auto ids = fit_prompt(tok.encode(text), pf.prompt_limit, r.overlong);
        if (!ids) continue;  // over-long, dropped (pre-flight counted it)
        in.tokens.push_back(std::move(*ids));
        in.texts.push_back(text);
        in.references.push_back(rec.answer);
      }
    }
    const auto st = t.step(in);
    if (res.steps == 0 && !last) res.reward_first = st.reward_mean;
    res.reward_last = st.reward_mean;
    ++res.steps;
    res.steps_total = t.step_count();
    if (r.checkpoint.every > 0 && t.step_count() % r.checkpoint.every == 0) save();
  }
  if (r.progress && res.steps > 0) std::cerr << "\n";
  if (res.steps > 0 && saved_at != t.step_count()) save();
  res.seconds_rl = since(tr);
  if (stopped()) {
    res.interrupted_by = stop->signal();
    return finish();
  }
  auto& policy = t.models().policy;
  policy.train(false);
  res.accuracy_after = evaluate(policy);
  if (r.export_dir != "none") {
    res.export_dir = r.export_dir.empty() ? (out / "export").string() : r.export_dir;
    try {
      export_policy(policy, r, res);
    } catch (const std::exception& e) {
      res.seconds = since(t0);
      summary.write(out, r, res, e.what());  // the training's record survives a failed export
      train::write_report(out);
      throw;
    }
  }
  return finish();
}

// The chat format of a multi-turn run (format = none: plain).
inline tokenizers::chat_format agent_format(const token_recipe& r, const tokenizers::bpe_tokenizer& tok) {
  return r.format == prompt_format::none ? tokenizers::chat_format::plain : chat_format_of(r.format, tok);
}

// The rollout options of a multi-turn run: the recipe's sampling with its stop tokens, except an
// eos that is the chat format's end-of-turn marker (it ends a turn there, not the episode).
inline agents::agent_options agent_rollout_options(const token_recipe& r, const tokenizers::bpe_tokenizer& tok) {
  const auto& e = r.environment;
  agents::agent_options o{.format = agent_format(r, tok), .system = r.system_prompt, .max_turns = e.max_turns,
                          .max_turn_tokens = e.max_turn_tokens, .max_episode_tokens = e.max_episode_tokens,
                          .sampling = run_sampling(r, tok), .stop_at_tool_call = e.stop_at_tool_call};
  if (const auto end = tok.token_to_id(agents::detail::turn_stop(o.format)))
    std::erase(o.sampling.stop_tokens, *end);
  return o;
}

// The options of GRPO over episodes and of PPO over episodes from a recipe.
inline agents::episode_grpo_options episode_grpo_options_of(const token_recipe& r) {
  auto g = r.grpo;
  g.sampling = r.sampling;
  return {.algorithm = g, .optim = r.optim, .clip = r.clip, .epochs = r.epochs, .minibatches = r.minibatches};
}
inline agents::episode_ppo_options episode_ppo_options_of(const token_recipe& r) {
  const auto& p = r.ppo;
  return {.algorithm = {.clip_low = p.clip_low, .clip_high = p.clip_high, .dual_clip = p.dual_clip,
                        .value_clip = p.value_clip, .vf_coef = p.vf_coef, .ent_coef = p.ent_coef,
                        .kl_coef = p.kl_coef, .kl = p.kl, .kl_in_reward = p.kl_in_reward, .gamma = p.gamma,
                        .lambda = p.lambda, .norm_adv = p.norm_adv, .agg = p.agg, .max_len = p.max_len},
          .temperature = r.sampling.temperature, .optim = r.optim, .clip = r.clip, .epochs = r.epochs,
          .minibatches = r.minibatches};
}

// Held-out tasks draw seeds from 2^40 up, training tasks below.
inline constexpr std::uint64_t heldout_seed_base = std::uint64_t{1} << 40;

// The demonstrations of a multi-turn run's supervised stage: `sft.data`, one conversation per line
// ({"messages": [{"role": ..., "content": ...}, ...]}), each laid out as its episode would be
// (`agents::demonstration_trajectory`). Every line is read and checked — JSON, roles, an assistant
// message, the token count against `limit` — and a bad one is an error naming the file and line.
inline std::vector<agents::trajectory> agent_demonstrations(const token_recipe& r, const tokenizers::bpe_tokenizer& tok,
                                                            const std::vector<nlohmann::json>& tool_defs,
                                                            std::int64_t limit) {
  std::ifstream in(r.sft.data);
  if (!in) throw config_error("sft.data", "cannot open '" + r.sft.data + "' for reading");
  const auto f = agent_format(r, tok);
  const agents::token_encoder encode = [&](const std::string& s) { return tok.encode(s); };
  std::vector<agents::trajectory> demos;
  std::string line;
  for (std::int64_t no = 1; std::getline(in, line); ++no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto at = r.sft.data + ":" + std::to_string(no);
    auto bad = [&](const std::string& why) { return config_error("sft.data", at + ": " + why); };
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw bad(std::string("not a JSON object (") + e.what() + ")");
    }
    if (!j.is_object() || !j.contains("messages") || !j["messages"].is_array())
      throw bad("expected an object with a \"messages\" array of {\"role\", \"content\"} objects");
    std::vector<tokenizers::chat_message> msgs;
    for (const auto& m : j["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
          !m["content"].is_string())
        throw bad("message " + std::to_string(msgs.size()) + ": expected {\"role\": string, \"content\": string}");
      msgs.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    agents::trajectory t;
    try {
      t = agents::demonstration_trajectory(f, msgs, encode, tool_defs, r.system_prompt);
    } catch (const std::invalid_argument& e) {
      throw bad(e.what());
    }
    if (t.size() > limit)
      throw bad("the conversation is " + std::to_string(t.size()) + " tokens; expected at most " + std::to_string(limit) +
                " (environment.max_episode_tokens and the model's context)");
    demos.push_back(std::move(t));
  }
  if (demos.empty()) throw config_error("sft.data", "'" + r.sft.data + "' holds no conversation; expected one per line");
  return demos;
}

}  // namespace detail

/// Pre-flight of a multi-turn run (`environment.name` set), before any weights are loaded: keys
/// a multi-turn run does not read are errors naming them; the device, `out` and the export
/// directory; the stop tokens; the learner's options; and the first prompts of the environment
/// (with the tools' definitions) against `environment.max_episode_tokens` and the model's context;
/// with a supervised stage, every demonstration of `sft.data`. Returns the context and the
/// demonstrations (read once, here).
struct agent_preflight {
  std::int64_t context = 0;
  std::vector<agents::trajectory> demonstrations{};
};
inline agent_preflight preflight_agent(const token_recipe& r, const tokenizers::bpe_tokenizer& tok) {
  const auto not_read = [&](const char* key, bool set) {
    if (set)
      throw config_error(key, std::string("is set, but a multi-turn run (environment.name = ") + r.environment.name +
                                  ") does not read it: its tasks come from the environment");
  };
  if (r.sft.steps > 0 && r.sft.data.empty())
    throw config_error("sft.data", "is empty, but sft.steps = " + std::to_string(r.sft.steps) +
                                       ": a multi-turn run's supervised stage reads demonstration conversations, one "
                                       "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]} per line");
  not_read("eval_data", !r.eval_data.empty());
  not_read("micro_batch_size", r.micro_batch_size > 0);
  not_read("precision", r.precision != ::unirl::precision::fp32);
  if (!(r.sampling.temperature > 0.0))
    throw config_error("sampling.temperature", "value " + std::to_string(r.sampling.temperature) +
                                                   ": a multi-turn run samples its episodes at a temperature > 0 "
                                                   "(held-out episodes are greedy)");
  detail::checked_device(r.device);
  detail::check_writable(std::filesystem::path(r.out), "out");
  if (r.export_dir != "none")
    detail::check_writable(r.export_dir.empty() ? std::filesystem::path(r.out) / "export" : std::filesystem::path(r.export_dir),
                           "export_dir");
  const auto cfg = models::hf::decoder_config::load(std::filesystem::path(r.model) / "config.json");
  const auto ao = detail::agent_rollout_options(r, tok);
  if (r.algorithm == algorithm_name::ppo) options::validate(detail::episode_ppo_options_of(r));
  else options::validate(detail::episode_grpo_options_of(r));
  auto tools = agents::make_builtin_toolbox(r.environment.tool_options);
  tools.select(r.tools);
  std::vector<nlohmann::json> defs;
  if (ao.format == tokenizers::chat_format::chatml || ao.format == tokenizers::chat_format::qwen2_5)
    defs = tools.definitions();
  const auto limit = std::min<std::int64_t>(r.environment.max_episode_tokens, cfg.max_position_embeddings);
  agent_preflight pf{.context = cfg.max_position_embeddings};
  if (r.sft.steps > 0) pf.demonstrations = detail::agent_demonstrations(r, tok, defs, limit);  // before any work
  agents::with_builtin_environment(r.environment.name, [&](auto env) {
    for (std::uint64_t seed = 0; seed < 8; ++seed) {
      const auto first = env.reset(seed);
      std::vector<tokenizers::chat_message> msgs;
      if (!ao.system.empty()) msgs.push_back({"system", ao.system});
      msgs.push_back({"user", first.text});
      const auto n = first.tokens.empty()
                         ? static_cast<std::int64_t>(tok.encode(tokenizers::apply_chat_template(ao.format, msgs, true, defs)).size())
                         : static_cast<std::int64_t>(first.tokens.size());
      if (n + 1 > limit)
        throw config_error("environment.max_episode_tokens",
                           "the first prompt of the environment '" + r.environment.name + "' (task seed " +
                               std::to_string(seed) + ") is " + std::to_string(n) + " tokens" +
                               (defs.empty() ? "" : " with the tools' definitions") + ", which leaves no room for a turn in " +
                               std::to_string(limit) + " (environment.max_episode_tokens = " +
                               std::to_string(r.environment.max_episode_tokens) + ", the model's context = " +
                               std::to_string(cfg.max_position_embeddings) + ")");
    }
  });
  return pf;
}

namespace detail {

// A multi-turn run (see `environment_recipe`): held-out mean return before, RL on episodes, after;
// metrics.jsonl (one row per step), summary.json, report.html and the export. Checkpoints as the
// single-turn run's: <out>/checkpoints/step-<n>.pt every `checkpoint.every` steps, at the end and
// when a signal stops the run; the same command resumes from the newest complete one (the
// trainable weights, the critic of PPO, the optimizer, the task stream and the generators: a
// resumed run continues as the straight one would), keeping the metrics rows before it and a
// cumulative summary.json.
inline run_result run_agent(const token_recipe& r, const tokenizers::bpe_tokenizer& tok,
                            const std::vector<agents::trajectory>& demos, const stop_request* stop) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  auto since = [](clock::time_point a) { return std::chrono::duration<double>(clock::now() - a).count(); };
  const std::filesystem::path out(r.out);
  std::filesystem::create_directories(out);
  if (r.threads > 0) torch::set_num_threads(static_cast<int>(r.threads));
  torch::manual_seed(static_cast<std::uint64_t>(r.seed));
  run_result res;
  const train::run_directory run_dir(out, {.keep = r.checkpoint.keep});
  if (r.checkpoint.resume) run_dir.remove_temporaries();
  const auto last = r.checkpoint.resume ? run_dir.latest() : std::nullopt;
  run_summary summary;  // a resumed run adds to the summary of the invocations before it
  if (r.checkpoint.resume && (last || train::run_directory(out / "sft").latest())) summary.continue_from(out);
  res.prompt_format = std::string(enum_to_string(r.format == prompt_format::none ? prompt_format::none
                                                                                 : concrete_format(r.format, tok)));
  auto model = load_policy(r, res);
  model.train(false);
  std::optional<models::hf::causal_lm> reference;
  const double kl_coef = r.algorithm == algorithm_name::ppo ? r.ppo.kl_coef : r.grpo.kl_coef;
  if (kl_coef > 0.0) reference.emplace(train::frozen_copy(model));
  const agents::agent_text text{.encode = [&](const std::string& s) { return tok.encode(s); }, .decode = tok.decoder()};
  const auto ao = agent_rollout_options(r, tok);
  auto greedy = ao;
  greedy.sampling.temperature = 0.0;
  auto tools = agents::make_builtin_toolbox(r.environment.tool_options);
  tools.select(r.tools);
  std::vector<std::uint64_t> heldout;
  for (std::int64_t i = 0; i < r.environment.heldout; ++i) heldout.push_back(heldout_seed_base + static_cast<std::uint64_t>(i));
  std::mt19937_64 rng(static_cast<std::uint64_t>(r.seed));
  std::ofstream metrics;
  auto schedule = r.schedule;
  if (schedule.total_steps == 0) schedule.total_steps = r.steps;

  agents::with_builtin_environment(r.environment.name, [&](auto env) {
    auto evaluate = [&] {
      if (heldout.empty()) return -1.0;
      const auto te = clock::now();
      torch::NoGradGuard ng;
      const auto o = agents::run_episodes(model, env, heldout, 1, tools, text, greedy);
      res.seconds_eval += since(te);
      return o.stats.at("reward_mean");
    };
    // The base model's mean return is measured once per run directory.
    res.accuracy_before = summary.prev("accuracy_before", -1.0);
    if (res.accuracy_before < 0) res.accuracy_before = evaluate();
    // What a checkpoint holds: the policy's trainable weights (the frozen base is the model
    // directory's), the critic (PPO), the optimizer, the step, the task stream and the generators.
    auto trainable = [&] {
      named_tensors t;
      for (auto& [n, p] : model.named_parameters())
        if (p.requires_grad()) t.emplace_back(n, p);
      return t;
    };
    const auto stopped = [&] { return stop != nullptr && stop->requested(); };
    // The part of a checkpoint both stages write: the trainable weights, their optimizer, the step.
    auto write_state = [&](torch::serialize::OutputArchive& a, const train::optimizer& o, std::int64_t step) {
      train::save_tensors(a, "policy/", trainable());
      o.save(a);
      train::write_scalar(a, "step", step);
    };
    auto read_state = [&](torch::serialize::InputArchive& a, train::optimizer& o) {
      train::load_tensors(a, "policy/", trainable());
      o.load(a);
      return train::read_scalar<std::int64_t>(a, "step");
    };
    // The supervised stage on demonstration conversations (sft.steps > 0): cross-entropy on the
    // assistant turns, laid out as the episodes are. Its checkpoints are <out>/sft/checkpoints/
    // (every checkpoint.every steps, at its end and on a signal; a resume continues it); once RL
    // has a checkpoint, the stage's result is in it and the stage does not run again.
    if (r.sft.steps > 0 && last) {
      res.sft_steps_total = r.sft.steps;
    } else if (r.sft.steps > 0) {
      const auto ts = clock::now();
      UNIRL_CHECK(!demos.empty(), "recipe: a supervised stage without demonstrations (preflight_agent reads them)");
      const train::run_directory sft_dir(out / "sft", {.keep = r.checkpoint.keep});
      if (r.checkpoint.resume) sft_dir.remove_temporaries();
      const auto sft_last = r.checkpoint.resume ? sft_dir.latest() : std::nullopt;
      train::optimizer optim(trainable(), r.sft.optim);
      auto sched = r.sft.schedule;
      if (sched.total_steps == 0) sched.total_steps = r.sft.steps;
      std::int64_t k = 0, pos = 0;
      if (sft_last) {
        train::read_checkpoint(sft_last->path.string(), [&](torch::serialize::InputArchive& a) {
          k = read_state(a, optim);
          pos = train::read_scalar<std::int64_t>(a, "position") % static_cast<std::int64_t>(demos.size());
        });
        truncate_metrics(out / "sft_metrics.jsonl", k);
        std::cout << "sft: resumed at step " << k << "\n";
      }
      std::ofstream sm(out / "sft_metrics.jsonl", sft_last ? std::ios::app : std::ios::trunc);
      UNIRL_CHECK(static_cast<bool>(sm), "recipe: cannot write ", (out / "sft_metrics.jsonl").string());
      std::int64_t saved = sft_last ? k : -1;
      auto save_sft = [&](std::int64_t done) {
        sft_dir.save(done, [&](const std::string& path) {
          train::write_checkpoint(path, [&](torch::serialize::OutputArchive& a) {
            write_state(a, optim, done);
            train::write_scalar(a, "position", pos);
          });
        });
        saved = done;
        res.checkpoint = sft_dir.path_for(done).string();
      };
      std::vector<torch::Tensor> params;
      for (auto& [n, p] : trainable()) params.push_back(p);
      const auto first_k = k;
      model.train(true);
      for (; k < r.sft.steps && !stopped(); ++k) {
        std::vector<agents::trajectory> batch;
        for (std::int64_t i = 0; i < r.sft.batch_size; ++i) {
          batch.push_back(demos[static_cast<std::size_t>(pos)]);
          pos = (pos + 1) % static_cast<std::int64_t>(demos.size());
        }
        optim.set_lr_multiplier(train::lr_multiplier(sched, k));
        const auto loss = train::sft_loss(model, agents::sft_batch_of(batch, tok.pad_id()), r.sft.layout);
        optim.zero_grad();
        loss.backward();
        if (r.sft.clip.max_grad_norm > 0.0) train::clip_grad_norm(params, r.sft.clip.max_grad_norm);
        optim.step();
        sm << nlohmann::json{{"step", k}, {"loss", loss.item<double>()},
                             {"learning_rate", r.sft.optim.lr * optim.lr_multiplier()}}
                  .dump()
           << "\n"
           << std::flush;
        if (r.progress) std::cerr << "\rsft step " << k + 1 << "/" << r.sft.steps << std::flush;
        if (r.checkpoint.every > 0 && (k + 1) % r.checkpoint.every == 0) save_sft(k + 1);
      }
      if (r.progress && k > first_k) std::cerr << "\n";
      model.train(false);
      res.sft_steps = k - first_k;
      res.sft_steps_total = k;
      if (saved != k && k > first_k) save_sft(k);
      res.seconds_sft = since(ts);
      if (stopped()) {
        res.interrupted_by = stop->signal();
        return;
      }
      res.accuracy_after_sft = evaluate();
    }
    auto train = [&](auto& learner, auto&& update) {
      using learner_t = std::remove_cvref_t<decltype(learner)>;
      constexpr bool has_critic = requires(learner_t& l) { l.critic(); };
      std::int64_t first = 0;
      if (last) {
        train::read_checkpoint(last->path.string(), [&](torch::serialize::InputArchive& a) {
          first = read_state(a, learner.optimizer());
          if constexpr (has_critic) train::load_tensors(a, "critic/", learner.critic().named_parameters());
          std::istringstream(train::read_scalar<std::string>(a, "tasks")) >> rng;
          train::load_rng(a);
        });
        const auto rows = truncate_metrics(out / "metrics.jsonl", first);
        if (!rows.empty() && rows.front().contains("rollout/reward_mean") && rows.front()["rollout/reward_mean"].is_number())
          res.reward_first = rows.front()["rollout/reward_mean"].get<double>();
        res.first_step = first;
        std::cout << "resumed from " << last->path.filename().string() << " at step " << first << "\n";
      }
      metrics.open(out / "metrics.jsonl", last ? std::ios::app : std::ios::trunc);
      UNIRL_CHECK(static_cast<bool>(metrics), "recipe: cannot write ", (out / "metrics.jsonl").string());
      res.steps_total = first;
      std::int64_t saved_at = last ? first : -1;
      auto save = [&](std::int64_t done) {
        run_dir.save(done, [&](const std::string& path) {
          train::write_checkpoint(path, [&](torch::serialize::OutputArchive& a) {
            write_state(a, learner.optimizer(), done);
            if constexpr (has_critic) train::save_tensors(a, "critic/", learner.critic().named_parameters());
            std::ostringstream tasks;
            tasks << rng;
            train::write_scalar(a, "tasks", tasks.str());
            train::save_rng(a);
          });
        });
        saved_at = done;
        res.checkpoint = run_dir.path_for(done).string();
        res.seconds = since(t0);
        summary.write(out, r, res);
      };
      const auto tr = clock::now();
      for (std::int64_t step = first; step < r.steps && !(stop != nullptr && stop->requested()); ++step) {
        learner.optimizer().set_lr_multiplier(train::lr_multiplier(schedule, step));
        std::vector<std::uint64_t> seeds;
        for (std::int64_t i = 0; i < r.prompts_per_step; ++i) seeds.push_back(rng() % heldout_seed_base);
        const auto group = r.algorithm == algorithm_name::ppo ? std::int64_t{1} : r.group_size;
        agents::episodes_result ep;
        {
          torch::NoGradGuard ng;
          ep = agents::run_episodes(model, env, seeds, r.group_size, tools, text, ao);
        }
        const auto s = update(learner, ep.episodes, group);
        nlohmann::json row{{"step", step}, {"learning_rate", r.optim.lr * learner.optimizer().lr_multiplier()}};
        for (const auto& [k, v] : ep.stats) row["rollout/" + k] = v;
        for (const auto& [k, v] : s) row[k] = v;
        metrics << row.dump() << "\n" << std::flush;
        if (res.steps == 0 && !last) res.reward_first = ep.stats.at("reward_mean");
        res.reward_last = ep.stats.at("reward_mean");
        ++res.steps;
        res.steps_total = step + 1;
        if (r.progress)
          std::cerr << "\rstep " << step + 1 << "/" << r.steps << "  return " << ep.stats.at("reward_mean") << "  turns "
                    << ep.stats.at("turns_mean") << "  tool calls " << ep.stats.at("tool_call_rate") << std::flush;
        if (r.checkpoint.every > 0 && (step + 1) % r.checkpoint.every == 0) save(step + 1);
      }
      if (r.progress && res.steps > 0) std::cerr << "\n";
      if (res.steps > 0 && saved_at != res.steps_total) save(res.steps_total);
      res.seconds_rl = since(tr);
    };
    const auto pad = tok.pad_id();
    if (r.algorithm == algorithm_name::ppo) {
      agents::episode_ppo<models::hf::causal_lm> learner{model, episode_ppo_options_of(r),
                                                         reference ? &*reference : nullptr};
      train(learner, [&](auto& l, const auto& eps, std::int64_t) { return l.step(eps, pad); });
    } else {
      agents::episode_grpo<models::hf::causal_lm> learner{model, episode_grpo_options_of(r),
                                                          reference ? &*reference : nullptr};
      train(learner, [&](auto& l, const auto& eps, std::int64_t g) { return l.step(eps, g, pad); });
    }
    model.train(false);
    if (stop != nullptr && stop->requested()) {
      res.interrupted_by = stop->signal();
      return;
    }
    res.accuracy_after = evaluate();
  });
  if (res.interrupted_by == 0 && r.export_dir != "none") {
    res.export_dir = r.export_dir.empty() ? (out / "export").string() : r.export_dir;
    export_policy(model, r, res);
  }
  res.seconds = since(t0);
  summary.write(out, r, res);
  train::write_report(out);
  return res;
}

}  // namespace detail

/// Runs a recipe end to end (see the file comment): pre-flight (`preflight`: device, writable
/// directories, every data record against the context), then the supervised stage, RL and the
/// export; writes metrics.jsonl, samples.jsonl, checkpoints/, summary.json, report.html and the
/// export under `r.out`. With `stop` (e.g. set by `signal_stop_scope` on SIGINT / SIGTERM) the run ends after the step in
/// flight with a checkpoint, `interrupted_by` set, and no evaluation or export.
inline run_result run(const token_recipe& recipe, const stop_request* stop = nullptr) {
  options::validate(recipe);
  auto r = recipe;
  const bool recorded = apply_recorded_format(r);
  auto tok = tokenizers::bpe_tokenizer::from_dir(r.model);
  if (!r.environment.name.empty()) {  // a multi-turn agent run
    const auto pf = preflight_agent(r, tok);
    return detail::run_agent(r, tok, pf.demonstrations, stop);
  }
  const auto pf = preflight(r, tok);
  if (recorded)
    std::cout << "prompt format: " << enum_to_string(detail::concrete_format(r.format, tok)) << " (recorded in "
              << (std::filesystem::path(r.model) / std::string(prompt_format_file)).string() << ")\n";
  for (const auto& line : pf.lines) std::cout << line << "\n";
  if (r.algorithm == algorithm_name::ppo) return detail::run_with<algo::ppo<>::for_track<token_track>>(r, tok, pf, stop);
  return detail::run_with<algo::grpo<>>(r, tok, pf, stop);
}

}  // namespace unirl::recipes
