#!/usr/bin/env bash
# Side-by-side throughput of the whole CartPole PPO loop: unirl (C++) vs the CleanRL-equivalent
# Python script, run alternately (C++, Python, C++, Python, ...) so both see the same machine
# load; prints each run's env steps/s and the ratio of the medians.
#
#   benchmarks/env/compare_cartpole.sh <path/to/cartpole_ppo> [steps=102400] [repeats=3] [python=python3]
set -euo pipefail
bin=${1:?usage: compare_cartpole.sh <path/to/cartpole_ppo> [steps] [repeats] [python]}
steps=${2:-102400}
repeats=${3:-3}
py=${4:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 1 "$repeats"); do
  "$bin" --total-steps "$steps" --seed 1 --out "$work/cpp$i" > /dev/null
  "$py" "$here/cleanrl_cartpole.py" --total-timesteps "$steps" --seed 1 --out "$work/py$i.json" > /dev/null
done
"$py" - "$work" "$repeats" <<'PY'
import json, statistics, sys
work, n = sys.argv[1], int(sys.argv[2])
cpp = [json.load(open(f"{work}/cpp{i}/summary.json"))["steps_per_second"] for i in range(1, n + 1)]
py = [json.load(open(f"{work}/py{i}.json"))["steps_per_second"] for i in range(1, n + 1)]
print("C++    steps/s:", ", ".join(f"{x:,.0f}" for x in cpp))
print("Python steps/s:", ", ".join(f"{x:,.0f}" for x in py))
print(f"ratio of medians (C++ / Python): {statistics.median(cpp) / statistics.median(py):.2f}")
PY
