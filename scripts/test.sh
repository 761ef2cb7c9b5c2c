#!/usr/bin/env bash
# The whole test suite: install what is needed, build everything, run CTest.
#   bash scripts/test.sh            # every test but [cuda]
#   UNIRL_TEST_ARGS="-L package" bash scripts/test.sh
#   UNIRL_TEST_ARGS= bash scripts/test.sh    # also the entries labelled `full` (headers.self_contained)
# Default CTest arguments: -LE full (leaves out the ~14-minute header self-containment check).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
build="${UNIRL_BUILD_DIR:-$root/build}"
jobs="$(nproc)"
start=$(date +%s)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUNIRL_BUILD_TESTS=ON -DUNIRL_BUILD_EXAMPLES=ON
cmake --build "$build" -j "$jobs"
built=$(date +%s)
ctest --test-dir "$build" -j "$jobs" --output-on-failure ${UNIRL_TEST_ARGS--LE full}
echo "unirl: build $((built - start)) s, tests $(( $(date +%s) - built )) s"
