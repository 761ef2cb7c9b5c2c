// Per-rank peak model-state bytes and step time of data parallelism, ZeRO-2 and ZeRO-3
// (parallel::data_parallel, parallel::zero stage 2, parallel::fully_sharded) on Qwen2.5-0.5B's
// shapes (benchmarks/common/qwen_shapes.hpp, random weights), SFT steps over Gloo on this
// machine (docs/performance.md). A plain program: it starts its own rank processes.
//   bench_fsdp [--layers 4] [--ranks 2] [--steps 4] [--rows 2] [--tokens 64] [--vocab 151936]
//              [--strategies dp,zero2,zero3]
// Each rank trains on `rows` sequences of `tokens` tokens per step; the first step is a warm-up,
// the others are timed (median). The bytes are the engine's accounting
// (`update_engine::peak_model_state_bytes`: parameters, gradients, AdamW's moments; ZeRO-3 adds the
// blocks it gathers inside the step), beside parallel::estimate_memory's figure from the config alone
// ("on paper", docs/parallel.md#scale-on-paper).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/fully_sharded.hpp>
#include <unirl/parallel/memory_plan.hpp>
#include <unirl/parallel/zero.hpp>
#include <unirl/train/memory.hpp>
#include <unirl/train/sft.hpp>

#include "bench_args.hpp"
#include "qwen_shapes.hpp"

extern char** environ;
namespace fs = std::filesystem;
using lm = unirl::models::hf::causal_lm;
using gloo_dp = unirl::parallel::data_parallel<unirl::parallel::gloo>;

namespace {

struct settings {
  std::int64_t layers = 4, ranks = 2, steps = 4, rows = 2, tokens = 64, vocab = 151936;
  std::vector<std::string> strategies{"dp", "zero2", "zero3"};
};

unirl::train::sft_batch batch(std::int64_t step, int rank, const settings& s) {
  std::mt19937_64 gen(static_cast<std::uint64_t>(1000 * step + rank));
  std::uniform_int_distribution<std::int64_t> id(1, s.vocab - 1);
  std::vector<std::vector<std::int64_t>> prompts, completions;
  for (std::int64_t i = 0; i < s.rows; ++i) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(s.tokens / 2)), c(static_cast<std::size_t>(s.tokens / 2));
    for (auto& x : p) x = id(gen);
    for (auto& x : c) x = id(gen);
    prompts.push_back(p);
    completions.push_back(c);
  }
  return unirl::train::make_sft_batch(prompts, completions, 0);
}

template <class Parallel>
nlohmann::json train(Parallel par, int rank, const settings& s) {
  torch::manual_seed(1);
  auto c = unirl_bench::qwen_shapes(s.layers);
  c.vocab_size = s.vocab;
  c.eos_token_id = {s.vocab - 1};
  lm model(c);
  unirl::train::sft_trainer<lm, Parallel> t(
      std::move(model), {.optim = {.lr = 1e-4}, .batch_size = s.rows, .steps = s.steps, .progress = false},
      std::move(par));
  std::vector<double> ms;
  for (std::int64_t k = 0; k < s.steps; ++k) {
    const auto b = batch(k, rank, s);
    const auto t0 = std::chrono::steady_clock::now();
    t.step(b);
    if (k > 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::int64_t params = 0;
  for (const auto& p : t.model().parameters()) params += p.numel();
  return {{"peak_model_state_bytes", t.engine().peak_model_state_bytes()},
          {"optimizer_state_bytes", t.engine().optimizer_state_bytes()},
          {"step_ms", ms.empty() ? 0.0 : ms[ms.size() / 2]},
          {"peak_rss_bytes", unirl::train::peak_resident_bytes()},
          {"parameters", params}};
}

int child(const std::string& strategy, int rank, const std::string& store, const std::string& out, const settings& s) {
  const int world = static_cast<int>(s.ranks);
  const unirl::parallel::rendezvous r{.file_path = store, .interface_host = "127.0.0.1",
                                      .timeout = std::chrono::minutes(10)};
  torch::set_num_threads(1);  // one core per rank
  nlohmann::json res;
  if (strategy == "dp") res = train(gloo_dp(rank, world, r), rank, s);
  else if (strategy == "zero2")
    res = train(unirl::parallel::zero<unirl::parallel::gloo>(gloo_dp(rank, world, r), {.stage = 2}), rank, s);
  else if (strategy == "zero3")
    res = train(unirl::parallel::fully_sharded<unirl::parallel::gloo>(gloo_dp(rank, world, r)), rank, s);
  else {
    std::cerr << "bench_fsdp: strategy '" << strategy << "': expected dp, zero2 or zero3\n";
    return 2;
  }
  std::ofstream(out + "." + std::to_string(rank) + ".json") << res.dump();
  return 0;
}

std::vector<std::string> flags_of(const settings& s) {
  return {"--layers", std::to_string(s.layers), "--ranks", std::to_string(s.ranks), "--steps", std::to_string(s.steps),
          "--rows", std::to_string(s.rows), "--tokens", std::to_string(s.tokens), "--vocab", std::to_string(s.vocab)};
}

// Every rank of `strategy` as a process of this program; their results.
std::vector<nlohmann::json> run(const std::string& self, const std::string& strategy, const settings& s) {
  const auto dir = fs::temp_directory_path() / ("unirl-bench-fsdp-" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  std::vector<pid_t> pids;
  for (int r = 0; r < s.ranks; ++r) {
    std::vector<std::string> args{self, "--child", strategy, std::to_string(r), (dir / "store").string(), (dir / "out").string()};
    for (const auto& f : flags_of(s)) args.push_back(f);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
      std::cerr << "bench_fsdp: cannot start '" << self << "'\n";
      std::exit(1);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (auto pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  std::vector<nlohmann::json> out;
  if (ok)
    for (int r = 0; r < s.ranks; ++r) out.push_back(nlohmann::json::parse(std::ifstream(dir / ("out." + std::to_string(r) + ".json"))));
  fs::remove_all(dir);
  if (!ok) {
    std::cerr << "bench_fsdp: a rank of " << strategy << " failed\n";
    std::exit(1);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  settings s;
  std::string child_strategy, store, out;
  int child_rank = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("flag " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--layers") s.layers = std::stoll(next());
    else if (a == "--ranks") s.ranks = std::stoll(next());
    else if (a == "--steps") s.steps = std::stoll(next());
    else if (a == "--rows") s.rows = std::stoll(next());
    else if (a == "--tokens") s.tokens = std::stoll(next());
    else if (a == "--vocab") s.vocab = std::stoll(next());
    else if (a == "--strategies") s.strategies = unirl_bench::split(next(), ',');
    else if (a == "--child") {
      child_strategy = next();
      child_rank = std::stoi(next());
      store = next();
      out = next();
    } else throw std::runtime_error("unknown flag '" + a + "'");
  }
  if (s.layers < 1 || s.ranks < 1 || s.steps < 2 || s.rows < 1 || s.tokens < 2 || s.vocab < 2)
    throw std::runtime_error("expected --layers >= 1, --ranks >= 1, --steps >= 2, --rows >= 1, --tokens >= 2, --vocab >= 2");
  if (child_rank >= 0) return child(child_strategy, child_rank, store, out, s);
  const std::string self = fs::canonical("/proc/self/exe").string();
  std::cout << "Qwen2.5-0.5B shapes, " << s.layers << " layers, vocabulary " << s.vocab << ", " << s.ranks << " ranks over Gloo, " << s.rows << " x "
            << s.tokens << " tokens per rank and step, median of " << s.steps - 1 << " steps\n\n"
            << "| strategy | peak model state / rank | on paper | vs dp | AdamW state / rank | step | vs zero2 | peak RSS / rank |\n"
            << "|---|---|---|---|---|---|---|---|\n";
  auto shapes = unirl_bench::qwen_shapes(s.layers);
  shapes.vocab_size = s.vocab;
  shapes.eos_token_id = {s.vocab - 1};
  std::map<std::string, double> bytes, ms;
  for (const auto& st : s.strategies) {
    const auto res = run(self, st, s);
    double b = 0, t = 0, rss = 0, opt = 0;
    for (const auto& r : res) {
      b = std::max(b, r["peak_model_state_bytes"].get<double>());
      opt = std::max(opt, r["optimizer_state_bytes"].get<double>());
      t = std::max(t, r["step_ms"].get<double>());
      rss = std::max(rss, r["peak_rss_bytes"].get<double>());
    }
    bytes[st] = b;
    ms[st] = t;
    namespace up = unirl::parallel;
    double paper = 0;  // the largest over the ranks, as the measured column
    for (std::int64_t r = 0; r < s.ranks; ++r)
      paper = std::max(paper, static_cast<double>(up::estimate_memory(shapes, {.strategy = up::parse_sharding(st),
                                                                              .ranks = s.ranks, .rank = r}).engine_model_state));
    char line[512];
    std::snprintf(line, sizeof line, "| %s | %.1f MB | %.1f MB | %s | %.1f MB | %.0f ms | %s | %.0f MB |\n", st.c_str(), b / 1e6, paper / 1e6,
                  bytes.count("dp") ? (std::to_string(b / bytes["dp"]).substr(0, 4) + "x").c_str() : "-", opt / 1e6, t,
                  ms.count("zero2") ? (std::to_string(t / ms["zero2"]).substr(0, 4) + "x").c_str() : "-", rss / 1e6);
    std::cout << line << std::flush;
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_fsdp: " << e.what() << "\n";
  return 1;
}
