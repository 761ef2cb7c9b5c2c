// A reward server in a forked child process, for the tests that must survive its crash or
// watch it from outside (test_remote.cpp, test_server_load.cpp).
#pragma once
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include <catch2/catch.hpp>

namespace rewards_test {

// A reward server in a child process, so that a crash — the defect under test — fails the test
// instead of killing the test binary. `host(fd)` runs in the child: it starts a server, writes
// its port to fd, and may write more (see `read_value`). The child is killed with the object.
struct forked_server {
  pid_t pid = -1;
  int fd = -1;
  int status = 0;
  std::uint16_t port = 0;
  template <class F>
  explicit forked_server(F host) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(fds[0]);
      try {
        host(fds[1]);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    ::close(fds[1]);
    fd = fds[0];
    port = read_value<std::uint16_t>();
    REQUIRE(port != 0);
  }
  template <class T>
  T read_value() {
    T v{};
    return ::read(fd, &v, sizeof v) == static_cast<ssize_t>(sizeof v) ? v : T{};
  }
  bool alive() {
    if (pid <= 0) return false;
    if (::waitpid(pid, &status, WNOHANG) == 0) return true;
    pid = -1;
    return false;
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port) + "/score"; }
  // Waits up to `timeout_s` for the child's exit; its wait status, or -1.
  int wait_exit(double timeout_s) {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
      int st = 0;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        return st;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return -1;
  }
  ~forked_server() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    if (fd >= 0) ::close(fd);
  }
};

template <class T>
void write_value(int fd, const T& v) {
  if (::write(fd, &v, sizeof v) != static_cast<ssize_t>(sizeof v)) ::_exit(4);
}

}  // namespace rewards_test
