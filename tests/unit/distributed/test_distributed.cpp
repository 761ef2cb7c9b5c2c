// Data parallelism with real multi-process c10d Gloo groups: the test starts N worker processes
// (dp_worker) that meet through a FileStore on this machine, and checks what each one saw.
#include <catch2/catch.hpp>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

extern char** environ;
namespace fs = std::filesystem;

namespace {

// Runs `world` workers in `mode`; kills them all if they take longer than `limit` (never hangs).
std::vector<nlohmann::json> run_workers(const std::string& mode, int world, std::chrono::seconds limit) {
  const auto dir = fs::temp_directory_path() / ("unirl-dp-" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  const std::string store = (dir / "store").string(), out = (dir / "out").string();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args{UNIRL_DP_WORKER, mode, std::to_string(r), std::to_string(world), store, out};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    REQUIRE(posix_spawn(&pid, UNIRL_DP_WORKER, nullptr, nullptr, argv.data(), environ) == 0);
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
