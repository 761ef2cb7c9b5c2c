// Random mutations of a seed corpus, without coverage feedback: the input generator of the
// mutation driver (mutation_driver.cpp) and of the bounded fuzz properties that run inside the
// unit suites (tests/unit/rollout/test_engine_fuzz.cpp). Each input after the seeds (given once,
// unchanged) is 1-8 mutations — bit flips, byte sets, inserts, erasures, duplicated ranges,
// dictionary tokens, splices of two seeds, truncation, interesting integers as text — of a seed or
// of the previous input. Deterministic for a given seed.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace unirl_fuzz {

class mutator {
 public:
  mutator(std::vector<std::string> corpus, std::vector<std::string> dict, std::uint64_t seed, std::size_t max_len = 16384)
      : corpus_(std::move(corpus)), dict_(std::move(dict)), rng_(seed), max_len_(max_len) {
    if (corpus_.empty()) corpus_.emplace_back();
  }

  /// The next input: the seeds first, then mutations.
  const std::string& next() {
    if (run_ < corpus_.size()) {
      x_ = corpus_[run_++];  // every seed once, unchanged
      return x_;
    }
    ++run_;
    std::string& x = x_;
    auto& rng = rng_;
    const auto& corpus = corpus_;
    const auto& dict = dict_;
    auto below = [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(rng() % n); };
    if (x.empty() || below(4) == 0) x = corpus[below(corpus.size())];
    const auto k = 1 + below(8);
    for (std::size_t m = 0; m < k; ++m) {
      const std::size_t at = below(x.size() + 1);
      switch (below(9)) {
        case 0: if (!x.empty()) x[below(x.size())] ^= static_cast<char>(1u << below(8)); break;
        case 1: if (!x.empty()) x[below(x.size())] = static_cast<char>(rng()); break;
        case 2: x.insert(at, 1 + below(4), static_cast<char>(rng())); break;
        case 3: if (at < x.size()) x.erase(at, 1 + below(std::min<std::size_t>(16, x.size() - at))); break;
        case 4: if (at < x.size()) x.insert(below(x.size() + 1), x.substr(at, 1 + below(std::min<std::size_t>(64, x.size() - at)))); break;
        case 5: if (!dict.empty()) x.insert(at, dict[below(dict.size())]); break;
        case 6: {
          const auto& o = corpus[below(corpus.size())];
          if (!o.empty()) x = x.substr(0, at) + o.substr(below(o.size()));
          break;
        }
        case 7: x.resize(at); break;
        default: {  // an interesting integer as text
          static const char* nums[] = {"0", "-1", "1e309", "-0", "18446744073709551616", "9223372036854775808",
                                       "4294967296", "nan", "1e-400", "65536"};
          x.insert(at, nums[below(std::size(nums))]);
        }
      }
    }
    if (x.size() > max_len_) x.resize(max_len_);
    return x_;
  }

 private:
  std::vector<std::string> corpus_, dict_;
  std::mt19937_64 rng_;
  std::size_t max_len_;
  std::size_t run_ = 0;
  std::string x_;
};

}  // namespace unirl_fuzz
