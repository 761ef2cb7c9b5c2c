#pragma once
// The quickstart's stage 2 data-parallel over PyTorch's c10d (Gloo), from torchrun's variables
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with optional PowerSGD compression and sharded
// optimizer state (docs/parallel.md, "Sharded optimizer and gradient compression"):
//
//   quickstart --out runs/qs pretrained=runs/gpt.pt                       # once: writes the weights
//   for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
//     quickstart data_parallel=true compression=powersgd powersgd_rank=2 --out runs/qs_dp$r \
//       pretrained=runs/gpt.pt & done; wait
//
// Every rank pretrains (or loads `pretrained`) the same way, then runs GRPO: each step every rank
// draws the single-process run's prompts_per_step problems and keeps its slice of them (so the
// total batch is the single-process one), samples and scores its slice, and the gradients are
// averaged across ranks (plainly, or with PowerSGD after `start_iter` steps). Rank 0 writes
// metrics.jsonl and summary.json (with the parallel settings) in --out.
//
// Keys taken off the command line here (not quickstart_options): data_parallel=true|false,
// compression=none|powersgd, powersgd_rank=N, start_iter=N, zero_stage=0|1|2.
// Included by main.cpp after its helpers (task, problem, accuracy, quickstart_options).
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/zero.hpp>

namespace quickstart_dp {

struct dp_mode {
  bool on = false;
  unirl::parallel::data_parallel_options dp{};
  std::int64_t zero_stage = 0;
};

/// Removes this mode's keys from the command line (argc shrinks) and returns them.
inline dp_mode take_options(int& argc, char** argv) {
  dp_mode m;
  int kept = 1;
  auto integer = [](const std::string& key, const std::string& v) {
    try {
      std::size_t used = 0;
      const auto n = std::stoll(v, &used);
      if (used == v.size()) return static_cast<std::int64_t>(n);
    } catch (const std::exception&) {
    }
    throw unirl::config_error(key, "value '" + v + "': expected an integer");
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    const std::string key = eq == std::string::npos ? a : a.substr(0, eq), v = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "data_parallel") {
      if (v != "true" && v != "false") throw unirl::config_error(key, "value '" + v + "': expected true or false");
      m.on = v == "true";
    } else if (key == "compression") {
      if (v == "none") m.dp.compression = unirl::parallel::gradient_compression::none;
      else if (v == "powersgd") m.dp.compression = unirl::parallel::gradient_compression::powersgd;
      else throw unirl::config_error(key, "value '" + v + "': expected none or powersgd");
    } else if (key == "powersgd_rank") {
      m.dp.powersgd.rank = integer(key, v);
    } else if (key == "start_iter") {
      m.dp.powersgd.start_iter = integer(key, v);
    } else if (key == "zero_stage") {
      m.zero_stage = integer(key, v);
      if (m.zero_stage < 0 || m.zero_stage > 2) throw unirl::config_error(key, "value '" + v + "': expected 0, 1 or 2");
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  m.dp.validate("");
  return m;
}

struct stage1 {
  double acc_before = 0;
  std::int64_t pre_steps = 0;
  double pretrain_seconds = 0;
  std::chrono::steady_clock::time_point t_start;
};

template <class Strategy>
int learn_with(Strategy par, const dp_mode& m, const quickstart_options& o, task& t, unirl::models::gpt model,
               const std::string& out, const stage1& s1) {
  using clock = std::chrono::steady_clock;
  const int rank = par.rank(), world = par.world_size();
  reward_t reward = stage2_reward(o);
  unirl::trainer<unirl::models::gpt, unirl::algo::grpo<>, reward_t, Strategy> trainer{
      model, reward, stage2_options(o, t, (std::filesystem::path(out) / "metrics.jsonl").string(), rank == 0),
      std::move(par)};
  UNIRL_CHECK(o.prompts_per_step >= world, "data_parallel=true: prompts_per_step = ", o.prompts_per_step, " over ",
              world, " ranks: expected at least one prompt per rank");
  if (rank == 0)
    std::cout << "stage 2: GRPO data-parallel over " << world << " ranks, compression "
              << unirl::enum_to_string(m.dp.compression) << ", zero_stage " << m.zero_stage << ", "
              << o.prompts_per_step << " prompts per step in total\n";
  const auto t_rl = clock::now();
  std::int64_t steps = 0;
  for (; steps < o.rl_steps; ++steps) {
    // Every rank agrees on stopping (the time limit is rank 0's clock).
    if (!trainer.parallel().all_agree(std::chrono::duration<double>(clock::now() - t_rl).count() < o.rl_seconds ||
                                      rank != 0))
      break;
    std::vector<problem> all, mine;
    for (std::int64_t i = 0; i < o.prompts_per_step; ++i) all.push_back(t.draw_train());
    const std::int64_t lo = rank * o.prompts_per_step / world, hi = (rank + 1) * o.prompts_per_step / world;
    mine.assign(all.begin() + lo, all.begin() + hi);
    trainer.step(t.prompts(mine));
  }
  const double rl_seconds = std::chrono::duration<double>(clock::now() - t_rl).count();
  std::int64_t state_bytes = 0;  // AdamW moments this rank really holds
  for (const auto& [key, st] : trainer.optimizer().torch_optimizer().state()) {
    (void)key;
    const auto& a = static_cast<const torch::optim::AdamWParamState&>(*st);
    for (const auto& x : {a.exp_avg(), a.exp_avg_sq(), a.max_exp_avg_sq()})
      if (x.defined()) state_bytes += x.numel() * static_cast<std::int64_t>(x.element_size());
  }
  if (rank != 0) return 0;
  trainer.models().policy.train(false);
  const double acc_after = accuracy(trainer.models().policy, t);
  const double seconds = std::chrono::duration<double>(clock::now() - s1.t_start).count();
  std::cerr << "\n";
  std::cout << "held-out accuracy: " << std::setprecision(1) << 100 * s1.acc_before << "% -> " << 100 * acc_after
            << "% after " << steps << " GRPO steps (" << std::setprecision(0) << rl_seconds << " s RL, " << seconds
            << " s total)\n";
  nlohmann::json summary{{"accuracy_before", s1.acc_before}, {"accuracy_after", acc_after},
                         {"steps", steps},                   {"pretrain_steps", s1.pre_steps},
                         {"seconds", seconds},               {"pretrain_seconds", s1.pretrain_seconds},
                         {"rl_seconds", rl_seconds},         {"options", unirl::options::to_json(o)},
                         {"parallel", {{"world_size", world},
                                       {"compression", unirl::enum_to_string(m.dp.compression)},
                                       {"powersgd_rank", m.dp.powersgd.rank},
                                       {"start_iter", m.dp.powersgd.start_iter},
                                       {"zero_stage", m.zero_stage},
                                       {"optimizer_state_bytes_rank0", state_bytes}}}};
  std::ofstream(std::filesystem::path(out) / "summary.json") << summary.dump(2) << "\n";
  unirl::train::write_report(out);
  std::cout << "wrote " << out << "/metrics.jsonl, samples.jsonl, summary.json, report.html\n";
  return 0;
}

/// Stage 2 on every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment).
inline int learn(const dp_mode& m, const quickstart_options& o, task& t, unirl::models::gpt model, const std::string& out,
                 const stage1& s1) {
  namespace par = unirl::parallel;
  const char* addr = std::getenv("MASTER_ADDR");
  const bool loopback = addr && (std::string(addr) == "127.0.0.1" || std::string(addr) == "localhost");
  const par::rendezvous r{.interface_host = loopback ? "127.0.0.1" : ""};  // else: this machine's hostname
  auto dp = par::data_parallel<par::gloo>::from_environment(r, m.dp);
  if (m.zero_stage == 0) return learn_with(std::move(dp), m, o, t, std::move(model), out, s1);
  return learn_with(par::zero<par::gloo>(std::move(dp), {.stage = m.zero_stage}), m, o, t, std::move(model), out, s1);
}

}  // namespace quickstart_dp
