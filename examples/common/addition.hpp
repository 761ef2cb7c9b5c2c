#pragma once
// Two-number addition problems for the examples: a held-out set drawn first (never trained on),
// training problems drawn from the rest, both from one seeded generator.
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace examples {

struct addition_problem {
  std::int64_t a, b;
  std::string question() const { return std::to_string(a) + "+" + std::to_string(b); }  // "12+7"
  std::string answer() const { return std::to_string(a + b); }                         // "19"
};

class addition_task {
 public:
  addition_task(std::int64_t max_operand, std::int64_t n_heldout, std::uint64_t seed)
      : max_operand_(max_operand), rng_(seed) {
    while (static_cast<std::int64_t>(heldout_.size()) < n_heldout) {
      auto p = draw_any();
      if (held_.insert({p.a, p.b}).second) heldout_.push_back(p);
    }
  }
  const std::vector<addition_problem>& heldout() const { return heldout_; }
  /// Any problem, operands uniform in [0, max_operand].
  addition_problem draw_any() {
    std::uniform_int_distribution<std::int64_t> d(0, max_operand_);
    return {d(rng_), d(rng_)};
  }
  /// A problem outside the held-out set.
  addition_problem draw_train() {
    for (;;)
      if (auto p = draw_any(); !held_.count({p.a, p.b})) return p;
  }

 private:
  std::int64_t max_operand_;
  std::mt19937_64 rng_;
  std::vector<addition_problem> heldout_;
  std::set<std::pair<std::int64_t, std::int64_t>> held_;
};

}  // namespace examples
