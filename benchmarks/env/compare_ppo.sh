#!/usr/bin/env bash
# Side-by-side throughput of the whole PPO loop: unirl (C++) on the small-network kernels
# (`--exec automatic`), unirl on LibTorch (`--exec reference`) and the CleanRL-equivalent Python
# script on the same torch, run alternately (kernels, LibTorch, Python, kernels, ...) so all
# three see the same machine load, one thread each; prints each run's env steps/s and final
# mean return, and the ratios of the medians.
#
#   benchmarks/env/compare_ppo.sh cartpole <path/to/cartpole_ppo> [steps=102400] [repeats=3] [python=python3] [seed=1]
#   benchmarks/env/compare_ppo.sh pendulum <path/to/pendulum_ppo> [steps=102400] [repeats=3] [python=python3] [seed=1]
#
# Pendulum runs CleanRL's settings (`--preset cleanrl`, one copy) on both sides.
set -euo pipefail
env=${1:?usage: compare_ppo.sh cartpole|pendulum <binary> [steps] [repeats] [python] [seed]}
bin=${2:?usage: compare_ppo.sh cartpole|pendulum <binary> [steps] [repeats] [python] [seed]}
steps=${3:-102400}
repeats=${4:-3}
py=${5:-python3}
seed=${6:-1}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
case "$env" in
  cartpole) script="$here/cleanrl_cartpole.py"; cpp_extra=(); py_extra=() ;;
  pendulum) script="$here/cleanrl_pendulum.py"; cpp_extra=(--preset cleanrl --num-envs 1); py_extra=(--preset cleanrl) ;;
  *) echo "compare_ppo.sh: environment '$env': expected cartpole or pendulum" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 1 "$repeats"); do
  "$bin" --exec automatic "${cpp_extra[@]}" --total-steps "$steps" --seed "$seed" --out "$work/k$i" > /dev/null
  "$bin" --exec reference "${cpp_extra[@]}" --total-steps "$steps" --seed "$seed" --out "$work/t$i" > /dev/null
  "$py" "$script" "${py_extra[@]}" --total-timesteps "$steps" --seed "$seed" --out "$work/py$i.json" > /dev/null
done
"$py" - "$work" "$repeats" "$env" <<'PY'
import json, statistics, sys
work, n, env = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(fmt):
    return [json.load(open(fmt.format(i))) for i in range(1, n + 1)]
k, t, p = load(work + "/k{}/summary.json"), load(work + "/t{}/summary.json"), load(work + "/py{}.json")
def show(name, runs):
    print(f"{name:22s} steps/s: " + ", ".join(f"{r['steps_per_second']:,.0f}" for r in runs) +
          "   final mean return: " + ", ".join(f"{r['final_mean_return']:.1f}" for r in runs))
print(env)
show("C++ small_net kernels", k)
show("C++ LibTorch", t)
show("Python CleanRL", p)
med = lambda runs: statistics.median(r["steps_per_second"] for r in runs)
print(f"ratio of medians: kernels / Python {med(k) / med(p):.1f}, LibTorch / Python {med(t) / med(p):.2f}, "
      f"kernels / LibTorch {med(k) / med(t):.1f}")
PY
