#pragma once
/// \file worker_pool.hpp
/// Not API. A fixed set of threads started once that run one job at a time: `run(k, f)` calls
/// `f(0)` on the calling thread and `f(1) .. f(k - 1)` on workers, and returns when all have
/// returned, rethrowing the first error (lowest index). A vectorised environment steps its
/// copies on it every step: each step costs a wake-up, not a thread start and join.
///
/// ```cpp
/// unirl::detail::worker_pool pool(3);                       // the caller + 3 workers
/// pool.run(4, [&](std::int64_t w) { step_share(w); });     // shares 0..3 at once
/// ```
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace unirl::detail {

class worker_pool {
 public:
  /// Starts `workers` threads (the caller is one more).
  explicit worker_pool(std::int64_t workers) {
    threads_.reserve(static_cast<std::size_t>(workers));
    for (std::int64_t w = 1; w <= workers; ++w) threads_.emplace_back([this, w] { loop(w); });
  }
  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;
  ~worker_pool() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  /// Jobs it runs at once: the workers and the caller.
  std::int64_t size() const { return static_cast<std::int64_t>(threads_.size()) + 1; }

  /// Runs `f(w)` for w in [0, k) (k is capped at size()), f(0) on this thread; returns when
  /// every call has returned; rethrows the exception of the lowest w that threw. One `run` at a
  /// time: the pool belongs to one owner.
  template <class F>
  void run(std::int64_t k, F&& f) {
    if (k < 1) return;
    if (k > size()) k = size();
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(k));
    auto guarded = [&](std::int64_t w) {
      try {
        f(w);
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    };
    {
      std::lock_guard<std::mutex> l(m_);
      job_ = guarded;
      active_ = k;
      pending_ = k - 1;
      ++generation_;
    }
    wake_.notify_all();
    guarded(0);
    {
      std::unique_lock<std::mutex> l(m_);
      done_.wait(l, [this] { return pending_ <= 0; });
      job_ = nullptr;
    }
    for (const auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

 private:
  void loop(std::int64_t w) {
    std::uint64_t seen = 0;
    for (;;) {
      std::function<void(std::int64_t)> job;
      {
        std::unique_lock<std::mutex> l(m_);
        wake_.wait(l, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (w >= active_) continue;  // a smaller job: not this worker's turn
        job = job_;
      }
      job(w);
      std::lock_guard<std::mutex> l(m_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex m_;
  std::condition_variable wake_, done_;
  std::function<void(std::int64_t)> job_;
  std::int64_t active_ = 0, pending_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace unirl::detail
