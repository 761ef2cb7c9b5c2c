#!/usr/bin/env bash
# Side-by-side throughput of the whole CartPole PPO loop (compare_ppo.sh cartpole): unirl on the
# small-network kernels, unirl on LibTorch and the CleanRL-equivalent Python script, alternately.
#
#   benchmarks/env/compare_cartpole.sh <path/to/cartpole_ppo> [steps=102400] [repeats=3] [python=python3] [seed=1]
set -euo pipefail
exec "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/compare_ppo.sh" cartpole "$@"
