#pragma once
// Shared by the environment examples (10_cartpole_ppo, 11_pendulum_ppo): the command line
// (--exec, --total-steps, --seed, --num-envs, --out, --save, --resume, key=value trainer options), the
// training loop with its progress lines and checkpoints (model and environments in one file),
// and summary.json.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <ostream>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/core/command_line.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/train/report.hpp>

namespace examples {

/// The value of `--NAME V` or `--NAME=V` on the command line (the last one), else `fallback`:
/// for a flag read before the rest is parsed (it chooses a type or a preset).
inline std::string flag_value(int argc, char** argv, const std::string& name, std::string fallback) {
  const std::string flag = "--" + name;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == flag && i + 1 < argc) fallback = argv[i + 1];
    else if (a.starts_with(flag + "=")) fallback = a.substr(flag.size() + 1);
  }
  return fallback;
}

/// The value of `--exec automatic|reference` (default automatic), read before the agent's type
/// is chosen; anything else throws naming the value.
inline std::string exec_flag(int argc, char** argv) {
  const std::string exec = flag_value(argc, argv, "exec", "automatic");
  if (exec != "automatic" && exec != "reference")
    throw unirl::config_error("--exec", "value '" + exec + "': expected automatic (the small-network kernels for a "
                                        "small actor-critic) or reference (LibTorch)");
  return exec;
}

/// What the command line of an environment example sets besides the trainer options.
struct env_run {
  std::int64_t total_env_steps = 0;
  std::int64_t seed = 0;
  std::int64_t num_envs = 1;
  std::string out;
  std::int64_t iterations = 0;  // total_env_steps / (num_envs * rollout_steps)
  std::string save;             // --save PATH: checkpoint (trainer + vector_env) at each report and at the end
  std::string resume;           // --resume PATH: continue the run a --save checkpoint holds
};

/// Parses `[--total-steps N] [--seed S] [--num-envs N] [--out DIR] [--save PATH] [--resume PATH]
/// [key=value ...]` (key=value
/// overrides the trainer options `opts`; `extra_flags` are further flags the example reads
/// itself, with their defaults), runs LibTorch on one thread (tiny networks: fastest, as in CleanRL's
/// runs), and fits `opts` to the run: its seed, `total_steps` = the iterations (schedules anneal
/// over the whole run), metrics in `<out>/metrics.jsonl` (the folder is created).
/// ```cpp
/// auto run = examples::parse_env_run(opts, argc, argv, {.total_env_steps = 500000, .seed = 2, .num_envs = 4,
///                                                       .out = "runs/cartpole_ppo"});
/// ```
template <class TrainerOptions>
env_run parse_env_run(TrainerOptions& opts, int argc, char** argv, env_run defaults,
                      std::map<std::string, std::string> extra_flags = {}) {
  auto known = std::move(extra_flags);
  known.insert({{"total-steps", std::to_string(defaults.total_env_steps)},
                {"seed", std::to_string(defaults.seed)},
                {"num-envs", std::to_string(defaults.num_envs)},
                {"out", defaults.out},
                {"save", defaults.save},
                {"resume", defaults.resume}});
  auto parsed = unirl::options::parse_command_line(opts, argc, argv, known);
  env_run r;
  r.total_env_steps = unirl::options::parse_value<std::int64_t>("--total-steps", parsed["total-steps"]);
  r.seed = unirl::options::parse_value<std::int64_t>("--seed", parsed["seed"]);
  r.num_envs = unirl::options::parse_value<std::int64_t>("--num-envs", parsed["num-envs"]);
  r.out = parsed["out"];
  r.save = parsed["save"];
  r.resume = parsed["resume"];
  torch::set_num_threads(1);

  r.iterations = r.total_env_steps / (r.num_envs * opts.algorithm.track.rollout_steps);
  opts.seed = r.seed;
  opts.total_steps = r.iterations;
  std::filesystem::create_directories(r.out);
  opts.metrics_path = r.out + "/metrics.jsonl";
  return r;
}

/// Runs the trainer on `venv` up to `run.iterations` steps; every `every` iterations and after the
/// last prints `iteration i/N  env_steps ..  mean_return(last 20) ..` followed by what
/// `report(os, stats)` writes. With `run.resume` it first loads that checkpoint into the trainer
/// and `venv` (and continues from its iteration); with `run.save` it checkpoints both at each
/// report. Returns the seconds the loop took.
template <class Trainer, class VectorEnv, class Report>
double train_env(Trainer& t, VectorEnv& venv, const env_run& run, std::int64_t every, Report&& report) {
  if (!run.resume.empty()) {
    t.load(run.resume, venv);
    std::cout << "resumed from " << run.resume << " at iteration " << t.step_count() << std::endl;
  }
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t it = t.step_count(); it < run.iterations; ++it) {
    const auto s = t.step(venv);
    if ((it + 1) % every == 0 || it + 1 == run.iterations) {
      std::cout << "iteration " << it + 1 << "/" << run.iterations << "  env_steps " << venv.env_steps()
                << "  mean_return(last 20) " << venv.mean_recent_return(20);
      report(std::cout, s);
      std::cout << std::endl;
      if (!run.save.empty()) t.save(run.save, venv);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Writes `<out>/summary.json` (and the run report, `<out>/report.html`) and prints it: `env`, `algorithm` ("ppo"), the seed, the mean
/// return of the last 20 episodes, the episode and step counts, the seconds and the steps per
/// second, and `extra`.
template <class VectorEnv>
void write_env_summary(const env_run& run, const std::string& env, const VectorEnv& venv, double seconds,
                       nlohmann::json extra = nlohmann::json::object()) {
  extra.update(nlohmann::json{{"env", env},
                              {"algorithm", "ppo"},
                              {"seed", run.seed},
                              {"final_mean_return", venv.mean_recent_return(20)},
                              {"episodes", venv.episodes().size()},
                              {"env_steps", venv.env_steps()},
                              {"seconds", seconds},
                              {"steps_per_second", static_cast<double>(venv.env_steps()) / seconds}});
  std::ofstream(run.out + "/summary.json") << extra.dump(2) << "\n";
  unirl::train::write_report(run.out);
  std::cout << extra.dump(2) << std::endl;
}

}  // namespace examples
