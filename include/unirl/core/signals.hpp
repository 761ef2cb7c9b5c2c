#pragma once
/// \file signals.hpp
/// Stopping a training loop cleanly on SIGINT / SIGTERM: a `stop_request` that a loop polls
/// between steps (passed to it explicitly), and a `signal_stop_scope` that routes the signals
/// into one for its lifetime. The first signal asks for a stop (the loop finishes its step,
/// writes a checkpoint and returns); a second one ends the process at once with exit status
/// 128 + the signal (130 for SIGINT, 143 for SIGTERM), as a shell reports a killed program.
///
/// ```cpp
/// unirl::stop_request stop;
/// unirl::signal_stop_scope scope(stop);             // SIGINT, SIGTERM -> stop
/// for (auto s = t.step_count(); s < steps && !stop.requested(); ++s) t.step(prompts());
/// save();
/// if (stop.requested()) return unirl::signal_exit_status(stop.signal());  // 130 / 143
/// ```
/// The handler does only async-signal-safe work: an atomic store, `write(2)` and `_exit(2)`.
#include <atomic>
#include <csignal>
#include <cstring>
#include <initializer_list>
#include <vector>

#include <unistd.h>

#include <unirl/core/error.hpp>

namespace unirl {

/// A request to stop, made asynchronously (a signal handler, another thread) and read by a loop
/// between its steps. Holds the signal that made it (or -1 for `request()` without one).
class stop_request {
 public:
  stop_request() = default;
  stop_request(const stop_request&) = delete;
  stop_request& operator=(const stop_request&) = delete;

  /// True once a stop was asked for.
  bool requested() const noexcept { return signal_.load(std::memory_order_acquire) != 0; }
  /// The signal that asked (SIGINT, SIGTERM, ...), -1 for a plain `request()`, 0 for none.
  int signal() const noexcept { return signal_.load(std::memory_order_acquire); }
  /// Asks for a stop; the first request's signal is kept. Async-signal-safe (lock-free atomic).
  void request(int sig = -1) noexcept {
    int none = 0;
    signal_.compare_exchange_strong(none, sig == 0 ? -1 : sig, std::memory_order_acq_rel);
  }

 private:
  static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");
  std::atomic<int> signal_{0};
};

/// The exit status a program stopped by `sig` reports: 128 + sig (130 for SIGINT, 143 for
/// SIGTERM), 1 for a stop without a signal.
inline int signal_exit_status(int sig) noexcept { return sig > 0 ? 128 + sig : 1; }

/// Routes `signals` (SIGINT and SIGTERM by default) into `stop` while it lives, restoring the
/// previous handlers when it ends. Signals are process-wide, so one scope may be active at a
/// time (a second throws `unirl::error`). The first signal calls `stop.request(sig)` and writes
/// one line to stderr; a second (any of them) writes one line and `_exit`s with 128 + sig.
class signal_stop_scope {
 public:
  explicit signal_stop_scope(stop_request& stop, std::initializer_list<int> signals = {SIGINT, SIGTERM}) {
    stop_request* none = nullptr;
    if (!active().compare_exchange_strong(none, &stop))
      throw error("signal_stop_scope: another scope already handles the signals of this process");
    for (const int sig : signals) {
      struct sigaction sa {};
      sa.sa_handler = &signal_stop_scope::on_signal;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESTART;  // interrupted reads and writes resume: the step in flight finishes
      saved_.push_back({sig, {}});
      if (sigaction(sig, &sa, &saved_.back().old) != 0) saved_.pop_back();
    }
  }
  signal_stop_scope(const signal_stop_scope&) = delete;
  signal_stop_scope& operator=(const signal_stop_scope&) = delete;
  ~signal_stop_scope() {
    for (auto& s : saved_) sigaction(s.sig, &s.old, nullptr);
    active().store(nullptr);
  }

 private:
  struct saved_action {
    int sig;
    struct sigaction old;
  };

  // The one process-wide slot a handler can reach (a handler gets no argument); the loop itself
  // is handed its stop_request explicitly.
  static std::atomic<stop_request*>& active() noexcept {
    static std::atomic<stop_request*> a{nullptr};
    return a;
  }

  static void say(const char* text) noexcept {
    const auto n = std::strlen(text);
    [[maybe_unused]] const auto w = ::write(STDERR_FILENO, text, n);
  }

  static void on_signal(int sig) noexcept {
    stop_request* stop = active().load();
    if (stop == nullptr || stop->requested()) {
      say("\nunirl: second signal: exiting now, without a checkpoint\n");
      ::_exit(signal_exit_status(sig));
    }
    stop->request(sig);
    say("\nunirl: stopping after the current step and writing a checkpoint (signal again to exit now)\n");
  }

  std::vector<saved_action> saved_;
};

}  // namespace unirl
