// Fuzz target (mutation driver, see scripts/fuzz.sh): the rollout engine's options and requests
// (rollout/engine.hpp) — what a serving front end or an agent loop hands the engine — on a tiny
// built-in GPT (vocabulary 11).
//   bash scripts/fuzz.sh engine_request 60
// The input is read as a little program: engine options (block size, pool size, sequences, token
// budget, prefix cache), then up to four requests (prompt ids, in range or not; max_new_tokens,
// temperature, top_k, top_p, stop tokens, n, seed, stop strings — empty ones too — and pause),
// then what to do with a paused sample (resume with some ids, or release). Bad values must be
// refused by a `unirl::error` before any work (the engine's constructor or `submit`); what is
// accepted must run to the end within a bounded number of steps, no step throwing, and satisfy: every accepted
// request yields each of its n samples exactly once with a final reason; a turn holds 1 ..
// max_new_tokens tokens (ids in [0, 11)) with as many log-probs, none NaN or positive; a
// stop-token turn ends with a stop token, a length turn is exactly max_new_tokens long; with every
// sequence finished or released the pool holds no block. A broken invariant throws
// (engine_request_input.hpp), which ends the run as a finding. CI runs the same function on
// 2 000 mutated inputs inside unit_rollout (test_engine_fuzz.cpp).
// unirl-fuzz: links unirl::unirl
// unirl-fuzz: includes LibTorch (built with g++ and the mutation driver, see scripts/fuzz.sh)
#include <cstddef>
#include <cstdint>

#include "engine_request_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return unirl_fuzz::engine_request::one_input(data, size);
}
