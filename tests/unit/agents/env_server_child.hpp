// An environment server in a forked child process (real sockets on loopback), for the tests of
// the environment service (test_environment_service.cpp, test_episodes.cpp).
#pragma once
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include <unirl/agents/environment_server.hpp>
#include <unirl/envs/guess_number.hpp>

#include "../rewards/forked_server.hpp"

namespace env_service_test {
using unirl::agents::environment_server;
using unirl::envs::guess_number;

using steady = std::chrono::steady_clock;
inline double since(steady::time_point t0) { return std::chrono::duration<double>(steady::now() - t0).count(); }

// The game, each step taking `delay_ms` (a slow environment, to hold requests in flight).
struct slow_guess : guess_number {
  int delay_ms = 0;
  unirl::text_step step(const std::string& a) {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    return guess_number::step(a);
  }
};

// An environment server in a forked child, hosting `env`; killed with the object. With
// `until_signal` it serves until SIGINT / SIGTERM and exits 0 for SIGTERM.
struct child_env_server : rewards_test::forked_server {
  template <class E>
  child_env_server(E env, unirl::agents::environment_server_options o, bool until_signal = false)
      : forked_server([env, o, until_signal](int fd) mutable {
          o.http.log_errors = false;
          environment_server server{env, o};
          server.start();
          rewards_test::write_value(fd, server.port());
          if (!until_signal)
            for (;;) ::pause();
          if (unirl::rewards::serve_until_signal(server) != SIGTERM) throw std::runtime_error("stopped, but not by SIGTERM");
        }) {}
  std::string base() const { return "http://127.0.0.1:" + std::to_string(port) + "/"; }
};

}  // namespace env_service_test
