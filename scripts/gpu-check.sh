#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and PyTorch (CUDA): builds unirl against PyTorch's own LibTorch
# with the CUDA kernels, then runs the [cuda] tests and the op benchmarks.
#   bash scripts/gpu-check.sh [build-dir]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-cuda}"
torch_dir="$(python3 -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
  -DUNIRL_ENABLE_CUDA=ON -DUNIRL_BUILD_EXAMPLES=OFF -DUNIRL_BUILD_BENCHMARKS=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${UNIRL_CUDA_ARCH:-90}"
cmake --build "$build" -j "$(nproc)" --target unit_ops_cuda unit_ops bench_ops
"$build/tests/unit/ops/unit_ops_cuda" "[cuda]"
"$build/tests/unit/ops/unit_ops"
"$build/benchmarks/ops/bench_ops" --benchmark_min_time=0.2
