#!/usr/bin/env bash
# Whole-run parity of ppo_agent's two paths: trains CartPole-v1 (examples/10_cartpole_ppo,
# CleanRL's ppo.py settings) and Pendulum-v1 (examples/11_pendulum_ppo, its default `tuned`
# preset) on the small-network kernels (`--exec automatic`) and on LibTorch (`--exec reference`)
# for each seed, one after another, one thread each, and prints a Markdown table of the final
# mean return (the last 20 episodes) per seed and path, with each run's seconds. The two paths
# draw their random numbers differently, so the same seed gives different runs; the comparison
# is the returns each reaches on the same budget.
#
#   scripts/env-parity.sh [build=build] [cartpole_steps=500000] [pendulum_steps=400000] [seeds="1 2 3 4 5"] [out=<temp dir>]
#
# docs/performance.md ("Returns on both paths") has the table this printed.
set -euo pipefail
build=${1:-build}
cartpole_steps=${2:-500000}
pendulum_steps=${3:-400000}
seeds=${4:-1 2 3 4 5}
out=${5:-}
cartpole="$build/examples/10_cartpole_ppo/cartpole_ppo"
pendulum="$build/examples/11_pendulum_ppo/pendulum_ppo"
for b in "$cartpole" "$pendulum"; do
  [[ -x "$b" ]] || { echo "env-parity.sh: '$b' is not built (cmake --build $build --target cartpole_ppo pendulum_ppo)" >&2; exit 2; }
done
if [[ -z "$out" ]]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
# A run whose summary.json is already in `out` is not run again: an interrupted table resumes,
# and seeds can be run as separate invocations into one `out` before a last one prints them all.
run() {  # run <binary> <name> <steps> <exec> <seed>
  local dir="$out/$2_$4_$5"
  [[ -f "$dir/summary.json" ]] && return 0
  "$1" --exec "$4" --total-steps "$3" --seed "$5" --out "$dir" > "$dir.log"
}
for s in $seeds; do
  for e in automatic reference; do
    run "$cartpole" cartpole "$cartpole_steps" "$e" "$s"
    run "$pendulum" pendulum "$pendulum_steps" "$e" "$s"
  done
done
python3 - "$out" "$seeds" "$cartpole_steps" "$pendulum_steps" <<'PY'
import json, statistics, sys
out, seeds, steps = sys.argv[1], sys.argv[2].split(), {"cartpole": sys.argv[3], "pendulum": sys.argv[4]}
names = {"cartpole": "CartPole-v1", "pendulum": "Pendulum-v1 (tuned)"}
paths = {"automatic": "kernels", "reference": "LibTorch"}
print("| environment, steps | path | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | seconds per run |")
print("|---|---|" + "---|" * len(seeds) + "---|---|")
for env in ("cartpole", "pendulum"):
    for exec_, label in paths.items():
        runs = [json.load(open(f"{out}/{env}_{exec_}_{s}/summary.json")) for s in seeds]
        assert all(r["path"] == ("small_net" if exec_ == "automatic" else "libtorch") for r in runs), runs
        ret = [r["final_mean_return"] for r in runs]
        sec = [r["seconds"] for r in runs]
        print(f"| {names[env]}, {runs[0]['env_steps']:,} | {label} | " + " | ".join(f"{x:.1f}" for x in ret) +
              f" | {statistics.mean(ret):.1f} | {min(sec):.0f}–{max(sec):.0f} |")
PY
