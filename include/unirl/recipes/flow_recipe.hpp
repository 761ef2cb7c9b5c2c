#pragma once
/// \file flow_recipe.hpp
/// A whole Flow-GRPO run of a Stable Diffusion 3 pipeline in the diffusers layout from one recipe:
/// the pipeline folder, prompts, the Flow-GRPO options and its SDE sampler, LoRA on the
/// transformer (or full fine-tuning), built-in rewards on the VAE-decoded images, optimizer and
/// schedule, activation checkpointing and precision, steps, checkpoints with resume, and the
/// export back to the diffusers layout (the whole pipeline, LoRA merged, and the LoRA alone in
/// diffusers' names). `unirl-train-flow` is this function behind a command line; it composes the
/// library's own pieces (`unirl::trainer`, `models::flow_model<diffusers::sd3_net>`,
/// `diffusers::load_sd3` / `save_sd3` / `save_lora`, `algo::flow_grpo`), so a recipe run is the
/// same code path as a trainer written by hand (examples/22_digits_sd3).
///
/// ```cpp
/// unirl::recipes::flow_recipe r;
/// r.model = "sd3-tiny";                            // model_index.json, transformer/, vae/, ...
/// r.prompts = {"a red cube", "a blue sphere"};
/// r.steps = 20;
/// auto result = unirl::recipes::run(r);            // result.eval_reward_before / eval_reward_after
/// ```
///
/// Pre-flight (`preflight`) reads every config of the folder (`diffusers::inspect_sd3`), the
/// prompts, the image size against the VAE and the transformer, the device and the output
/// directories before any weights are read: a bad value is a `config_error` naming the key.
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/flow_grpo.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/core/signals.hpp>
#include <unirl/models/diffusers/sd3.hpp>
#include <unirl/models/flow.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/recipes/common.hpp>
#include <unirl/rollout/flow_samplers.hpp>
#include <unirl/train/report.hpp>
#include <unirl/train/run_directory.hpp>
#include <unirl/trainer.hpp>

namespace unirl::recipes {

/// The built-in rewards of a flow recipe, on the VAE-decoded images with pixels mapped to
/// [0, 1], each with a weight (0 = off; negative = a penalty): the reward of an image is
/// `brightness * mean(pixels) + contrast * std(pixels)`.
struct image_reward_recipe {
  double brightness = 1.0;
  double contrast = 0.0;

  void validate(const std::string& p) const {
    options::require(std::isfinite(brightness) && std::isfinite(contrast), p + "brightness", brightness,
                     "finite weights");
    options::require(brightness != 0.0 || contrast != 0.0, p + "brightness", brightness,
                     "at least one non-zero reward weight (brightness or contrast)");
  }
};

/// A flow recipe (the file `unirl-train-flow --recipe` reads; every key may be overridden as
/// key=value). Each key's description is in `field_docs<flow_recipe>` (`unirl-train-flow --help`).
struct flow_recipe {
  std::string model{};
  std::vector<std::string> prompts{};
  std::string prompts_file{};
  std::int64_t height = 0;
  std::int64_t width = 0;
  double guidance = 4.5;
  std::int64_t t5_tokens = 77;
  bool allow_missing_t5 = false;
  algo::flow_grpo_options flow_grpo{.beta = 0.04, .sampler = {.steps = 10, .shift = 3.0}};
  image_reward_recipe reward{};
  train::optimizer_options optim{.lr = 1e-4};
  train::schedule_options schedule{};
  train::clip_options clip{.max_grad_norm = 1.0};
  train::memory_options memory{};
  lora::options lora{.rank = 8, .alpha = 16.0, .targets = models::diffusers::sd3_lora_targets()};
  ::unirl::precision precision = ::unirl::precision::fp32;
  std::int64_t group_size = 4;
  std::int64_t prompts_per_step = 2;
  std::int64_t steps = 10;
  std::int64_t eval_samples = 2;
  std::int64_t seed = 0;
  std::int64_t threads = 0;
  std::string device = "cpu";
  std::string out = "runs/unirl-train-flow";
  checkpoint_recipe checkpoint{};
  std::string export_dir{};
  bool progress = true;

  void validate(const std::string& p) const {
    options::require(height >= 0, p + "height", height, ">= 0 (0: the transformer's sample_size times the VAE's factor)");
    options::require(width >= 0, p + "width", width, ">= 0 (0: the transformer's sample_size times the VAE's factor)");
    options::require(std::isfinite(guidance) && guidance >= 1.0, p + "guidance", guidance,
                     ">= 1 (1: the conditional velocity only)");
    options::require(t5_tokens >= 0, p + "t5_tokens", t5_tokens, ">= 0");
    options::require(group_size >= 2, p + "group_size", group_size, ">= 2: Flow-GRPO normalises rewards within a group");
    options::require(prompts_per_step >= 1, p + "prompts_per_step", prompts_per_step, ">= 1");
    options::require(steps >= 0, p + "steps", steps, ">= 0");
    options::require(eval_samples >= 0, p + "eval_samples", eval_samples, ">= 0 (0: no evaluation)");
    options::require(threads >= 0, p + "threads", threads, ">= 0");
    options::require(!out.empty(), p + "out", out, "a run directory");
  }
};

}  // namespace unirl::recipes

BOOST_HANA_ADAPT_STRUCT(unirl::recipes::image_reward_recipe, brightness, contrast);
BOOST_HANA_ADAPT_STRUCT(unirl::recipes::flow_recipe, model, prompts, prompts_file, height, width, guidance, t5_tokens,
                        allow_missing_t5, flow_grpo, reward, optim, schedule, clip, memory, lora, precision, group_size,
                        prompts_per_step, steps, eval_samples, seed, threads, device, out, checkpoint, export_dir,
                        progress);

template <>
inline constexpr std::array unirl::options::field_docs<unirl::recipes::image_reward_recipe>{
    unirl::options::field_doc{"brightness", "weight of the mean pixel of the decoded image, in [0, 1]"},
    unirl::options::field_doc{"contrast", "weight of the standard deviation of the decoded image's pixels"}};
template <>
inline constexpr std::array unirl::options::field_docs<unirl::recipes::flow_recipe>{
    unirl::options::field_doc{"model", "Stable Diffusion 3 pipeline folder in the diffusers layout (model_index.json, transformer/, vae/, text_encoder*/, tokenizer*/, scheduler/)"},
    unirl::options::field_doc{"prompts", "the prompts of the run (added to those of prompts_file)"},
    unirl::options::field_doc{"prompts_file", "a text file of prompts, one per line (blank lines skipped)"},
    unirl::options::field_doc{"height", "image height in pixels; 0 = the transformer's sample_size times the VAE's factor"},
    unirl::options::field_doc{"width", "image width in pixels; 0 = the transformer's sample_size times the VAE's factor"},
    unirl::options::field_doc{"guidance", "classifier-free guidance scale against the empty prompt; 1 = conditional only"},
    unirl::options::field_doc{"t5_tokens", "length of the zero T5 sequence (SD3 without T5)"},
    unirl::options::field_doc{"allow_missing_t5", "run a pipeline whose model_index.json names a T5 encoder without it (zero T5 tokens)"},
    unirl::options::field_doc{"precision", "autocast precision of forward / backward (float32 master weights)"},
    unirl::options::field_doc{"group_size", "samples per prompt (Flow-GRPO's group)"},
    unirl::options::field_doc{"prompts_per_step", "prompts drawn (without repetition) per step"},
    unirl::options::field_doc{"steps", "Flow-GRPO steps (a resumed run continues to this count)"},
    unirl::options::field_doc{"eval_samples", "ODE samples per prompt from fixed noise for the reward before / after training; 0 = none"},
    unirl::options::field_doc{"seed", "seed of LibTorch's generators"},
    unirl::options::field_doc{"threads", "LibTorch intra-op threads; 0 = LibTorch's default"},
    unirl::options::field_doc{"device", "cpu, cuda or cuda:N (checked before any work)"},
    unirl::options::field_doc{"out", "run directory: metrics.jsonl, checkpoints/, summary.json, report.html, export/"},
    unirl::options::field_doc{"export_dir", "where the trained pipeline is written (LoRA merged; the LoRA alone in lora/); empty = <out>/export; none = no export"},
    unirl::options::field_doc{"progress", "a progress line on stderr"}};

namespace unirl::recipes {

/// What a flow run reports.
struct flow_run_result {
  std::int64_t steps = 0;                        // Flow-GRPO steps done by this process
  std::int64_t steps_total = 0;                  // steps of the run directory (the trainer's step)
  std::int64_t first_step = 0;                   // 0, or the step a resumed run continued from
  double reward_first = 0.0, reward_last = 0.0;  // mean reward of the run's first step, of the last one
  std::optional<double> eval_reward_before;      // mean reward of the ODE samples from fixed noise
  std::optional<double> eval_reward_after;       // ... after training (none: eval_samples = 0)
  std::int64_t encoder_batches = 0;              // batches through the text encoders (the cache's misses)
  double seconds = 0.0;
  int interrupted_by = 0;                        // the signal that stopped the run early (0: none)
  std::string checkpoint{};                      // the last checkpoint written ("" if none)
  std::string export_dir{};
};

/// What pre-flight found: the prompts, the latent shape (C, h, w) of the images, one line per finding.
struct flow_preflight_report {
  std::vector<std::string> prompts{};
  std::vector<std::int64_t> latent_shape{};
  std::vector<std::string> lines{};
};

/// Pre-flight of a flow run, before any weights are read: the pipeline folder's layout and every
/// config (`diffusers::inspect_sd3`), the prompts (`prompts` and `prompts_file`; at least
/// `prompts_per_step`), the image size (a multiple of the VAE's factor whose latents the
/// transformer's patches and position table cover), the device, and that `out` and the export
/// directory can be written. Each problem is a `config_error` naming the recipe key and the value.
inline flow_preflight_report preflight(const flow_recipe& r) {
  namespace df = models::diffusers;
  flow_preflight_report rep;
  if (r.model.empty())
    throw config_error("model", "is empty: expected a Stable Diffusion 3 pipeline folder in the diffusers layout "
                                "(model_index.json, transformer/, vae/, ...)");
  std::error_code ec;
  if (!std::filesystem::is_directory(r.model, ec))
    throw config_error("model", "'" + r.model + "' is not a directory: expected a Stable Diffusion 3 pipeline folder "
                                "in the diffusers layout");
  df::sd3_layout layout;
  try {
    layout = df::inspect_sd3(r.model, {.allow_missing_t5 = r.allow_missing_t5, .t5_tokens = r.t5_tokens});
  } catch (const config_error&) {
    throw;
  } catch (const error& e) {
    throw config_error("model", "'" + r.model + "': " + e.what());
  }
  detail::checked_device(r.device);
  detail::check_writable(std::filesystem::path(r.out) / "checkpoints", "out");
  if (r.export_dir != "none")
    detail::check_writable(r.export_dir.empty() ? std::filesystem::path(r.out) / "export" : std::filesystem::path(r.export_dir),
                           "export_dir");

  rep.prompts = r.prompts;
  if (!r.prompts_file.empty()) {
    std::ifstream in(r.prompts_file);
    if (!in) throw config_error("prompts_file", "'" + r.prompts_file + "' cannot be read");
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") != std::string::npos) rep.prompts.push_back(line);
    }
  }
  if (rep.prompts.empty())
    throw config_error("prompts", "no prompts: give them as prompts (a list) or prompts_file (one per line)" +
                                      (r.prompts_file.empty() ? std::string() : ": '" + r.prompts_file + "' has none"));
  if (r.prompts_per_step > static_cast<std::int64_t>(rep.prompts.size()))
    throw config_error("prompts_per_step", "value " + std::to_string(r.prompts_per_step) + " is more than the " +
                                               std::to_string(rep.prompts.size()) + " prompts of the run");

  const auto f = layout.vae_factor();
  const auto& tc = layout.transformer;
  const auto side = [&](std::int64_t v, const char* key) {
    const auto px = v > 0 ? v : tc.sample_size * f;
    const auto lat = px / f;
    if (px % f != 0 || lat % tc.patch_size != 0 || lat / tc.patch_size > tc.pos_embed_max_size)
      throw config_error(key, "value " + std::to_string(px) + ": expected a multiple of " +
                                  std::to_string(f * tc.patch_size) + " (the VAE's factor " + std::to_string(f) +
                                  " times patch_size " + std::to_string(tc.patch_size) + ") of at most " +
                                  std::to_string(f * tc.patch_size * tc.pos_embed_max_size) +
                                  " pixels (pos_embed_max_size = " + std::to_string(tc.pos_embed_max_size) + " patches)");
    return lat;
  };
  const auto h = side(r.height, "height"), w = side(r.width, "width");
  rep.latent_shape = {tc.in_channels, h, w};
  rep.lines.push_back("pre-flight: " + r.model + ": StableDiffusion3Pipeline, transformer " +
                      std::to_string(tc.num_layers) + " blocks of width " + std::to_string(tc.inner_dim()) + "; images " +
                      std::to_string(h * f) + " x " + std::to_string(w * f) + " (latents " +
                      std::to_string(tc.in_channels) + " x " + std::to_string(h) + " x " + std::to_string(w) + "); " +
                      std::to_string(rep.prompts.size()) + " prompts");
  return rep;
}

namespace detail {

// The reward of a flow recipe on the VAE-decoded samples (`image_reward_recipe`).
struct image_reward {
  models::diffusers::sd3_pipeline* pipe = nullptr;
  image_reward_recipe w{};

  torch::Tensor operator()(const flow_rollout& b) {
    torch::NoGradGuard ng;
    const auto dev = pipe->vae->parameters().front().device();
    const auto img = ((pipe->vae->decode_latents(b.samples().to(dev, torch::kFloat)).clamp(-1, 1) + 1) / 2).flatten(1);
    auto r = w.brightness * img.mean(1);
    if (w.contrast != 0.0) r = r + w.contrast * img.std(1, /*unbiased=*/false);
    return r.to(b.samples().device());
  }
};

using flow_model_type = models::flow_model<models::diffusers::sd3_net>;

// The mean reward of deterministic (Euler ODE) samples from fixed noise, `n` per prompt, on the
// sampler's time grid: the same images before and after training, and for an exported pipeline.
inline std::optional<double> eval_reward(flow_model_type& m, image_reward& reward, const flow_recipe& r,
                                         std::int64_t prompts, const std::vector<std::int64_t>& shape,
                                         const torch::Device& dev) {
  if (r.eval_samples == 0) return std::nullopt;
  torch::NoGradGuard ng;
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(r.seed) + 0x5eedULL);
  std::vector<std::int64_t> sizes{prompts * r.eval_samples};
  sizes.insert(sizes.end(), shape.begin(), shape.end());
  const auto noise = torch::randn(sizes, gen, torch::kFloat).to(dev);
  const auto labels = torch::arange(prompts, torch::kInt64).repeat_interleave(r.eval_samples).to(dev);
  const auto& s = r.flow_grpo.sampler;
  const auto b = sample_trajectory(ode::euler({.steps = s.steps, .shift = s.shift}), m, labels, noise);
  return to_host(reward(b).mean()).front();  // the evaluation's one read, counted
}

inline nlohmann::json optional_json(const std::optional<double>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

}  // namespace detail

/// Runs a flow recipe end to end (see the file comment): pre-flight, the pipeline loaded, the
/// reward of ODE samples from fixed noise, Flow-GRPO (LoRA or full), checkpoints under
/// `<out>/checkpoints` (the latest complete one resumes), the reward after, and the export;
/// writes metrics.jsonl, summary.json and report.html under `r.out`. With `stop` the run ends
/// after the step in flight with a checkpoint, `interrupted_by` set, and no evaluation or export.
inline flow_run_result run(const flow_recipe& r, const stop_request* stop = nullptr) {
  namespace df = models::diffusers;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  options::validate(r);
  const auto pf = preflight(r);
  for (const auto& line : pf.lines) std::cout << line << "\n";
  const std::filesystem::path out(r.out);
  if (r.threads > 0) torch::set_num_threads(static_cast<int>(r.threads));
  torch::manual_seed(static_cast<std::uint64_t>(r.seed));
  const auto dev = detail::checked_device(r.device);
  auto stopped = [&] { return stop != nullptr && stop->requested(); };

  flow_run_result res;
  const train::run_directory run_dir(out, {.keep = r.checkpoint.keep});
  if (r.checkpoint.resume) run_dir.remove_temporaries();
  const auto last = r.checkpoint.resume ? run_dir.latest() : std::nullopt;
  // The summary of the invocations this one resumes ({} for a fresh run).
  const nlohmann::json previous = last ? detail::previous_summary(out) : nlohmann::json::object();

  auto pipe = df::load_sd3(r.model, {.allow_missing_t5 = r.allow_missing_t5, .t5_tokens = r.t5_tokens});
  pipe.vae->to(dev);
  const auto n_prompts = static_cast<std::int64_t>(pf.prompts.size());
  auto prompts = std::make_shared<df::sd3_prompts>(pipe, pf.prompts);
  detail::flow_model_type policy(df::sd3_net(pipe.transformer, prompts), pf.latent_shape, {.guidance = r.guidance});
  if (r.lora.rank > 0) lora::apply(*policy.net(), r.lora);

  using trainer_t = trainer<detail::flow_model_type, algo::flow_grpo<>, detail::image_reward>;
  typename trainer_t::options topts{};
  topts.algorithm = r.flow_grpo;
  topts.optim = r.optim;
  topts.schedule = r.schedule;
  topts.clip = r.clip;
  topts.memory = r.memory;
  topts.precision = r.precision;
  topts.group_size = r.group_size;
  topts.seed = r.seed;
  topts.device = r.device;
  topts.metrics_path = (out / "metrics.jsonl").string();
  topts.progress = r.progress;
  topts.total_steps = r.steps;
  trainer_t t{std::move(policy), detail::image_reward{&pipe, r.reward}, topts};
  auto& model = t.models().policy;

  auto summary = [&] {
    const auto prev = [&](const char* k, double fallback) {
      return previous.contains(k) && previous[k].is_number() ? previous[k].get<double>() : fallback;
    };
    return nlohmann::json{{"steps", res.steps_total},
                          {"steps_run", res.steps},
                          {"first_step", res.first_step},
                          {"reward_first", res.reward_first},
                          {"reward_last", res.reward_last},
                          {"eval_reward_before", detail::optional_json(res.eval_reward_before)},
                          {"eval_reward_after", detail::optional_json(res.eval_reward_after)},
                          {"encoder_batches", res.encoder_batches},
                          {"seconds", prev("seconds", 0.0) + res.seconds},
                          {"invocations", static_cast<std::int64_t>(prev("invocations", 0.0)) + 1},
                          {"interrupted", res.interrupted_by != 0},
                          {"export_dir", res.export_dir},
                          {"recipe", options::to_json(r)}};
  };
  auto write_summary = [&] {
    res.seconds = std::chrono::duration<double>(clock::now() - t0).count();
    res.encoder_batches = prompts->encoder_calls();
    const auto tmp = out / "summary.json.tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << summary().dump(2) << "\n";
    }
    std::filesystem::rename(tmp, out / "summary.json");
  };

  // The base model's reward is measured once per run directory.
  if (previous.contains("eval_reward_before") && previous["eval_reward_before"].is_number())
    res.eval_reward_before = previous["eval_reward_before"].get<double>();
  else
    res.eval_reward_before = detail::eval_reward(model, t.reward(), r, n_prompts, pf.latent_shape, dev);

  if (last) {
    t.load(last->path.string());
    res.first_step = t.step_count();
    const auto rows = detail::truncate_metrics(out / "metrics.jsonl", res.first_step);
    if (!rows.empty() && rows.front().contains("reward_mean") && rows.front()["reward_mean"].is_number())
      res.reward_first = rows.front()["reward_mean"].get<double>();
    std::cout << "resumed from " << last->path.filename().string() << " at step " << res.first_step << "\n";
  }
  res.steps_total = t.step_count();
  std::int64_t saved_at = last ? t.step_count() : -1;
  auto save = [&] {
    run_dir.save(t.step_count(), [&](const std::string& path) { t.save(path); });
    saved_at = t.step_count();
    res.checkpoint = run_dir.path_for(saved_at).string();
    write_summary();
  };
  for (std::int64_t step = t.step_count(); step < r.steps && !stopped(); ++step) {
    // Drawn from LibTorch's generator, which a checkpoint carries: a resumed run draws the same.
    const auto conditions = torch::randperm(n_prompts, torch::kInt64).slice(0, 0, r.prompts_per_step);
    const auto st = t.step(conditions);
    if (res.steps == 0 && !last) res.reward_first = st.reward_mean;
    res.reward_last = st.reward_mean;
    ++res.steps;
    res.steps_total = t.step_count();
    if (r.checkpoint.every > 0 && t.step_count() % r.checkpoint.every == 0) save();
  }
  if (r.progress && res.steps > 0) std::cerr << "\n";
  if (res.steps > 0 && saved_at != t.step_count()) save();
  if (stopped()) {
    res.interrupted_by = stop->signal();
    write_summary();
    train::write_report(out);
    return res;
  }
  res.eval_reward_after = detail::eval_reward(model, t.reward(), r, n_prompts, pf.latent_shape, dev);
  if (r.export_dir != "none") {
    res.export_dir = r.export_dir.empty() ? (out / "export").string() : r.export_dir;
    try {
      pipe.transformer->to(torch::kCPU);
      pipe.vae->to(torch::kCPU);
      df::save_sd3(pipe, res.export_dir);  // LoRA merged into the transformer's weights
      if (r.lora.rank > 0) df::save_lora(*model.net(), std::filesystem::path(res.export_dir) / "lora");
    } catch (const std::exception& e) {
      write_summary();  // the training's record survives a failed export
      throw;
    }
  }
  write_summary();
  train::write_report(out);
  return res;
}

}  // namespace unirl::recipes
