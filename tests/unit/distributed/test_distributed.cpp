// Data parallelism with real multi-process c10d Gloo groups: the test starts N worker processes
// (dp_worker) that meet through a FileStore on this machine, and checks what each one saw.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>
#include <unirl/parallel/wire.hpp>
#include <unirl/rollout/env.hpp>
#include <unirl/rollout/token.hpp>

extern char** environ;
namespace fs = std::filesystem;

namespace {

// A TCP port that was free a moment ago (the kernel's pick), for a TCPStore.
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  REQUIRE(ok);
  return ntohs(a.sin_port);
}

// Runs `world` workers in `mode`; kills them all if they take longer than `limit` (never hangs).
// With `torchrun_env` the ranks meet as torchrun's would: RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT in their environment (a TCPStore served by rank 0).
std::vector<nlohmann::json> run_workers(const std::string& mode, int world, std::chrono::seconds limit,
                                        bool torchrun_env = false) {
  const auto dir = fs::temp_directory_path() / ("unirl-dp-" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  const std::string store = (dir / "store").string(), out = (dir / "out").string();
  const int port = torchrun_env ? free_port() : 0;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args{UNIRL_DP_WORKER, mode, torchrun_env ? "env" : std::to_string(r),
                                  torchrun_env ? "env" : std::to_string(world), store, out};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_text;
    for (char** e = environ; *e; ++e) {
      const std::string v = *e;
      if (torchrun_env && (v.rfind("RANK=", 0) == 0 || v.rfind("WORLD_SIZE=", 0) == 0 || v.rfind("MASTER_", 0) == 0))
        continue;
      env_text.push_back(v);
    }
    if (torchrun_env) {
      env_text.push_back("RANK=" + std::to_string(r));
      env_text.push_back("WORLD_SIZE=" + std::to_string(world));
      env_text.push_back("MASTER_ADDR=127.0.0.1");
      env_text.push_back("MASTER_PORT=" + std::to_string(port));
    }
    std::vector<char*> envp;
    for (auto& e : env_text) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    REQUIRE(posix_spawn(&pid, UNIRL_DP_WORKER, nullptr, nullptr, argv.data(), envp.data()) == 0);
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<int> status(pids.size(), -1);
  std::size_t done = 0;
  while (done < pids.size()) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (status[i] != -1) continue;
      int st = 0;
      if (waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        status[i] = st;
        ++done;
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (std::size_t i = 0; i < pids.size(); ++i)
        if (status[i] == -1) kill(pids[i], SIGKILL), waitpid(pids[i], nullptr, 0);
      fs::remove_all(dir);
      FAIL("distributed workers did not finish within " << limit.count() << " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::vector<nlohmann::json> results;
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << " exit status " << status[static_cast<std::size_t>(r)]);
    REQUIRE(WIFEXITED(status[static_cast<std::size_t>(r)]));
    REQUIRE(WEXITSTATUS(status[static_cast<std::size_t>(r)]) == 0);
    std::ifstream in(out + "." + std::to_string(r) + ".json");
    results.push_back(nlohmann::json::parse(in));
  }
  fs::remove_all(dir);
  return results;
}

}  // namespace

TEST_CASE("gradients are averaged and weights broadcast across Gloo ranks", "[cpu][distributed]") {
  for (int world : {2, 3}) {
    const auto res = run_workers("grads", world, std::chrono::seconds(120));
    for (int r = 0; r < world; ++r) {
      INFO("world " << world << " rank " << r);
      CHECK(res[r]["max_grad_error"].get<double>() < 1e-6);
      CHECK(res[r]["weight_checksum"] == res[0]["weight_checksum"]);  // rank 0's initial weights everywhere
      CHECK(res[r]["mean_of_ranks"].get<double>() == Approx((world - 1) / 2.0));
      CHECK(res[r]["all_agree_true"].get<bool>());
      CHECK_FALSE(res[r]["all_agree_one_false"].get<bool>());
    }
  }
}

TEST_CASE("a data-parallel trainer keeps the ranks identical and skips a NaN step everywhere", "[cpu][distributed][slow]") {
  const auto res = run_workers("train", 2, std::chrono::seconds(240));
  // Same averaged gradients, same AdamW: the ranks end bit for bit equal.
  CHECK(res[0]["params"] == res[1]["params"]);
  // Rank 1 saw a NaN reward at step 5; both ranks skipped that update, and only that one.
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const auto& skipped = res[r]["skipped"];
    for (std::size_t s = 0; s < skipped.size(); ++s) CHECK(skipped[s].get<int>() == (s == 5 ? 1 : 0));
    CHECK(res[r]["last"].get<double>() > res[r]["first"].get<double>() + 0.3);
  }
  // The step statistics are all ranks' (all_reduce_mean / all_reduce_max), not rank 0's alone:
  // each rank reports the mean of both ranks' reward means (equal batch sizes) and their range.
  const auto& rep0 = res[0]["reported"];
  const auto& rep1 = res[1]["reported"];
  std::size_t differing = 0;
  for (std::size_t s = 0; s < rep0.size(); ++s) {
    if (s == 5) continue;  // the NaN step
    INFO("step " << s);
    const auto &l0 = res[0]["local"][s], &l1 = res[1]["local"][s];
    differing += l0[0].get<double>() != l1[0].get<double>() ? 1 : 0;
    CHECK(rep0[s] == rep1[s]);
    CHECK(rep0[s][0].get<double>() == Approx((l0[0].get<double>() + l1[0].get<double>()) / 2).margin(1e-12));
    CHECK(rep0[s][1].get<double>() == std::min(l0[1].get<double>(), l1[1].get<double>()));
    CHECK(rep0[s][2].get<double>() == std::max(l0[2].get<double>(), l1[2].get<double>()));
  }
  CHECK(differing > 10);  // the ranks' own means do differ: the check can tell one rank from both
}

TEST_CASE("a data-parallel trainer broadcasts rank 0's buffers at construction and after every step",
          "[cpu][distributed]") {
  for (int world : {2, 3}) {
    const auto res = run_workers("buffers", world, std::chrono::seconds(120));
    for (int r = 1; r < world; ++r) {
      INFO("world " << world << " rank " << r);
      CHECK(res[r]["initial"] != res[0]["initial"]);          // each rank initialised its own buffers
      CHECK(res[r]["constructed"] == res[0]["initial"]);      // the trainer took rank 0's
      CHECK(res[r]["constructed"] == res[0]["constructed"]);
      const auto& diverged = res[r]["diverged"];
      const auto& stepped = res[r]["stepped"];
      REQUIRE(stepped.size() == 4);
      for (std::size_t s = 0; s < stepped.size(); ++s) {
        INFO("step " << s);
        CHECK(diverged[s] != res[0]["diverged"][s]);           // the ranks' own data changed them differently
        CHECK(stepped[s] == res[0]["stepped"][s]);             // equal again after the step's sync
      }
      CHECK(res[r]["params"] == res[0]["params"]);
    }
    CHECK(res[0]["stepped"][3] != res[0]["constructed"]);      // the buffers did change
    // The int64 count travelled exactly: rank 0's count, a whole number.
    const double bright = res[0]["stepped"][3].back().get<double>();
    CHECK(bright == std::floor(bright));
  }
}

// ---- the learner / sampler split (parallel/c10d_transport.hpp, parallel/rollout_worker.hpp) ----

namespace {
std::vector<double> as_vector(const nlohmann::json& j) { return j.get<std::vector<double>>(); }
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}
}  // namespace

TEST_CASE("synchronous split: a learner and one sampler process train what trainer.step trains",
          "[cpu][distributed]") {
  const auto ref = run_workers("colocated", 1, std::chrono::seconds(60));
  const auto res = run_workers("split_sync", 2, std::chrono::seconds(60), /*torchrun_env=*/true);
  const auto step = as_vector(ref[0]["step_params"]);
  // The plain loop, the colocated transport and the c10d split: the same batches (the sampler
  // draws the stream a colocated trainer draws), the same updates, within fp32 tolerance.
  CHECK(max_abs_diff(as_vector(ref[0]["colocated_params"]), step) <= 1e-6);
  CHECK(max_abs_diff(as_vector(res[0]["params"]), step) <= 1e-6);
  // The weights did move: the comparison can fail.
  CHECK(res[0]["published"].front().get<double>() != res[0]["published"].back().get<double>());
  for (const auto& s : ref[0]["staleness"]) CHECK(s.get<double>() == 0.0);
  for (const auto& s : res[0]["staleness"]) CHECK(s.get<double>() == 0.0);
  CHECK_FALSE(ref[0]["after_finish"].get<bool>());  // a finished colocated learner stops its worker
  // Asynchronous in one process (max_staleness 1): three batches drawn with version 0. The first
  // is on-policy (ratio exactly 1, the algorithm told updates = 1); the second is one version old:
  // the algorithm is told the update is off-policy (updates = 0) and the ratio is taken against
  // the behaviour log-probs the batch carries (not 1); the third, two versions old, is dropped.
  const auto& async = ref[0]["async"];
  CHECK(async["staleness"] == nlohmann::json::array({0.0, 1.0}));
  CHECK(async["updates_seen"] == nlohmann::json::array({1, 0}));
  CHECK(async["ratio_mean"][0].get<double>() == 1.0);
  CHECK(async["ratio_mean"][1].get<double>() != 1.0);
  CHECK_FALSE(async["third"].get<bool>());
  CHECK(async["dropped"].get<std::int64_t>() == 1);
  // The sampler drew its j-th batch with version j, from exactly the weights the learner published.
  const auto& versions = res[1]["versions"];
  REQUIRE(versions.size() >= 8);
  for (std::size_t j = 0; j < versions.size(); ++j) {
    INFO("batch " << j);
    CHECK(versions[j].get<std::int64_t>() == static_cast<std::int64_t>(j));
    CHECK(res[1]["sums"][j].get<double>() == res[0]["published"][j].get<double>());
  }
}

TEST_CASE("synchronous split with two samplers: every step gathers both and is on-policy", "[cpu][distributed]") {
  const auto res = run_workers("split_sync", 3, std::chrono::seconds(60), /*torchrun_env=*/true);
  const auto& published = res[0]["published"];
  REQUIRE(res[0]["staleness"].size() == 8);
  for (const auto& s : res[0]["staleness"]) CHECK(s.get<double>() == 0.0);
  CHECK(res[0]["dropped"].get<std::int64_t>() == 0);
  for (int r = 1; r < 3; ++r) {
    INFO("sampler rank " << r);
    const auto& versions = res[r]["versions"];
    REQUIRE(versions.size() >= 8);  // one batch per version (the last may be discarded at the end)
    for (std::size_t j = 0; j < versions.size(); ++j) {
      CHECK(versions[j].get<std::int64_t>() == static_cast<std::int64_t>(j));
      CHECK(res[r]["sums"][j].get<double>() == published[j].get<double>());
    }
  }
}

TEST_CASE("asynchronous split: samplers run ahead, the learner never trains on a batch more than k versions old",
          "[cpu][distributed]") {
  const auto res = run_workers("split_async", 3, std::chrono::seconds(60), /*torchrun_env=*/true);
  const auto& staleness = res[0]["staleness"];
  REQUIRE(staleness.size() == 16);
  double most = 0;
  for (const auto& s : staleness) {
    CHECK(s.get<double>() >= 0.0);
    CHECK(s.get<double>() <= 1.0);  // max_staleness = 1
    most = std::max(most, s.get<double>());
  }
  // A slow learner and two samplers: some batch was drawn with older weights (reported, or
  // dropped as too old) — the samplers did not wait for each version.
  CHECK((most == 1.0 || res[0]["dropped"].get<std::int64_t>() > 0));
  for (int r = 1; r < 3; ++r) {
    INFO("sampler rank " << r);
    const auto& versions = res[r]["versions"];
    REQUIRE(!versions.empty());
    for (std::size_t j = 0; j < versions.size(); ++j) {
      if (j > 0) CHECK(versions[j].get<std::int64_t>() >= versions[j - 1].get<std::int64_t>());
      // the weights a batch was drawn with are the ones the learner published as that version
      CHECK(res[r]["sums"][j].get<double>() == res[0]["published"][versions[j].get<std::size_t>()].get<double>());
    }
  }
}

TEST_CASE("weight sync throughput from the learner to two samplers over Gloo", "[.][bench][distributed]") {
  const auto res = run_workers("sync_bench", 3, std::chrono::seconds(120), /*torchrun_env=*/true);
  std::cout << "weight sync: " << res[0].dump() << "\n";
  for (int r = 1; r < 3; ++r) CHECK(res[r]["value"].get<double>() == 0.0);  // rank 0's values arrived
}

TEST_CASE("the wire carries a token batch exactly and rejects damaged bytes with an error", "[cpu][distributed]") {
  using unirl::parallel::wire::decode;
  using unirl::parallel::wire::encode;
  unirl::token_rollout b;
  b.prompt_ids = torch::tensor({{0, 5, 6}, {7, 8, 9}}, torch::kInt64);
  b.prompt_mask = torch::tensor({{0.f, 1.f, 1.f}, {1.f, 1.f, 1.f}});
  b.completion_ids = torch::tensor({{1, 2}, {3, 0}}, torch::kInt64);
  b.completion_mask = torch::tensor({{true, true}, {true, false}});
  b.old_logp = torch::tensor({{-0.5, -1.25}, {-2.0, 0.0}}, torch::kFloat64);
  b.prompt_index = torch::tensor({0, 0}, torch::kInt64);
  b.prompts = {"7 + 5 =", "7 + 5 ="};
  b.completions = {"12", "1\xc3\xa9"};  // any bytes
  b.host_completion_lengths = {2, 1};
  const auto bytes = encode(unirl::versioned_batch<unirl::token_rollout>{b, torch::tensor({1.f, 0.f}), 3});
  const auto back = decode<unirl::token_rollout>(bytes, "test");
  CHECK(back.policy_version == 3);
  CHECK(torch::equal(back.rewards, torch::tensor({1.f, 0.f})));
  CHECK(torch::equal(back.batch.prompt_ids, b.prompt_ids));
  CHECK(torch::equal(back.batch.prompt_mask, b.prompt_mask));
  CHECK(back.batch.completion_mask.scalar_type() == torch::kBool);
  CHECK(torch::equal(back.batch.completion_mask, b.completion_mask));
  CHECK(back.batch.old_logp.scalar_type() == torch::kFloat64);
  CHECK(torch::equal(back.batch.old_logp, b.old_logp));  // the behaviour log-probs, bit for bit
  CHECK_FALSE(back.batch.ref_logp.defined());
  CHECK_FALSE(back.batch.advantages.defined());
  CHECK(back.batch.prompts == b.prompts);
  CHECK(back.batch.completions == b.completions);
  CHECK(back.batch.references.empty());
  CHECK(back.batch.host_completion_lengths == b.host_completion_lengths);
  CHECK(back.batch.host_prompt_lengths.empty());

  // An environment batch: int64 scalars travel too.
  unirl::env_rollout e;
  e.obs = torch::arange(6, torch::kFloat32).reshape({3, 2});
  e.num_steps = 3;
  e.num_envs = 1;
  const auto eb = decode<unirl::env_rollout>(encode(unirl::versioned_batch<unirl::env_rollout>{e, {}, 0}), "test");
  CHECK(torch::equal(eb.batch.obs, e.obs));
  CHECK(eb.batch.num_steps == 3);
  CHECK(eb.batch.num_envs == 1);
  CHECK_FALSE(eb.rewards.defined());

  // Damaged bytes: every truncation, a wrong magic, a wrong dtype code, a huge count, a batch
  // of another type — an error that says so, never a crash or a half-filled batch.
  const auto n = bytes.numel();
  for (std::int64_t len = 0; len < n; ++len) {
    INFO("truncated to " << len << " of " << n << " bytes");
    CHECK_THROWS_AS(decode<unirl::token_rollout>(bytes.slice(0, 0, len).clone(), "test"), unirl::error);
  }
  auto bad = bytes.clone();
  bad[0] = 0;
  CHECK_THROWS_WITH(decode<unirl::token_rollout>(bad, "rank 2"), Catch::Contains("rank 2") && Catch::Contains("starts with"));
  // byte 12 is the rewards field's name length (8 bytes: magic 4, version 8 -> offset 12)
  bad = bytes.clone();
  bad[12 + 7] = 0x7f;  // the name length's top byte: a length far beyond the bytes
  CHECK_THROWS_WITH(decode<unirl::token_rollout>(bad, "test"), Catch::Contains("expected a count"));
  bad = bytes.clone();
  bad[12 + 8 + 7 + 1 + 1 - 1] = 99;  // after "rewards" (7 bytes) and its kind: the dtype code
  CHECK_THROWS_WITH(decode<unirl::token_rollout>(bad, "test"), Catch::Contains("dtype code 99"));
  CHECK_THROWS_WITH(decode<unirl::env_rollout>(bytes, "test"), Catch::Contains("field 'prompt_ids' where 'obs'"));
  auto longer = torch::cat({bytes, torch::zeros({1}, torch::kUInt8)});
  CHECK_THROWS_WITH(decode<unirl::token_rollout>(longer, "test"), Catch::Contains("1 bytes after the last field"));
}
