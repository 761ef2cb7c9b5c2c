// The chaos loop of the split deployment: a learner, two samplers and a reward rank
// (chaos_rank.cpp), one of them SIGKILLed at a random moment in every round, the deployment
// restarted from its checkpoints, until `kills` kills were made; then it runs to the end.
//
//   chaos_driver --rank PATH --dir DIR [--kills 4] [--steps 30] [--seed 1]
//                [--round-seconds 30] [--max-seconds 240]
//
// 1. Runs the deployment once without interruption in DIR/reference: its final weight hash is
//    the reference, its duration the span the kill moments are drawn from.
// 2. In DIR/run: starts the four ranks (a fresh MASTER_PORT each round), picks a rank and a
//    moment (a quarter inside the start-up, the others over the training span; half the learner's
//    kills at a "saving" marker, inside a checkpoint save), SIGKILLs
//    it, and waits for the three others to exit by themselves: a rank whose peer died must notice
//    (a closed connection at once, a heartbeat within fault_timeout) — one still running
//    `--round-seconds` after the kill is a hang, and the loop fails. A deployment that finishes
//    before its kill is checked and the run directory started afresh.
// 3. Checks after every restart that the learner resumed from the last checkpoint it reported
//    saved (or the one it was saving when it was killed) and each sampler from a worker checkpoint
//    no older than the last batch it reported — no checkpoint lost, none corrupted (a corrupt one
//    fails its load, and the rank with it) — and at the end that the final hash equals the
//    reference bit for bit. Exit status 0 when every check held; bounded by --max-seconds.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

namespace {
constexpr int world = 4;  // learner, sampler, sampler, reward rank
const std::array<const char*, world> role_names{"learner", "sampler 0", "sampler 1", "reward rank"};

struct settings {
  std::string rank, dir;
  long kills = 4, steps = 30, seed = 1;
  double round_seconds = 30, max_seconds = 240;
};

[[noreturn]] void fail(const std::string& why) {
  std::cerr << "chaos_driver: FAIL: " << why << "\n";
  std::exit(1);
}

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }
clock_type::time_point after(double s) {
  return clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(s));
}

// A free TCP port on the loopback interface (bound, read back, released).
int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) fail("socket failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t n = sizeof a;
  if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &n) != 0)
    fail("binding a free port failed");
  ::close(s);
  return ntohs(a.sin_port);
}

std::string tail_of(const fs::path& f, std::size_t bytes = 600) {
  std::ifstream in(f);
  std::stringstream ss;
  ss << in.rdbuf();
  const auto s = ss.str();
  return s.size() > bytes ? s.substr(s.size() - bytes) : s;
}

// One rank: its stdout on a pipe, read line by line; its stderr in a log file.
struct rank_process {
  int rank = 0;
  pid_t pid = -1;
  int fd = -1;
  std::string partial;
  std::vector<std::string> lines;
  std::vector<double> times;  // of each line, seconds since the deployment started
  clock_type::time_point start;
  bool exited = false;
  int status = 0;
  fs::path log;

  rank_process(const settings& s, const fs::path& dir, int r, int port, const fs::path& log_file,
               clock_type::time_point started)
      : rank(r), start(started), log(log_file) {
    int p[2];
    if (::pipe(p) != 0) fail("pipe failed");
    pid = ::fork();
    if (pid < 0) fail("fork failed");
    if (pid == 0) {
      ::dup2(p[1], 1);
      ::close(p[0]);
      ::close(p[1]);
      const int e = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (e >= 0) ::dup2(e, 2);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      const std::string steps = std::to_string(s.steps), dirs = dir.string();
      ::execl(s.rank.c_str(), s.rank.c_str(), dirs.c_str(), steps.c_str(), (char*)nullptr);
      std::perror("exec");
      ::_exit(127);
    }
    ::close(p[1]);
    fd = p[0];
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  rank_process(const rank_process&) = delete;
  ~rank_process() {
    if (!exited && pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    if (fd >= 0) ::close(fd);
  }
  void drain() {
    char buf[4096];
    for (;;) {
      const auto n = ::read(fd, buf, sizeof buf);
      if (n <= 0) {
        if (n == 0) {
          ::close(fd);
          fd = -1;
        }
        break;
      }
      partial.append(buf, static_cast<std::size_t>(n));
      std::size_t nl;
      while ((nl = partial.find('\n')) != std::string::npos) {
        lines.push_back(partial.substr(0, nl));
        times.push_back(seconds_since(start));
        partial.erase(0, nl + 1);
      }
    }
  }
  // Reaps the process once its pipe closed (or it exited).
  void reap() {
    if (exited) return;
    if (::waitpid(pid, &status, WNOHANG) == pid) exited = true;
  }
  void kill_now() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    exited = true;
    while (fd >= 0) drain();
  }
  bool ok() const { return exited && WIFEXITED(status) && WEXITSTATUS(status) == 0 && !lines.empty() && lines.back() == "done"; }
  std::string describe() const {
    if (!exited) return "running";
    if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
    return "exit " + std::to_string(WEXITSTATUS(status));
  }
  std::optional<long> marker(const std::string& word) const {  // the last "word N"
    for (auto it = lines.rbegin(); it != lines.rend(); ++it)
      if (it->rfind(word + " ", 0) == 0) return std::stol(it->substr(word.size() + 1));
    return std::nullopt;
  }
  std::string value(const std::string& word) const {
    for (const auto& l : lines)
      if (l.rfind(word + " ", 0) == 0) return l.substr(word.size() + 1);
    return {};
  }
};

// The four ranks of one round.
struct deployment_run {
  std::vector<std::unique_ptr<rank_process>> ranks;
  clock_type::time_point start = clock_type::now();

  deployment_run(const settings& s, const fs::path& dir, const fs::path& logs, long round) {
    fs::create_directories(logs);
    const int port = free_port();
    for (int r = 0; r < world; ++r)
      ranks.push_back(std::make_unique<rank_process>(
          s, dir, r, port, logs / ("round-" + std::to_string(round) + "-rank-" + std::to_string(r) + ".log"), start));
  }
  // Reads what arrives until `deadline`, until every rank exited, or until `stop()` holds.
  template <class Stop>
  void pump_until(clock_type::time_point deadline, Stop&& stop) {
    for (;;) {
      if (stop()) return;
      std::vector<pollfd> fds;
      for (auto& p : ranks)
        if (p->fd >= 0) fds.push_back({p->fd, POLLIN, 0});
      for (auto& p : ranks)
        if (p->fd < 0) p->reap();
      if (all_exited()) return;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now()).count();
      if (left <= 0) return;
      if (fds.empty()) {
        ::usleep(10000);
        continue;
      }
      (void)::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(left, 50)));
      for (auto& p : ranks)
        if (p->fd >= 0) p->drain();
    }
  }
  void pump_until(clock_type::time_point deadline) {
    pump_until(deadline, [] { return false; });
  }
  bool all_exited() const {
    return std::all_of(ranks.begin(), ranks.end(), [](const auto& p) { return p->exited; });
  }
  std::string states() const {
    std::string s;
    for (const auto& p : ranks)
      s += std::string(s.empty() ? "" : ", ") + role_names[static_cast<std::size_t>(p->rank)] + " " + p->describe();
    return s;
  }
  std::string logs() const {
    std::string s;
    for (const auto& p : ranks) s += "\n--- " + std::string(role_names[static_cast<std::size_t>(p->rank)]) + ": " + tail_of(p->log);
    return s;
  }
  rank_process& learner() { return *ranks[0]; }
};

long first_number(const std::string& line, const std::string& word) {
  return line.rfind(word + " ", 0) == 0 ? std::stol(line.substr(word.size() + 1)) : -1;
}
}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rank") s.rank = v;
    else if (k == "--dir") s.dir = v;
    else if (k == "--kills") s.kills = std::stol(v);
    else if (k == "--steps") s.steps = std::stol(v);
    else if (k == "--seed") s.seed = std::stol(v);
    else if (k == "--round-seconds") s.round_seconds = std::stod(v);
    else if (k == "--max-seconds") s.max_seconds = std::stod(v);
    else fail("unknown option " + k + "; expected --rank, --dir, --kills, --steps, --seed, --round-seconds, --max-seconds");
  }
  if (s.rank.empty() || s.dir.empty()) fail("usage: chaos_driver --rank PATH --dir DIR [--kills N] ...");
  ::signal(SIGPIPE, SIG_IGN);
  const auto t0 = clock_type::now();
  const auto deadline = after(s.max_seconds);
  auto check_time = [&] {
    if (clock_type::now() > deadline) fail("past --max-seconds " + std::to_string(s.max_seconds));
  };
  const fs::path base(s.dir), logs = base / "logs";
  fs::remove_all(base);
  fs::create_directories(base);

  // 1. the uninterrupted reference
  std::string ref_hash;
  // the whole run; until the learner saved its first step (start-up); from then to its last save
  double ref_seconds = 0, ref_ready = 0, ref_train = 0;
  {
    deployment_run d(s, base / "reference", logs, 0);
    d.pump_until(deadline);
    for (auto& p : d.ranks)
      if (!p->ok()) fail("the reference run failed: " + d.states() + d.logs());
    ref_hash = d.learner().value("hash");
    ref_seconds = seconds_since(d.start);
    for (std::size_t i = 0; i < d.learner().lines.size() && ref_ready == 0; ++i)
      if (d.learner().lines[i].rfind("saved ", 0) == 0) ref_ready = d.learner().times[i];
    for (std::size_t i = 0; i < d.learner().lines.size(); ++i)
      if (d.learner().lines[i].rfind("saved ", 0) == 0) ref_train = d.learner().times[i] - ref_ready;
    std::cout << "reference: hash " << ref_hash << ", " << ref_seconds << " s: " << ref_ready << " s start-up, "
              << s.steps - 1 << " more steps in " << ref_train << " s" << std::endl;
  }
  check_time();

  // 2. the chaos loop
  const fs::path run_dir = base / "run";
  std::mt19937_64 rng(static_cast<std::uint64_t>(s.seed));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::array<long, world> killed_by_role{};
  long kills = 0, rounds = 0, completed = 0, in_save = 0, resumes = 0;
  long last_saved = 0, saving_at_kill = -1;   // the learner's checkpoints (0: none yet)
  std::array<long, 2> last_batch{-1, -1};      // the newest batch each sampler reported saved
  double recovery_max = 0, recovery_sum = 0, round_max = 0;
  for (;;) {
    check_time();
    ++rounds;
    deployment_run d(s, run_dir, logs, rounds);
    // the resume checks, once the ranks said where they start
    bool learner_checked = false;
    std::array<bool, 2> sampler_checked{false, false};
    auto check_resume = [&] {
      auto& l = d.learner();
      if (!learner_checked && !l.lines.empty()) {
        learner_checked = true;
        const auto& first = l.lines.front();
        const long resumed = first == "fresh" ? 0 : first_number(first, "resumed");
        if (resumed < 0) fail("the learner's first line is '" + first + "'");
        if (resumed != last_saved && resumed != saving_at_kill)
          fail("the learner resumed at step " + std::to_string(resumed) + " but its last checkpoint reported saved is " +
               std::to_string(last_saved) +
               (saving_at_kill >= 0 ? " (it was killed while saving " + std::to_string(saving_at_kill) + ")" : ""));
        resumes += first != "fresh";
        last_saved = resumed;
        saving_at_kill = -1;
      }
      for (int k = 0; k < 2; ++k) {
        auto& p = *d.ranks[static_cast<std::size_t>(1 + k)];
        if (sampler_checked[static_cast<std::size_t>(k)] || p.lines.empty()) continue;
        sampler_checked[static_cast<std::size_t>(k)] = true;
        const auto& first = p.lines.front();
        const long v = first == "fresh" ? -1 : first_number(first, "resumed");
        if (first != "fresh" && v < 0) fail(std::string(role_names[1 + k]) + "'s first line is '" + first + "'");
        if (v < last_batch[static_cast<std::size_t>(k)])
          fail(std::string(role_names[1 + k]) + " resumed from a worker checkpoint of version " + std::to_string(v) +
               " but it reported version " + std::to_string(last_batch[static_cast<std::size_t>(k)]) + " saved");
      }
    };
    auto note_progress = [&] {
      for (int k = 0; k < 2; ++k)
        // the last one of this round (a learner resumed from an older step republishes older versions)
        if (const auto b = d.ranks[static_cast<std::size_t>(1 + k)]->marker("batch"))
          last_batch[static_cast<std::size_t>(k)] = *b;
      if (const auto saved = d.learner().marker("saved")) last_saved = std::max(last_saved, *saved);
    };
    auto finish_checked = [&](const char* what) {
      d.pump_until(std::min(deadline, after(std::max(s.round_seconds, 3 * ref_seconds))));
      check_resume();
      for (auto& p : d.ranks)
        if (!p->ok()) fail(std::string(what) + ": " + d.states() + d.logs());
      if (d.learner().value("hash") != ref_hash)
        fail(std::string(what) + ": final hash " + d.learner().value("hash") + " != reference " + ref_hash);
      round_max = std::max(round_max, seconds_since(d.start));
    };

    if (kills >= s.kills) {  // the last round: run to the end
      finish_checked("the last run");
      ++completed;
      break;
    }
    const int victim = static_cast<int>(unit(rng) * world) % world;
    // the moment: a quarter of the kills inside the start-up (rendezvous, loading the checkpoints,
    // the first step), the others uniform over the training span, from the first step saved
    const bool in_startup = unit(rng) < 0.25;
    const double fraction = unit(rng);
    auto pump_to = [&](clock_type::time_point at, auto&& until) {
      while (clock_type::now() < at && !d.all_exited() && !until()) {
        d.pump_until(std::min(at, deadline), until);
        check_resume();
        check_time();
        for (auto& p : d.ranks)  // before the kill nobody may fail
          if (p->exited && !p->ok()) fail("before any kill this round: " + d.states() + d.logs());
      }
    };
    auto at = d.start + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(fraction * ref_ready));
    if (!in_startup) {
      pump_to(after(s.round_seconds), [&] { return d.learner().marker("saved").has_value(); });
      if (!d.learner().marker("saved") && !d.all_exited())
        fail("hang: the learner saved no step within " + std::to_string(s.round_seconds) + " s: " + d.states() + d.logs());
      at = after(fraction * ref_train);
    }
    pump_to(at, [] { return false; });
    if (victim == 0 && !in_startup && unit(rng) < 0.5) {
      // half the learner's kills inside a checkpoint save: at its next "saving" marker, within
      // the first few milliseconds of the write (the save fsyncs a file and its directory)
      const auto seen = d.learner().lines.size();
      pump_to(after(s.round_seconds), [&] {
        for (auto i = seen; i < d.learner().lines.size(); ++i)
          if (d.learner().lines[i].rfind("saving ", 0) == 0) return true;
        return false;
      });
      ::usleep(static_cast<useconds_t>(unit(rng) * 3000));
    }
    auto& v = *d.ranks[static_cast<std::size_t>(victim)];
    if (v.exited) {  // the deployment finished before the kill: check, start afresh
      finish_checked("a run that finished before its kill");
      ++completed;
      fs::remove_all(run_dir);
      last_saved = 0;
      saving_at_kill = -1;
      last_batch = {-1, -1};
      continue;
    }
    v.kill_now();
    const auto killed_at = clock_type::now();
    ++kills;
    ++killed_by_role[static_cast<std::size_t>(victim)];
    // the others must notice and exit by themselves, within the bound
    d.pump_until(std::min(deadline, after(s.round_seconds)));
    if (!d.all_exited())
      fail("hang: " + std::to_string(s.round_seconds) + " s after the " + role_names[static_cast<std::size_t>(victim)] +
           " was killed: " + d.states() + d.logs());
    const double recovery = seconds_since(killed_at);
    recovery_max = std::max(recovery_max, recovery);
    recovery_sum += recovery;
    round_max = std::max(round_max, seconds_since(d.start));
    check_resume();
    const auto saving = d.learner().marker("saving"), saved = d.learner().marker("saved");
    note_progress();
    const bool during_save = victim == 0 && saving && (!saved || *saving > *saved);
    if (during_save) saving_at_kill = *saving;
    in_save += during_save;
    std::cout << "round " << rounds << ": killed the " << role_names[static_cast<std::size_t>(victim)] << " at "
              << std::chrono::duration<double>(killed_at - d.start).count() << " s (learner at step " << last_saved
              << (during_save ? ", inside a save" : "") << "); the others exited in " << recovery << " s ("
              << d.states() << ")" << std::endl;
  }
  const double secs = seconds_since(t0);
  std::cout << "chaos loop: " << kills << " SIGKILLs (learner " << killed_by_role[0] << ", samplers "
            << killed_by_role[1] + killed_by_role[2] << ", reward rank " << killed_by_role[3] << "; " << in_save
            << " inside a learner save), " << rounds << " rounds, " << resumes << " resumes from a checkpoint, "
            << completed << " completed run(s); after a kill the others exited within " << recovery_max << " s (mean "
            << (kills > 0 ? recovery_sum / static_cast<double>(kills) : 0.0) << " s), the longest round took "
            << round_max << " s; final hash " << ref_hash << " equals the uninterrupted run's; " << secs << " s"
            << std::endl;
  return 0;
}
