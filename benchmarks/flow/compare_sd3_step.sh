#!/bin/sh
# One Flow-GRPO step of the small SD3 per stage, unirl against plain PyTorch, side by side in one
# run (docs/performance.md): writes the benchmark's pipeline once, then for checkpointing off / on
# runs the Python step and unirl's with and without the text-embedding cache, each in a fresh
# process (the peak resident set is per process), one LibTorch thread each (the machine is
# shared), and prints their median rows.
#
#   benchmarks/flow/compare_sd3_step.sh BUILD_DIR [PYTHON] [STEPS]
set -eu
build=$1
py=${2:-python3}
steps=${3:-3}
src=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bench="$build/benchmarks/flow/bench_sd3_step"
"$bench" --save "$work/sd3" --tokenizer "$src/tests/fixtures/diffusers/tiny_sd3/tokenizer" >/dev/null
echo "load before: $(uptime)"
for ck in 0 1; do
  "$py" "$src/benchmarks/flow/sd3_step_compare.py" --model "$work/sd3" --checkpointing $ck --steps "$steps" --threads 1 |
    sed -n 's/^median /python /p'
  for cache in 1 0; do
    "$bench" --model "$work/sd3" --cache $cache --checkpointing $ck --steps "$steps" --threads 1 | sed -n 's/^median /unirl  /p'
  done
done
echo "load after: $(uptime)"
