#!/usr/bin/env bash
# The reward server under hostile load, longer and larger than the CTest entries (the [server]
# cases of tests/unit/rewards/test_server_load.cpp): CONNECTIONS idle and slow connections held for
# SECONDS while ordinary requests are timed, a burst of BURST concurrent requests, ROUNDS times.
#   bash scripts/load-soak.sh [CONNECTIONS] [BURST] [SECONDS] [ROUNDS]    # default 4000 4000 60 3
# Builds unirl_rewards_tests in build/ (UNIRL_BUILD_DIR) if needed; prints the figures each round
# (threads, resident memory, latencies) and exits non-zero on the first failed check.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${UNIRL_BUILD_DIR:-$root/build}"
export UNIRL_LOAD_CONNECTIONS="${1:-4000}" UNIRL_LOAD_BURST="${2:-4000}" UNIRL_LOAD_HOLD_S="${3:-60}"
rounds="${4:-3}"
cmake --build "$build" --target unirl_rewards_tests -j1
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
for r in $(seq 1 "$rounds"); do
  echo "load soak: round $r of $rounds: $UNIRL_LOAD_CONNECTIONS connections for $UNIRL_LOAD_HOLD_S s, a burst of $UNIRL_LOAD_BURST"
  "$build/tests/unit/rewards/unirl_rewards_tests" "[server]"
done
