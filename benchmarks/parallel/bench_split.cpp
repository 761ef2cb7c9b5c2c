// bench_split: samples/s of the learner / sampler split against the colocated trainer, with a
// reward service that takes as long as sampling (docs/performance.md, "Learner / sampler split:
// samples/s"). Not a Google Benchmark program: it starts its own processes.
//
//   bench_split                                  # every configuration, one table
//   bench_split steps=60 warmup=10 prompts=16 group_size=8 samplers=2 delay_ms=0 threads=1
//
// The parent process measures the sampling time of one batch (`prompts` x `group_size` samples
// of the quickstart's character GPT, random weights, `threads` LibTorch threads), starts a real
// HTTP reward service (rewards::reward_server) whose reward — the quickstart's exact answer +
// format — sleeps that long per request (`delay_ms` > 0 sets it instead), then runs each
// configuration as processes of this program (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
//   colocated            one process, trainer.step scoring with a remote_scorer (synchronously)
//   sync split           1 learner + `samplers` samplers, max_staleness 0 (each sampler draws
//                        prompts / samplers prompts; a step gathers one batch from each)
//   async split k        max_staleness k = 1, 2 (each batch has `prompts` prompts; a step takes one)
// each split mode with and without worker_options::overlap_scoring, and async k=2 with a single
// sampler (a core each for learner and sampler) with and without overlap. samples/s: samples
// trained per second of the learner's wall time over steps warmup..steps; `repeats` interleaved
// rounds, medians in the table.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/core/command_line.hpp>
#include <unirl/models/char_tokenizer.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/parallel/c10d_transport.hpp>
#include <unirl/parallel/colocated.hpp>
#include <unirl/parallel/rollout_worker.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/server.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/trainer.hpp>

#include "common/addition.hpp"

extern char** environ;
namespace fs = std::filesystem;

struct bench_options {
  std::int64_t steps = 60;       // learner steps per configuration
  std::int64_t warmup = 10;      // steps not timed
  std::int64_t prompts = 16;     // prompts per learner step (the quickstart's prompts_per_step)
  std::int64_t group_size = 8;
  std::int64_t samplers = 2;
  double delay_ms = 0;           // the reward service's delay per request; 0: the measured sampling time
  std::int64_t threads = 1;      // LibTorch intra-op threads per process
  std::int64_t seed = 0;
  double timeout_s = 600;        // per configuration; its processes are killed after that
  std::int64_t repeats = 3;      // rounds over every configuration (interleaved); the table shows medians
};
BOOST_HANA_ADAPT_STRUCT(bench_options, steps, warmup, prompts, group_size, samplers, delay_ms, threads, seed, timeout_s,
                        repeats);

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

using reward_t = unirl::rewards::weighted<unirl::rewards::exact_answer, unirl::rewards::regex_format>;
reward_t make_reward() {
  return reward_t{{.weights = {1.0, 0.1}}, unirl::rewards::exact_answer{},
                  unirl::rewards::regex_format{{.pattern = R"(\d{1,3})"}}};
}

// The service's reward: the quickstart's, after a fixed delay (a slow reward model's stand-in).
struct delayed_reward {
  reward_t r = make_reward();
  std::chrono::microseconds delay{0};
  torch::Tensor operator()(const unirl::rewards::json_batch& b) {
    std::this_thread::sleep_for(delay);
    return r(b);
  }
};

struct task : examples::addition_task {
  unirl::models::char_tokenizer tok{"0123456789+=."};
  using addition_task::addition_task;
  unirl::prompt_batch prompts(std::int64_t n) {
    unirl::prompt_batch in{.decode = tok.decoder(), .pad_id = tok.pad_id()};
    for (std::int64_t i = 0; i < n; ++i) {
      const auto p = draw_train();
      in.tokens.push_back(tok.encode(p.question() + "="));
      in.texts.push_back(p.question() + "=");
      in.references.push_back(p.answer());
    }
    return in;
  }
};

unirl::models::gpt make_model(const task& t) {
  return unirl::models::gpt(
      unirl::models::gpt_options{.vocab_size = t.tok.vocab_size(), .max_len = 16, .n_layer = 2, .n_head = 4, .d_model = 64});
}

using algo_t = unirl::algo::grpo<>;
unirl::trainer_options<algo_t> rl_options(const bench_options& o, const task& t) {
  return {.algorithm = {.clip_high = 0.28,
                        .agg = unirl::algo::loss_agg::token_mean,
                        .advantage = unirl::algo::advantage_kind::dr_grpo,
                        .sampling = {.max_new_tokens = 5, .temperature = 1.0, .stop_tokens = {t.tok.id('.')}}},
          .optim = {.lr = 3e-4},
          .group_size = o.group_size,
          .seed = o.seed,
          .progress = false};
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// The learner's transport, timing its waits for batches (pop) and its weight publishes.
template <class Tr, class Batch>
struct timed_transport {
  Tr* tr;
  double pop_s = 0, publish_s = 0;
  std::int64_t max_staleness() const { return tr->max_staleness(); }
  void publish(const std::vector<torch::Tensor>& w, std::int64_t v) {
    const auto t0 = clock_type::now();
    tr->publish(w, v);
    publish_s += since(t0);
  }
  std::int64_t fetch(const std::vector<torch::Tensor>& w, std::int64_t have, std::int64_t wait_for) {
    return tr->fetch(w, have, wait_for);
  }
  bool push(unirl::versioned_batch<Batch> b) { return tr->push(std::move(b)); }
  std::optional<unirl::versioned_batch<Batch>> pop(std::int64_t current) {
    const auto t0 = clock_type::now();
    auto b = tr->pop(current);
    pop_s += since(t0);
    return b;
  }
  void finish() { tr->finish(); }
};

// ---- the processes of one configuration ----

// Colocated: trainer.step with the remote reward (scored synchronously inside the step).
nlohmann::json run_colocated(const bench_options& o, const std::string& url) {
  task t(99, 400, static_cast<std::uint64_t>(o.seed) * 7919 + 17);
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));
  unirl::trainer<unirl::models::gpt, algo_t, unirl::rewards::remote_scorer> tr{
      make_model(t), unirl::rewards::remote_scorer{{.url = url, .timeout_s = 60}}, rl_options(o, t)};
  clock_type::time_point t0;
  for (std::int64_t s = 0; s < o.steps; ++s) {
    if (s == o.warmup) t0 = clock_type::now();
    tr.step(t.prompts(o.prompts));
  }
  const double sec = since(t0);
  return {{"seconds", sec},
          {"samples_per_s", static_cast<double>((o.steps - o.warmup) * o.prompts * o.group_size) / sec},
          {"step_ms", 1000 * sec / static_cast<double>(o.steps - o.warmup)}};
}

// One rank of a split run: rank 0 learns, the others sample and score through the service.
nlohmann::json run_split(const bench_options& o, const std::string& url, std::int64_t max_staleness, bool overlap) {
  using batch_t = unirl::rollout_t<unirl::models::gpt>;
  using tr_t = unirl::parallel::c10d_transport<batch_t>;
  auto tr = tr_t::from_environment({.rdzv = {.interface_host = "127.0.0.1", .timeout = std::chrono::seconds(120)},
                                    .max_staleness = max_staleness});
  const bool sync = max_staleness == 0;
  const std::int64_t stream = tr.rank() - 1;
  task t(99, 400, static_cast<std::uint64_t>(o.seed) * 7919 + 17 + static_cast<std::uint64_t>(tr.rank()));
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));
  if (tr.is_learner()) {
    unirl::trainer<unirl::models::gpt, algo_t, unirl::rewards::remote_scorer> trainer{
        make_model(t), unirl::rewards::remote_scorer{{.url = url}}, rl_options(o, t)};
    timed_transport<tr_t, batch_t> timed{&tr};
    unirl::parallel::learner l{trainer, timed};
    clock_type::time_point t0;
    double staleness = 0;
    for (std::int64_t s = 0; s < o.steps; ++s) {
      if (s == o.warmup) {
        t0 = clock_type::now();
        timed.pop_s = timed.publish_s = 0;
      }
      const auto st = l.step(sync ? tr.samplers() : 1);
      if (!st) throw std::runtime_error("the samplers stopped early");
      if (s >= o.warmup) staleness += st->extra.at("staleness");
    }
    const double sec = since(t0);
    l.finish();
    const auto n = o.steps - o.warmup;
    const double per_step = 1000.0 / static_cast<double>(n);
    return {{"seconds", sec},
            {"samples_per_s", static_cast<double>(n * o.prompts * o.group_size) / sec},
            {"step_ms", sec * per_step},
            {"wait_ms", timed.pop_s * per_step},
            {"publish_ms", timed.publish_s * per_step},
            {"mean_staleness", staleness / static_cast<double>(n)},
            {"dropped", tr.dropped()}};
  }
  UNIRL_CHECK(!sync || o.prompts % tr.samplers() == 0, "bench_split: prompts = ", o.prompts, " with ", tr.samplers(),
              " samplers: expected a multiple (a synchronous step gathers one batch from every sampler)");
  const std::int64_t per = sync ? o.prompts / tr.samplers() : o.prompts;
  unirl::parallel::rollout_worker<unirl::models::gpt, algo_t, unirl::rewards::remote_scorer, tr_t> w(
      make_model(t), unirl::rewards::remote_scorer{{.url = url, .timeout_s = 60}}, rl_options(o, t), tr, stream,
      {.overlap_scoring = overlap});
  while (w.run_once(t.prompts(per))) {
  }
  return {{"batches", w.batches()}};
}

// ---- the parent ----

// The time one rollout_worker takes to sample (and score locally, ~0) one batch of the step's size.
double measure_sampling_ms(const bench_options& o) {
  task t(99, 400, static_cast<std::uint64_t>(o.seed) * 7919 + 17);
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));
  using batch_t = unirl::rollout_t<unirl::models::gpt>;
  unirl::parallel::colocated_transport<batch_t> tr({.max_staleness = 1});
  auto model = make_model(t);
  tr.publish(unirl::parallel::policy_state(model), 0);
  unirl::parallel::rollout_worker<unirl::models::gpt, algo_t, reward_t, decltype(tr)> w(make_model(t), make_reward(),
                                                                                        rl_options(o, t), tr);
  double total = 0;
  const int warm = 3, timed = 10;
  for (int i = 0; i < warm + timed; ++i) {
    const auto in = t.prompts(o.prompts);
    const auto t0 = clock_type::now();
    w.run_once(in);
    if (i >= warm) total += since(t0);
    (void)tr.pop(0);
  }
  return 1000 * total / timed;
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  UNIRL_CHECK(fd >= 0, "bench_split: socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  UNIRL_CHECK(ok, "bench_split: no free port");
  return ntohs(a.sin_port);
}

// The 1-minute load average (other work on the machine skews the figures: print it).
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return one.empty() ? "?" : one;
}

// Runs `world` processes of this program in `role`; returns rank 0's result.
nlohmann::json run_config(const bench_options& o, const std::vector<std::string>& args, const std::string& role,
                          int world, const std::string& url, std::int64_t max_staleness, bool overlap) {
  const auto dir = fs::temp_directory_path() / ("unirl-bench-split-" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  const int port = free_port();
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv_text{self};
    argv_text.insert(argv_text.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_text) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_text;
    for (char** e = environ; *e; ++e) {
      const std::string v = *e;
      if (v.rfind("RANK=", 0) == 0 || v.rfind("WORLD_SIZE=", 0) == 0 || v.rfind("MASTER_", 0) == 0 ||
          v.rfind("UNIRL_BENCH_", 0) == 0)
        continue;
      env_text.push_back(v);
    }
    for (const std::string& v :
         {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world), std::string("MASTER_ADDR=127.0.0.1"),
          "MASTER_PORT=" + std::to_string(port), "UNIRL_BENCH_ROLE=" + role, "UNIRL_BENCH_URL=" + url,
          "UNIRL_BENCH_STALENESS=" + std::to_string(max_staleness), std::string("UNIRL_BENCH_OVERLAP=") + (overlap ? "1" : "0"),
          "UNIRL_BENCH_OUT=" + (dir / ("out." + std::to_string(r) + ".json")).string()})
      env_text.push_back(v);
    std::vector<char*> envp;
    for (auto& e : env_text) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    UNIRL_CHECK(posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), envp.data()) == 0,
                "bench_split: could not start ", self);
    pids.push_back(pid);
  }
  const auto deadline = clock_type::now() + std::chrono::duration<double>(o.timeout_s);
  std::vector<int> status(pids.size(), -1);
  for (std::size_t done = 0; done < pids.size();) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      int st = 0;
      if (status[i] == -1 && waitpid(pids[i], &st, WNOHANG) == pids[i]) status[i] = st, ++done;
    }
    if (clock_type::now() > deadline) {
      for (std::size_t i = 0; i < pids.size(); ++i)
        if (status[i] == -1) kill(pids[i], SIGKILL), waitpid(pids[i], nullptr, 0);
      fs::remove_all(dir);
      throw std::runtime_error("bench_split: " + role + " did not finish within timeout_s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (std::size_t i = 0; i < pids.size(); ++i)
    UNIRL_CHECK(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0, "bench_split: ", role, " rank ", i,
                " failed (status ", status[i], ")");
  std::ifstream in(dir / "out.0.json");
  auto out = nlohmann::json::parse(in);
  fs::remove_all(dir);
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  bench_options o;
  const auto flags = unirl::options::parse_command_line(o, argc, argv, {{"help", "false"}});
  if (flags.at("help") == "true") {
    std::cout << "usage: bench_split [key=value ...]\n" << unirl::options::to_string(o);
    return 0;
  }
  UNIRL_CHECK(o.warmup >= 0 && o.steps > o.warmup, "bench_split: steps = ", o.steps, ", warmup = ", o.warmup,
              ": expected steps > warmup >= 0");
  UNIRL_CHECK(o.samplers >= 1, "bench_split: samplers = ", o.samplers, ": expected >= 1");
  UNIRL_CHECK(o.repeats >= 1, "bench_split: repeats = ", o.repeats, ": expected >= 1");
  torch::set_num_threads(static_cast<int>(std::max<std::int64_t>(1, o.threads)));

  const std::string role = env_or("UNIRL_BENCH_ROLE", "");
  if (!role.empty()) {  // a child
    const std::string url = env_or("UNIRL_BENCH_URL", "");
    const nlohmann::json out = role == "colocated"
                                   ? run_colocated(o, url)
                                   : run_split(o, url, std::stoll(env_or("UNIRL_BENCH_STALENESS", "0")),
                                               env_or("UNIRL_BENCH_OVERLAP", "0") == "1");
    std::ofstream(env_or("UNIRL_BENCH_OUT", "/dev/null")) << out.dump();
    return 0;
  }

  std::vector<std::string> args(argv + 1, argv + argc);
  const double sampling_ms = measure_sampling_ms(o);
  const double delay_ms = o.delay_ms > 0 ? o.delay_ms : sampling_ms;
  unirl::rewards::reward_server server(
      delayed_reward{.delay = std::chrono::microseconds(static_cast<std::int64_t>(delay_ms * 1000))},
      {.port = 0, .threads = 2 * (o.samplers + 1)});
  server.start();
  std::cout << "bench_split";
  for (const auto& a : args) std::cout << " " << a;
  std::cout << "\n" << std::fixed << std::setprecision(1) << "sampling one batch of " << o.prompts << " x " << o.group_size
            << " samples: " << sampling_ms << " ms; reward service delay " << delay_ms << " ms per request ("
            << server.url() << ")\n"
            << "1 learner + " << o.samplers << " samplers, " << o.threads << " LibTorch thread(s) per process, "
            << std::thread::hardware_concurrency() << " hardware threads (load average " << load_average() << "); " << o.steps - o.warmup << " timed steps of "
            << o.prompts * o.group_size << " samples after " << o.warmup << " warm-up steps\n";

  struct config {
    std::string name, role;
    std::int64_t max_staleness;
    bool overlap;
    std::int64_t samplers = 0;  // 0: o.samplers
  };
  const std::vector<config> configs{{"colocated (trainer.step)", "colocated", 0, false},
                                    {"sync split", "split", 0, false},
                                    {"sync split + overlap", "split", 0, true},
                                    {"async split k=1", "split", 1, false},
                                    {"async split k=1 + overlap", "split", 1, true},
                                    {"async split k=2", "split", 2, false},
                                    {"async split k=2 + overlap", "split", 2, true},
                                    // one sampler: a core each for the learner and the sampler
                                    {"async split k=2, 1 sampler", "split", 2, false, 1},
                                    {"async split k=2, 1 sampler + overlap", "split", 2, true, 1}};
  // Rounds over every configuration, interleaved, so that a change in the machine's other load
  // touches every mode alike; the table shows each mode's median and every round's figure.
  std::vector<std::vector<nlohmann::json>> got(configs.size());
  for (std::int64_t round = 0; round < o.repeats; ++round)
    for (std::size_t i = 0; i < configs.size(); ++i) {
      const auto& c = configs[i];
      const int world = c.role == "colocated" ? 1 : static_cast<int>((c.samplers > 0 ? c.samplers : o.samplers) + 1);
      auto r = run_config(o, args, c.role, world, server.url(), c.max_staleness, c.overlap);
      r["mode"] = c.name;
      r["round"] = round;
      got[i].push_back(r);
      std::cerr << "round " << round << ": " << c.name << ": " << r.at("samples_per_s").get<double>() << " samples/s\n";
    }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const auto n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  };
  auto median_of = [&](const std::vector<nlohmann::json>& rs, const char* key) {
    std::vector<double> v;
    for (const auto& r : rs)
      if (r.contains(key)) v.push_back(r[key].get<double>());
    return v.empty() ? 0.0 : median(v);
  };
  const double colocated = median_of(got[0], "samples_per_s");
  nlohmann::json all = nlohmann::json::array();
  std::cout << "\n| mode | samples/s (median) | x colocated | each round | learner ms/step (waiting for batches, "
               "publishing) | mean staleness | dropped / round |\n|---|---:|---:|---|---|---:|---:|\n";
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const double sps = median_of(got[i], "samples_per_s");
    std::cout << "| " << configs[i].name << " | " << std::setprecision(0) << sps << " | " << std::setprecision(2)
              << sps / colocated << " | ";
    for (std::size_t k = 0; k < got[i].size(); ++k)
      std::cout << (k ? ", " : "") << std::setprecision(0) << got[i][k].at("samples_per_s").get<double>();
    std::cout << " | " << std::setprecision(1) << median_of(got[i], "step_ms");
    if (configs[i].role != "colocated")
      std::cout << " (" << median_of(got[i], "wait_ms") << ", " << median_of(got[i], "publish_ms") << ")";
    std::cout << " | " << std::setprecision(2) << median_of(got[i], "mean_staleness") << " | " << std::setprecision(0)
              << median_of(got[i], "dropped") << " |\n";
    for (auto& r : got[i]) all.push_back(r);
  }
  server.stop();
  std::cout << "load average at the end: " << load_average() << "\n";
  std::cout << "\n" << nlohmann::json{{"sampling_ms", sampling_ms}, {"delay_ms", delay_ms}, {"runs", all}}.dump() << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_split: " << e.what() << "\n";
  return 1;
}
