#pragma once
/// \file host.hpp
/// Reading device values on the host, which synchronises with the device: the trainer's hot
/// path does it through `to_host` only — once per minibatch (the found-non-finite flag) and once
/// per step (the statistics) — and defers checks of device values (`deferred_checks`) to those
/// reads instead of reading them where they are made.
///
/// ```cpp
/// unirl::deferred_checks checks;                                  // checks made in this scope wait
/// auto lp = unirl::ops::token_logprob(logits, targets);           // records its bounds check
/// std::vector<double> v = unirl::to_host(torch::stack({loss, norm}));   // one read
/// checks.verify();                                                // throws a failed check's message
/// ```
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/error.hpp>

namespace unirl {

namespace detail {
inline std::atomic<std::int64_t>& host_read_counter() {
  static std::atomic<std::int64_t> n{0};
  return n;
}
}  // namespace detail

/// How many times `to_host` copied device values to the host since the program started (and
/// `batch::select` read an index given on a device: a host index is no read).
inline std::int64_t host_reads() { return detail::host_read_counter().load(); }

/// The values of `t` (any shape, read in row-major order) as doubles: one device-to-host copy,
/// counted by `host_reads()`. An undefined or empty tensor gives an empty vector and no read.
inline std::vector<double> to_host(const torch::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return {};
  ++detail::host_read_counter();
  const auto c = t.detach().reshape({-1}).to(torch::kCPU, torch::kFloat64).contiguous();
  const double* p = c.data_ptr<double>();
  return {p, p + c.numel()};
}

/// Checks of device values that wait for a read the caller makes anyway. While a
/// `deferred_checks` object is alive on this thread (the trainer opens one per step), ops that
/// can defer a check (`ops::token_logprob`'s target bounds, the GPT's positions) `add` it here and
/// go on with clamped indices; outside such a scope they check at once. `values()` is the tensor
/// to read with the caller's own figures, `verify(read)` throws the message of the first failed
/// check.
class deferred_checks {
 public:
  /// Builds the message of a failed check from the values it recorded (as doubles).
  using message_fn = std::function<std::string(const std::vector<double>&)>;

  deferred_checks() : outer_(current_ref()) { current_ref() = this; }
  ~deferred_checks() { current_ref() = outer_; }
  deferred_checks(const deferred_checks&) = delete;
  deferred_checks& operator=(const deferred_checks&) = delete;

  /// The innermost scope on this thread, or nullptr.
  static deferred_checks* current() { return current_ref(); }

  /// Records a check: `ok` is a bool (or 0/1) scalar tensor, `values` what the message shows.
  void add(const torch::Tensor& ok, const torch::Tensor& values, message_fn message) {
    torch::NoGradGuard ng;
    checks_.push_back({ok.detach().reshape({1}).to(torch::kFloat64),
                       values.defined() ? values.detach().reshape({-1}).to(ok.device(), torch::kFloat64)
                                        : torch::zeros({0}, torch::TensorOptions(torch::kFloat64).device(ok.device())),
                       std::move(message)});
  }
  /// True when no check is waiting.
  bool empty() const { return checks_.empty(); }
  /// Everything recorded since the last `verify`, flattened into one float64 tensor (empty when
  /// nothing is waiting); read it together with other figures and pass the read to `verify`.
  torch::Tensor values() const {
    std::vector<torch::Tensor> parts;
    for (const auto& c : checks_) {
      parts.push_back(c.ok.to(checks_.front().ok.device()));
      parts.push_back(c.values.to(checks_.front().ok.device()));
    }
    return parts.empty() ? torch::Tensor{} : torch::cat(parts);
  }
  /// Throws `unirl::error` with the message of the first failed check, given the read of
  /// `values()`; clears the recorded checks either way.
  void verify(const std::vector<double>& read) {
    auto pending = std::move(checks_);
    checks_.clear();
    std::size_t at = 0;
    for (const auto& c : pending) {
      UNIRL_CHECK(at + 1 + static_cast<std::size_t>(c.values.numel()) <= read.size(),
                  "deferred_checks::verify: the read holds ", read.size(), " values; expected those of values()");
      const bool ok = read[at] != 0.0;
      const std::vector<double> v(read.begin() + static_cast<std::ptrdiff_t>(at) + 1,
                                  read.begin() + static_cast<std::ptrdiff_t>(at) + 1 + c.values.numel());
      at += 1 + static_cast<std::size_t>(c.values.numel());
      if (!ok) throw error("unirl: " + c.message(v));
    }
  }
  /// Reads the waiting checks on their own (one read) and verifies them.
  void verify() {
    if (checks_.empty()) return;
    verify(to_host(values()));
  }

 private:
  struct check {
    torch::Tensor ok, values;
    message_fn message;
  };
  static deferred_checks*& current_ref() {
    thread_local deferred_checks* p = nullptr;
    return p;
  }
  deferred_checks* outer_;
  std::vector<check> checks_;
};

}  // namespace unirl
