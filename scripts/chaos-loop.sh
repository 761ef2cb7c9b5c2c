#!/usr/bin/env bash
# The chaos loop of the split deployment (tests/crash, CTest crash.chaos_loop), for longer runs:
# a learner, two samplers and a reward rank; each round SIGKILLs one of them at a random moment,
# checks that the others exit by themselves within the bound (no hang), restarts the deployment
# from its checkpoints and checks that nothing was lost; at the end the final weights must equal
# an uninterrupted run's bit for bit.
#   bash scripts/chaos-loop.sh N [SEED]        # e.g. 50 kills
# Environment: UNIRL_CHAOS_BUILD_DIR (default build/chaos-loop; configured and built here, the two
# targets only), UNIRL_CHAOS_STEPS (default 60 learner steps a run; a run that ends before its
# kill is checked and started afresh, so any N works), UNIRL_CHAOS_ROUND_SECONDS (the bound on a
# round after its kill, default 60), UNIRL_CHAOS_SECONDS (the bound on everything, default 60 s
# per kill plus 120 s). Exit status: the driver's (0 when every check held).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kills="${1:?usage: chaos-loop.sh N [SEED]}"
seed="${2:-$RANDOM}"
build="${UNIRL_CHAOS_BUILD_DIR:-$root/build/chaos-loop}"
steps="${UNIRL_CHAOS_STEPS:-60}"
round="${UNIRL_CHAOS_ROUND_SECONDS:-60}"
seconds="${UNIRL_CHAOS_SECONDS:-$((kills * 60 + 120))}"

if [ ! -f "$build/CMakeCache.txt" ]; then
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DUNIRL_BUILD_TESTS=ON \
    -DUNIRL_BUILD_EXAMPLES=OFF -DUNIRL_BUILD_TOOLS=OFF >/dev/null
fi
cmake --build "$build" --target chaos_rank chaos_driver -j"$(nproc 2>/dev/null || echo 2)"
work="$(mktemp -d "${TMPDIR:-/tmp}/unirl-chaos-loop.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "chaos loop: $kills kills, $steps steps a run, seed $seed, ${round} s a round, bound ${seconds} s"
"$build/tests/crash/chaos_driver" --rank "$build/tests/crash/chaos_rank" --dir "$work" \
  --kills "$kills" --steps "$steps" --seed "$seed" --round-seconds "$round" --max-seconds "$seconds"
