// The kill loop: proves that checkpoints survive SIGKILL at any moment, mid-save included.
//
//   crash_driver --worker PATH --dir DIR [--kills 30] [--steps 40] [--seed 1]
//                [--corrupt-every 0] [--max-seconds 150] [--d-model 128]
//
// 1. Runs the worker (crash_worker.cpp) once without interruption in DIR/reference: its final
//    weight hash is the reference, and its "saving"/"saved" markers time a save.
// 2. In DIR/run: starts the worker, kills it with SIGKILL after a random delay — a third of the
//    time uniform over the first 30% of a run's time, else shortly after a "saving S" marker (inside a save of the
//    measured length) — and restarts it, until `kills` kills were made; then lets it finish.
//    A run that finishes before it is killed is checked and the run directory started afresh.
// 3. Checks after every restart that the worker resumed from the last checkpoint it saved (or the
//    one it was saving, when the kill fell after the rename), and at the end that the final hash
//    equals the reference bit for bit. With --corrupt-every M every M-th kill is followed by
//    truncating the newest checkpoint (a disk error, a build without the atomic rename): the
//    worker must warn, fall back to the previous checkpoint and still end with the same hash.
// Exit status 0 when every check held; bounded by --max-seconds (the run fails past it).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

namespace {
struct settings {
  std::string worker, dir;
  long kills = 30, steps = 40, seed = 1, corrupt_every = 0, d_model = 128;
  double max_seconds = 150;
};

[[noreturn]] void fail(const std::string& why) {
  std::cerr << "crash_driver: FAIL: " << why << "\n";
  std::exit(1);
}

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

// One worker process with its stdout on a pipe; lines are read with their arrival times.
struct worker_run {
  pid_t pid = -1;
  int fd = -1;
  std::string partial;
  std::vector<std::string> lines;
  std::vector<double> times;  // seconds since start
  clock_type::time_point start;
  bool exited = false;
  int status = 0;

  worker_run(const settings& s, const fs::path& dir) {
    int p[2];
    if (::pipe(p) != 0) fail("pipe failed");
    start = clock_type::now();
    pid = ::fork();
    if (pid < 0) fail("fork failed");
    if (pid == 0) {
      ::dup2(p[1], 1);
      ::close(p[0]);
      ::close(p[1]);
      const std::string steps = std::to_string(s.steps), d = std::to_string(s.d_model), dirs = dir.string();
      ::execl(s.worker.c_str(), s.worker.c_str(), dirs.c_str(), steps.c_str(), d.c_str(), "2", (char*)nullptr);
      std::perror("exec");
      ::_exit(127);
    }
    ::close(p[1]);
    fd = p[0];
  }
  ~worker_run() {
    if (!exited && pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    if (fd >= 0) ::close(fd);
  }
  // Reads what arrives until `deadline` (or until the pipe closes); true when a line arrived.
  bool read_until(clock_type::time_point deadline) {
    const auto before = lines.size();
    while (fd >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now()).count();
      if (left <= 0) break;
      pollfd pf{fd, POLLIN, 0};
      const int r = ::poll(&pf, 1, static_cast<int>(left));
      if (r == 0) break;
      if (r < 0) continue;
      char buf[4096];
      const auto n = ::read(fd, buf, sizeof buf);
      if (n <= 0) {
        ::close(fd);
        fd = -1;
        break;
      }
      partial.append(buf, static_cast<std::size_t>(n));
      std::size_t nl;
      while ((nl = partial.find('\n')) != std::string::npos) {
        lines.push_back(partial.substr(0, nl));
        times.push_back(seconds_since(start));
        partial.erase(0, nl + 1);
      }
      if (lines.size() > before) return true;
    }
    return lines.size() > before;
  }
  void wait_exit() {
    while (fd >= 0) read_until(clock_type::now() + std::chrono::seconds(1));
    ::waitpid(pid, &status, 0);
    exited = true;
  }
  void kill_now() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    exited = true;
    // drain what was written before the kill
    while (fd >= 0) read_until(clock_type::now() + std::chrono::milliseconds(200));
  }
  std::optional<long> marker(const std::string& word) const {  // last "word N"
    for (auto it = lines.rbegin(); it != lines.rend(); ++it)
      if (it->rfind(word + " ", 0) == 0) return std::stol(it->substr(word.size() + 1));
    return std::nullopt;
  }
  std::string last_line() const { return lines.empty() ? std::string{} : lines.back(); }
  std::string hash() const {
    for (const auto& l : lines)
      if (l.rfind("hash ", 0) == 0) return l.substr(5);
    return {};
  }
  bool finished_ok() const {
    return exited && WIFEXITED(status) && WEXITSTATUS(status) == 0 && !lines.empty() && lines.back() == "done";
  }
};

std::vector<std::pair<long, fs::path>> checkpoints(const fs::path& run) {
  std::vector<std::pair<long, fs::path>> v;
  std::error_code ec;
  if (!fs::is_directory(run / "checkpoints", ec)) return v;
  for (const auto& e : fs::directory_iterator(run / "checkpoints")) {
    const auto f = e.path().filename().string();
    if (f.size() == 16 && f.rfind("step-", 0) == 0 && f.substr(13) == ".pt") v.emplace_back(std::stol(f.substr(5, 8)), e.path());
  }
  std::sort(v.begin(), v.end());
  return v;
}
bool has_temporary(const fs::path& run) {
  std::error_code ec;
  if (!fs::is_directory(run / "checkpoints", ec)) return false;
  for (const auto& e : fs::directory_iterator(run / "checkpoints"))
    if (e.path().extension() == ".tmp") return true;
  return false;
}
}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--worker") s.worker = v;
    else if (k == "--dir") s.dir = v;
    else if (k == "--kills") s.kills = std::stol(v);
    else if (k == "--steps") s.steps = std::stol(v);
    else if (k == "--seed") s.seed = std::stol(v);
    else if (k == "--corrupt-every") s.corrupt_every = std::stol(v);
    else if (k == "--max-seconds") s.max_seconds = std::stod(v);
    else if (k == "--d-model") s.d_model = std::stol(v);
    else fail("unknown option " + k);
  }
  if (s.worker.empty() || s.dir.empty()) fail("usage: crash_driver --worker PATH --dir DIR [--kills N] ...");
  const auto t0 = clock_type::now();
  const auto deadline = t0 + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(s.max_seconds));
  auto check_time = [&] {
    if (clock_type::now() > deadline) fail("past --max-seconds " + std::to_string(s.max_seconds));
  };
  const fs::path base(s.dir), ref_dir = base / "reference", run_dir = base / "run";
  fs::remove_all(base);
  fs::create_directories(base);

  // 1. the uninterrupted reference
  std::string ref_hash;
  double ref_seconds = 0, save_seconds = 0;
  {
    worker_run w(s, ref_dir);
    w.wait_exit();
    if (!w.finished_ok()) fail("the reference run failed (status " + std::to_string(w.status) + ", last line '" + w.last_line() + "')");
    ref_hash = w.hash();
    ref_seconds = w.times.back();
    std::map<long, double> saving;
    long n = 0;
    for (std::size_t i = 0; i < w.lines.size(); ++i) {
      if (w.lines[i].rfind("saving ", 0) == 0) saving[std::stol(w.lines[i].substr(7))] = w.times[i];
      if (w.lines[i].rfind("saved ", 0) == 0) {
        save_seconds += w.times[i] - saving[std::stol(w.lines[i].substr(6))];
        ++n;
      }
    }
    save_seconds /= std::max(1L, n);
    std::cout << "reference: hash " << ref_hash << ", " << ref_seconds << " s for " << s.steps << " steps, a save takes "
              << save_seconds * 1e3 << " ms (" << fs::file_size(checkpoints(ref_dir).back().second) << " bytes)"
              << std::endl;
  }
  check_time();

  // 2. the kill loop
  std::mt19937_64 rng(static_cast<std::uint64_t>(s.seed));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  long kills = 0, in_save = 0, temporaries = 0, corruptions = 0, rounds = 0, restarts = 0, fallbacks = 0;
  long last_saved = 0, saving_at_kill = -1;  // what the killed run reported (0: nothing saved yet)
  std::optional<long> corrupted;              // the newest step truncated before this restart
  long expect_before_corrupt = -1;
  for (;;) {
    check_time();
    worker_run w(s, run_dir);
    ++restarts;
    // the worker's first line says where it resumed
    while (w.lines.empty() && w.fd >= 0) {
      w.read_until(std::min(deadline, clock_type::now() + std::chrono::seconds(60)));
      check_time();
    }
    if (w.lines.empty()) {
      w.wait_exit();
      fail("the worker printed nothing (status " + std::to_string(w.status) + ")");
    }
    const auto first = w.lines.front();
    const long resumed = first == "fresh" ? 0 : first.rfind("resumed ", 0) == 0 ? std::stol(first.substr(8)) : -1;
    if (resumed < 0) fail("unexpected first line '" + first + "'");
    if (corrupted) {
      // fell back past the truncated newest one: to the newest remaining complete checkpoint
      if (resumed != expect_before_corrupt)
        fail("after truncating step " + std::to_string(*corrupted) + " the worker resumed at " + std::to_string(resumed) +
             ", expected " + std::to_string(expect_before_corrupt));
      ++fallbacks;
    } else if (last_saved >= 0) {
      const bool ok = resumed == last_saved || resumed == saving_at_kill;
      if (!ok)
        fail("the worker resumed at " + std::to_string(resumed) + " but the last save reported was " +
             std::to_string(last_saved) + (saving_at_kill >= 0 ? " (killed while saving " + std::to_string(saving_at_kill) + ")" : ""));
    }
    corrupted.reset();
    last_saved = resumed;  // this run's saves count from here
    saving_at_kill = -1;

    if (kills >= s.kills) {  // let it finish
      w.wait_exit();
      if (!w.finished_ok()) fail("the last run failed (status " + std::to_string(w.status) + ", last line '" + w.last_line() + "')");
      if (w.hash() != ref_hash) fail("final hash " + w.hash() + " != reference " + ref_hash);
      ++rounds;
      break;
    }
    // choose the moment of the kill
    bool killed = false;
    if (unit(rng) < 0.35) {
      const auto at = w.start + std::chrono::duration_cast<clock_type::duration>(
                                    std::chrono::duration<double>(unit(rng) * ref_seconds * 0.3));
      while (w.fd >= 0 && clock_type::now() < at) w.read_until(at);
    } else {
      // inside a save: after the k-th "saving" marker of this run, within the measured save time
      const long k = 1 + static_cast<long>(unit(rng) * 3);
      long seen = 0;
      while (w.fd >= 0 && seen < k) {
        const auto n = w.lines.size();
        w.read_until(std::min(deadline, clock_type::now() + std::chrono::seconds(30)));
        check_time();
        for (auto i = n; i < w.lines.size(); ++i) seen += w.lines[i].rfind("saving ", 0) == 0;
      }
      const auto at = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(
                                              std::chrono::duration<double>(unit(rng) * save_seconds));
      while (w.fd >= 0 && clock_type::now() < at) w.read_until(at);
    }
    if (w.fd >= 0) {
      w.kill_now();
      killed = true;
    } else {
      w.wait_exit();
    }
    if (!killed) {  // it finished before the kill: check, and start a new round
      if (!w.finished_ok()) fail("a run failed (status " + std::to_string(w.status) + ", last line '" + w.last_line() + "')");
      if (w.hash() != ref_hash) fail("final hash " + w.hash() + " != reference " + ref_hash);
      ++rounds;
      fs::remove_all(run_dir);
      last_saved = 0;
      saving_at_kill = -1;
      continue;
    }
    ++kills;
    const auto saved = w.marker("saved");
    const auto saving = w.marker("saving");
    if (saved) last_saved = std::max(last_saved, *saved);
    const bool during_save = saving && (!saved || *saving > *saved);
    saving_at_kill = during_save ? *saving : -1;
    in_save += during_save;
    temporaries += has_temporary(run_dir);
    if (s.corrupt_every > 0 && kills % s.corrupt_every == 0) {
      auto all = checkpoints(run_dir);
      if (all.size() >= 2) {  // truncate the newest to half its size
        const auto newest = all.back();
        fs::resize_file(newest.second, fs::file_size(newest.second) / 2);
        corrupted = newest.first;
        expect_before_corrupt = all[all.size() - 2].first;
        ++corruptions;
      }
    }
  }
  const double secs = seconds_since(t0);
  std::cout << "kill loop: " << kills << " SIGKILLs (" << in_save << " inside a save, " << temporaries
            << " left a partial .tmp), " << corruptions << " newest checkpoints truncated (" << fallbacks
            << " fallbacks), " << restarts << " starts, " << rounds << " completed run(s); final hash " << ref_hash
            << " equals the uninterrupted run's; " << secs << " s" << std::endl;
  if (in_save * 5 < kills) fail("only " + std::to_string(in_save) + " of " + std::to_string(kills) + " kills fell inside a save");
  return 0;
}
