// unirl-launch: starts the local processes of a deployment with torchrun's variables.
//
//   unirl-launch --nproc N [--master-addr A] [--master-port P] [--node-rank R --nnodes M]
//                [--tag-output] [--grace S] -- program args...
//
// Starts N copies of `program args...` on this machine, process r (0..N-1) with
//   RANK = R * N + r, LOCAL_RANK = r, WORLD_SIZE = M * N, LOCAL_WORLD_SIZE = N, GROUP_RANK = R,
//   MASTER_ADDR = A (default 127.0.0.1), MASTER_PORT = P (default, or 0 on one node: a free port)
// — the variables `c10d_transport::from_environment` and `data_parallel::from_environment` read,
// as torchrun sets them. `--tag-output` prefixes every line a process writes with `[rank R] `.
// SIGINT / SIGTERM / SIGHUP are forwarded to every process, which then have `--grace` seconds
// (default 5) to stop cleanly before SIGKILL; how each ended is printed, and unirl-launch exits
// with 128 + the signal. A second signal SIGKILLs them at once. When a process exits with a
// non-zero status (or is killed by a signal), the others get SIGTERM, then SIGKILL after
// `--grace` seconds, and unirl-launch exits with that status (128 + signal for a signal), naming
// the rank. Pure C++ / POSIX: no LibTorch (docs/parallel.md, "Launching").
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace {

const char* const usage =
    "usage: unirl-launch --nproc N [--master-addr A] [--master-port P] [--node-rank R --nnodes M]\n"
    "                    [--tag-output] [--grace S] -- program args...\n";

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct options {
  int nproc = 0, node_rank = 0, nnodes = 1;
  std::string master_addr = "127.0.0.1";
  std::optional<int> master_port;
  bool tag_output = false;
  double grace = 5;
  std::vector<std::string> program;
};

long parse_int(const std::string& flag, const std::string& text, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v < lo || v > hi)
    throw usage_error(flag + " = '" + text + "': expected an integer in [" + std::to_string(lo) + ", " +
                      std::to_string(hi) + "]");
  return v;
}

options parse(int argc, char** argv) {
  options o;
  bool have_nproc = false, have_node_rank = false, have_nnodes = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i], value;
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "--help" || a == "-h") throw usage_error("");
    if (a == "--tag-output") {
      o.tag_output = true;
      continue;
    }
    const auto eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (a == "--nproc" || a == "--master-addr" || a == "--master-port" || a == "--node-rank" ||
               a == "--nnodes" || a == "--grace") {
      if (i + 1 >= argc) throw usage_error(a + " needs a value");
      value = argv[++i];
    } else if (a.rfind("-", 0) == 0) {
      throw usage_error("unknown option '" + a + "'");
    } else {
      throw usage_error("unexpected argument '" + a + "': expected the options, then -- and the program");
    }
    if (a == "--nproc") {
      o.nproc = static_cast<int>(parse_int(a, value, 1, 4096));
      have_nproc = true;
    } else if (a == "--master-addr") {
      if (value.empty()) throw usage_error("--master-addr is empty: expected a host name or address");
      o.master_addr = value;
    } else if (a == "--master-port") {
      o.master_port = static_cast<int>(parse_int(a, value, 0, 65535));
    } else if (a == "--node-rank") {
      o.node_rank = static_cast<int>(parse_int(a, value, 0, 1 << 20));
      have_node_rank = true;
    } else if (a == "--nnodes") {
      o.nnodes = static_cast<int>(parse_int(a, value, 1, 1 << 20));
      have_nnodes = true;
    } else if (a == "--grace") {
      char* end = nullptr;
      o.grace = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(o.grace >= 0 && o.grace <= 3600))
        throw usage_error("--grace = '" + value + "': expected seconds in [0, 3600]");
    } else {
      throw usage_error("unknown option '" + a + "'");
    }
  }
  for (; i < argc; ++i) o.program.emplace_back(argv[i]);
  if (!have_nproc) throw usage_error("--nproc is missing: expected the number of processes to start here");
  if (o.program.empty()) throw usage_error("no program: expected -- program args... after the options");
  if (have_node_rank && !have_nnodes)
    throw usage_error("--node-rank without --nnodes: expected both (or neither, for one node)");
  if (have_nnodes && o.nnodes > 1 && !have_node_rank)
    throw usage_error("--nnodes = " + std::to_string(o.nnodes) + " without --node-rank: expected this node's rank too");
  if (o.node_rank >= o.nnodes)
    throw usage_error("--node-rank = " + std::to_string(o.node_rank) + ": expected in [0, --nnodes = " +
                      std::to_string(o.nnodes) + ")");
  if (o.nnodes > 1 && (!o.master_port || *o.master_port == 0))
    throw usage_error("--nnodes = " + std::to_string(o.nnodes) +
                      " needs --master-port (non-zero): every node must name the same port");
  return o;
}

// A TCP port that was free a moment ago (the kernel's pick), as torchrun's port 0.
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int err = errno;
  close(fd);
  if (!ok) throw std::runtime_error(std::string("cannot pick a free port: ") + std::strerror(err));
  return ntohs(a.sin_port);
}

// Signals arrive on a pipe (the self-pipe trick): the main loop forwards them.
int signal_pipe[2] = {-1, -1};
extern "C" void on_signal(int sig) {
  const int saved = errno;
  const unsigned char s = static_cast<unsigned char>(sig);
  (void)!write(signal_pipe[1], &s, 1);
  errno = saved;
}

struct child {
  int rank = 0;
  pid_t pid = -1;
  bool running = true;
  int status = 0;
  int out = -1, err = -1;  // pipes (--tag-output)
  std::string out_buf, err_buf;
};

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* name = strsignal(WTERMSIG(status));
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + (name ? std::string(" (") + name + ")" : "");
  }
  return "stopped with wait status " + std::to_string(status);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void write_all(int fd, const std::string& s) {
  std::size_t at = 0;
  while (at < s.size()) {
    const ssize_t n = write(fd, s.data() + at, s.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    at += static_cast<std::size_t>(n);
  }
}

// Moves the whole lines of `buf` (all of it at the end) to `fd`, each prefixed with the tag.
void emit_lines(std::string& buf, int fd, const std::string& tag, bool all) {
  std::string out;
  std::size_t start = 0;
  for (std::size_t nl; (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1)
    out += tag + buf.substr(start, nl - start + 1);
  buf.erase(0, start);
  if (all && !buf.empty()) {
    out += tag + buf + "\n";
    buf.clear();
  }
  write_all(fd, out);
}

// Reads what is there on a child's pipe; closes it at its end.
void drain(int& fd, std::string& buf, int to, const std::string& tag) {
  char chunk[4096];
  for (;;) {
    const ssize_t n = read(fd, chunk, sizeof(chunk));
    if (n > 0) {
      buf.append(chunk, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    close(fd);  // end of file, or an error
    fd = -1;
    emit_lines(buf, to, tag, true);
    return;
  }
  emit_lines(buf, to, tag, false);
}

void signal_all(std::vector<child>& cs, int sig) {
  for (auto& c : cs)
    if (c.running) kill(-c.pid, sig);  // the child's process group: its own children too
}

int run(const options& o) {
  const int port = o.master_port && *o.master_port != 0 ? *o.master_port : free_port();
  const int world = o.nproc * o.nnodes;

  if (pipe(signal_pipe) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  for (int fd : signal_pipe) fcntl(fd, F_SETFD, FD_CLOEXEC), fcntl(fd, F_SETFL, O_NONBLOCK);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaction(s, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::vector<std::string> env_keep;
  for (char** e = environ; *e; ++e) {
    const std::string v = *e;
    bool ours = false;
    for (const char* k : {"RANK=", "LOCAL_RANK=", "WORLD_SIZE=", "LOCAL_WORLD_SIZE=", "GROUP_RANK=", "MASTER_ADDR=",
                          "MASTER_PORT="})
      ours = ours || v.rfind(k, 0) == 0;
    if (!ours) env_keep.push_back(v);
  }

  std::vector<child> cs(static_cast<std::size_t>(o.nproc));
  for (int r = 0; r < o.nproc; ++r) {
    auto& c = cs[static_cast<std::size_t>(r)];
    c.rank = o.node_rank * o.nproc + r;
    std::vector<std::string> env = env_keep;
    env.push_back("RANK=" + std::to_string(c.rank));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(world));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(o.nproc));
    env.push_back("GROUP_RANK=" + std::to_string(o.node_rank));
    env.push_back("MASTER_ADDR=" + o.master_addr);
    env.push_back("MASTER_PORT=" + std::to_string(port));
    std::vector<char*> envp, argv;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = o.program;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2] = {-1, -1}, err[2] = {-1, -1}, exec_err[2] = {-1, -1};
    if (o.tag_output && (pipe(out) != 0 || pipe(err) != 0))
      throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    if (pipe(exec_err) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    fcntl(exec_err[1], F_SETFD, FD_CLOEXEC);
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      setpgid(0, 0);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int s : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaction(s, &dfl, nullptr);
      if (o.tag_output) {
        dup2(out[1], STDOUT_FILENO);
        dup2(err[1], STDERR_FILENO);
        close(out[0]), close(out[1]), close(err[0]), close(err[1]);
      }
      close(exec_err[0]);
      environ = envp.data();
      execvp(argv[0], argv.data());
      const int e = errno;
      (void)!write(exec_err[1], &e, sizeof(e));
      _exit(127);
    }
    setpgid(pid, pid);  // also here: no race with the kill of a group not yet made
    c.pid = pid;
    close(exec_err[1]);
    int e = 0;
    ssize_t n;
    while ((n = read(exec_err[0], &e, sizeof(e))) < 0 && errno == EINTR) {
    }
    close(exec_err[0]);
    if (o.tag_output) {
      close(out[1]), close(err[1]);
      c.out = out[0], c.err = err[0];
      fcntl(c.out, F_SETFL, O_NONBLOCK), fcntl(c.err, F_SETFL, O_NONBLOCK);
      fcntl(c.out, F_SETFD, FD_CLOEXEC), fcntl(c.err, F_SETFD, FD_CLOEXEC);
    }
    if (n == static_cast<ssize_t>(sizeof(e))) {
      waitpid(pid, nullptr, 0);
      c.running = false;
      std::cerr << "unirl-launch: cannot start '" << o.program[0] << "' for rank " << c.rank << ": "
                << std::strerror(e) << "\n";
      for (auto& d : cs)
        if (d.pid > 0 && d.running) kill(-d.pid, SIGKILL), waitpid(d.pid, nullptr, 0), d.running = false;
      return 127;
    }
  }

  using clock = std::chrono::steady_clock;
  std::optional<clock::time_point> kill_at;  // SIGKILL the rest then
  int result = 0, signals = 0;
  bool failed = false;
  for (;;) {
    std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}};
    for (auto& c : cs) {
      if (c.out >= 0) fds.push_back({c.out, POLLIN, 0});
      if (c.err >= 0) fds.push_back({c.err, POLLIN, 0});
    }
    poll(fds.data(), fds.size(), 50);

    unsigned char s = 0;
    while (read(signal_pipe[0], &s, 1) == 1) {
      if (++signals > 1) {
        std::cerr << "unirl-launch: second signal " << int(s) << " (" << strsignal(s) << "): SIGKILL to the processes\n";
        signal_all(cs, SIGKILL);
        continue;
      }
      std::cerr << "unirl-launch: got signal " << int(s) << " (" << strsignal(s) << "); forwarding it to the "
                << "processes (SIGKILL after " << o.grace << " s)\n";
      signal_all(cs, s);
      if (!failed) result = 128 + s;
      if (!kill_at) kill_at = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(o.grace));
    }
    for (auto& c : cs) {
      const std::string tag = "[rank " + std::to_string(c.rank) + "] ";
      if (c.out >= 0) drain(c.out, c.out_buf, STDOUT_FILENO, tag);
      if (c.err >= 0) drain(c.err, c.err_buf, STDERR_FILENO, tag);
    }
    bool any = false;
    for (auto& c : cs) {
      if (!c.running) continue;
      int st = 0;
      const pid_t p = waitpid(c.pid, &st, WNOHANG);
      if (p == c.pid) {
        c.running = false;
        c.status = st;
        if (signals > 0)
          std::cerr << "unirl-launch: rank " << c.rank << " (pid " << c.pid << ") " << describe(st) << "\n";
        const bool bad = !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        if (bad && !failed && !kill_at) {
          failed = true;
          result = exit_code(st);
          int rest = 0;
          for (auto& d : cs) rest += d.running ? 1 : 0;
          std::cerr << "unirl-launch: rank " << c.rank << " (pid " << c.pid << ") " << describe(st);
          if (rest > 0)
            std::cerr << "; stopping the other " << rest << " process" << (rest == 1 ? "" : "es") << " (SIGTERM, "
                      << "then SIGKILL after " << o.grace << " s)";
          std::cerr << "\n";
          signal_all(cs, SIGTERM);
          kill_at = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(o.grace));
        }
      } else {
        any = true;
      }
    }
    if (kill_at && any && clock::now() >= *kill_at) {
      for (auto& c : cs)
        if (c.running) std::cerr << "unirl-launch: rank " << c.rank << " (pid " << c.pid << ") still runs after "
                                 << o.grace << " s: SIGKILL\n";
      signal_all(cs, SIGKILL);
      kill_at = clock::now() + std::chrono::hours(1);
    }
    bool open = false;
    for (auto& c : cs) open = open || c.out >= 0 || c.err >= 0;
    if (!any && !open) break;
    if (!any && open) {
      // every process exited: read what they wrote; a grandchild may hold a pipe open, so stop there
      for (auto& c : cs) {
        const std::string tag = "[rank " + std::to_string(c.rank) + "] ";
        if (c.out >= 0) drain(c.out, c.out_buf, STDOUT_FILENO, tag);
        if (c.err >= 0) drain(c.err, c.err_buf, STDERR_FILENO, tag);
        if (c.out >= 0) emit_lines(c.out_buf, STDOUT_FILENO, tag, true), close(c.out), c.out = -1;
        if (c.err >= 0) emit_lines(c.err_buf, STDERR_FILENO, tag, true), close(c.err), c.err = -1;
      }
      break;
    }
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  try {
    o = parse(argc, argv);
  } catch (const usage_error& e) {
    if (std::string(e.what()).empty()) {
      std::cout << usage;
      return 0;
    }
    std::cerr << "unirl-launch: " << e.what() << "\n" << usage;
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "unirl-launch: " << e.what() << "\n";
    return 1;
  }
}
