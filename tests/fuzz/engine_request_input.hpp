// The fuzz input of the rollout engine's options and requests, as one function: the body of the
// fuzz target fuzz_engine_request.cpp (its file comment says what is checked) and of the bounded
// property test that runs it in CI (tests/unit/rollout/test_engine_fuzz.cpp).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/rollout/engine.hpp>

namespace unirl_fuzz::engine_request {
constexpr std::int64_t vocab = 11;

// Reads bytes off the input; zeros once it is spent.
struct reader {
  const std::uint8_t* p;
  std::size_t n, at = 0;
  std::uint8_t byte() { return at < n ? p[at++] : 0; }
  bool more() const { return at < n; }
  // Values around the edges of what is valid, and some way past them.
  std::int64_t small(std::int64_t lo, std::int64_t hi) { return lo + byte() % (hi - lo + 1); }
  double real() {
    switch (byte() % 12) {
      case 0: return 0.0;
      case 1: return -1.0;
      case 2: return std::numeric_limits<double>::quiet_NaN();
      case 3: return std::numeric_limits<double>::infinity();
      case 4: return 1e-300;
      case 5: return 1.0;
      case 6: return 1.0000001;
      case 7: return 1e300;
      default: return static_cast<double>(byte()) / 64.0;
    }
  }
};

inline const unirl::models::gpt& model() {
  static const auto* m = [] {
    torch::set_num_threads(1);
    torch::manual_seed(3);
    auto* g = new unirl::models::gpt(
        unirl::models::gpt_options{.vocab_size = vocab, .max_len = 48, .n_layer = 1, .n_head = 2, .d_model = 16});
    g->train(false);
    return g;
  }();
  return *m;
}

inline std::string letters(const std::vector<std::int64_t>& t) {
  std::string s;
  for (const auto x : t) s += static_cast<char>('a' + x);
  return s;
}

/// A broken invariant (not a unirl::error: nothing in the target catches it).
struct invariant_failed : std::logic_error {
  using std::logic_error::logic_error;
};

#define UNIRL_FUZZ_CHECK(ok)                                                                                \
  do {                                                                                                     \
    if (!(ok)) throw invariant_failed("engine_request: invariant failed, line " + std::to_string(__LINE__) + \
                                      ": " #ok);                                                            \
  } while (0)

/// Runs one input (see the file comment); throws `invariant_failed` on a finding.
inline int one_input(const std::uint8_t* data, std::size_t size) {
  reader in{data, size};
  const auto& m = model();
  unirl::rollout::engine_options eo{.block_size = in.small(0, 9), .kv_tokens = in.small(-1, 120),
                                    .max_sequences = in.small(0, 9), .max_batch_tokens = in.small(0, 40),
                                    .prefix_cache = in.byte() % 2 == 0};
  std::optional<unirl::rollout::engine<unirl::models::gpt>> eng;
  try {
    eng.emplace(m, eo, letters);
  } catch (const unirl::error&) {
    return 0;  // refused options
  }
  struct accepted {
    std::int64_t n, max_new;
    std::vector<std::int64_t> stops;
  };
  std::map<std::int64_t, accepted> requests;
  const int count = 1 + in.byte() % 4;
  for (int k = 0; k < count && in.more(); ++k) {
    unirl::rollout::request r;
    const auto len = in.small(0, 20);
    for (std::int64_t i = 0; i < len; ++i) r.prompt.push_back(in.small(-2, vocab + 1));
    r.sampling.max_new_tokens = in.small(-1, 14);
    r.sampling.temperature = in.real();
    r.sampling.top_k = in.small(-1, 12);
    r.sampling.top_p = in.real();
    for (std::int64_t i = in.small(0, 3); i > 0; --i) r.sampling.stop_tokens.push_back(in.small(-1, vocab));
    r.seed = in.byte();
    r.n = in.small(0, 10);
    for (std::int64_t i = in.small(0, 2); i > 0; --i) r.stop_strings.push_back(std::string(in.small(0, 2), 'a' + in.byte() % 11));
    r.pause_at_stop_string = in.byte() % 3 == 0;
    const auto req = r;
    try {
      const auto id = eng->submit(std::move(r));
      requests[id] = {req.n, req.sampling.max_new_tokens, req.sampling.stop_tokens};
    } catch (const unirl::error&) {
      // refused before any work: the engine is still usable
    }
  }
  std::map<std::int64_t, std::int64_t> finished;  // per request: samples with a final reason
  std::map<std::int64_t, std::int64_t> turn_limit;  // per resumed sequence: its next turn's max_new_tokens
  std::int64_t steps = 0;
  while (eng->has_work()) {
    UNIRL_FUZZ_CHECK(++steps <= 4000);  // the engine always makes progress
    // An accepted request fails no step: a bad value is refused by submit, before any work.
    const auto out = eng->step();
    for (const auto& r : out) {
      const auto it = requests.find(r.request);
      UNIRL_FUZZ_CHECK(it != requests.end());
      UNIRL_FUZZ_CHECK(r.sample >= 0 && r.sample < it->second.n);
      const auto limit = turn_limit.count(r.sequence) ? turn_limit[r.sequence] : it->second.max_new;
      UNIRL_FUZZ_CHECK(!r.tokens.empty() && static_cast<std::int64_t>(r.tokens.size()) <= limit);
      UNIRL_FUZZ_CHECK(r.tokens.size() == r.logp.size());
      for (const auto t : r.tokens) UNIRL_FUZZ_CHECK(t >= 0 && t < vocab);
      for (const auto l : r.logp) UNIRL_FUZZ_CHECK(!std::isnan(l) && l <= 1e-9);
      if (r.reason == unirl::rollout::finish_reason::length)
        UNIRL_FUZZ_CHECK(static_cast<std::int64_t>(r.tokens.size()) == limit);
      if (r.reason == unirl::rollout::finish_reason::stop_token) {
        bool stop = false;
        for (const auto s : it->second.stops) stop = stop || s == r.tokens.back();
        UNIRL_FUZZ_CHECK(stop);
      }
      if (r.reason == unirl::rollout::finish_reason::paused) {
        if (in.byte() % 2 == 0) {
          std::vector<std::int64_t> reply;
          for (std::int64_t i = in.small(0, 3); i > 0; --i) reply.push_back(in.small(-1, vocab));
          const auto max_new = in.small(-1, 6);
          try {
            eng->resume(r.sequence, reply, max_new);
            turn_limit[r.sequence] = max_new > 0 ? max_new : it->second.max_new;
            continue;  // the sample goes on
          } catch (const unirl::error&) {
          }
        }
        eng->release(r.sequence);
      }
      ++finished[r.request];
    }
  }
  for (const auto& [id, a] : requests) UNIRL_FUZZ_CHECK(finished[id] == a.n);
  UNIRL_FUZZ_CHECK(eng->pool().used_blocks() == 0);
  return 0;
}

#undef UNIRL_FUZZ_CHECK
}  // namespace unirl_fuzz::engine_request
