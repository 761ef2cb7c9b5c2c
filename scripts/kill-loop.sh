#!/usr/bin/env bash
# The checkpoint kill loop (tests/crash), for longer runs than the CTest entry crash.kill_loop:
# SIGKILLs a training process N times at random moments (most inside a save), restarts it each
# time, and checks that it resumes from its last complete checkpoint and ends with the weights of
# an uninterrupted run, bit for bit.
#   bash scripts/kill-loop.sh N [SEED]        # e.g. 500 kills
# Environment: UNIRL_KILL_LOOP_BUILD_DIR (default build/kill-loop; configured and built here, the
# two targets only), UNIRL_KILL_LOOP_CORRUPT_EVERY (default 3: every 3rd kill also truncates the
# newest checkpoint, which must be skipped with a warning), UNIRL_KILL_LOOP_SECONDS (the bound,
# default 10 s per kill plus 120 s). Exit status: the driver's (0 when every check held).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kills="${1:?usage: kill-loop.sh N [SEED]}"
seed="${2:-$RANDOM}"
build="${UNIRL_KILL_LOOP_BUILD_DIR:-$root/build/kill-loop}"
corrupt="${UNIRL_KILL_LOOP_CORRUPT_EVERY:-3}"
seconds="${UNIRL_KILL_LOOP_SECONDS:-$((kills * 10 + 120))}"
# a run of 40 steps (about 10 s uninterrupted); when the kills leave it time to finish, the run
# is checked and started afresh, so any N works
steps=40

if [ ! -f "$build/CMakeCache.txt" ]; then
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DUNIRL_BUILD_TESTS=ON \
    -DUNIRL_BUILD_EXAMPLES=OFF -DUNIRL_BUILD_TOOLS=OFF >/dev/null
fi
cmake --build "$build" --target crash_worker crash_driver -j"$(nproc 2>/dev/null || echo 2)"
work="$(mktemp -d "${TMPDIR:-/tmp}/unirl-kill-loop.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "kill loop: $kills kills, $steps steps, seed $seed, bound ${seconds} s"
"$build/tests/crash/crash_driver" --worker "$build/tests/crash/crash_worker" --dir "$work" \
  --kills "$kills" --steps "$steps" --corrupt-every "$corrupt" --seed "$seed" --max-seconds "$seconds" \
  2> >(grep -v '^unirl: warning: skipping incomplete checkpoint' >&2)
