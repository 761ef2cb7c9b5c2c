#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, the CUDA toolkit (nvcc) and PyTorch built with
# CUDA in its python3 (nothing is downloaded: unirl is built against that PyTorch's own LibTorch).
# Under ten minutes on 16 cores, it
#   1. configures unirl with UNIRL_ENABLE_CUDA=ON (kernels for this GPU's architecture) and the
#      NCCL backend when that LibTorch has it, and builds the CUDA test suite and the CPU ops suite;
#   2. runs every [cuda] test: the kernels' parity with the reference (float32 to 1e-5 relative,
#      float64 to 1e-10) and one GRPO update of an HF fixture model on the GPU against the CPU;
#   3. runs the CPU ops suite against this LibTorch;
#   4. runs the op benchmarks ([cuda-bench]) with the device's copy bandwidth and bf16 matrix rate
#      measured in the same run;
# and writes a summary (every step's result and time, the device, the benchmark lines).
#
#   bash scripts/gpu-check.sh [BUILD_DIR]
#     BUILD_DIR   build directory (default: a new one under ${TMPDIR:-/tmp})
#   Environment: UNIRL_CUDA_ARCH (default: the GPU's compute capability, e.g. 90 for an H100/H200),
#                UNIRL_GPU_CHECK_SUMMARY (default: BUILD_DIR/gpu-check-summary.txt),
#                UNIRL_GPU_CHECK_DRY=1: a rehearsal without a GPU (architecture 90 unless
#                UNIRL_CUDA_ARCH; the [cuda] tests and the benchmarks then skip, saying so)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$(mktemp -d "${TMPDIR:-/tmp}/unirl-gpu-check.XXXXXX")}"
mkdir -p "$build"
summary="${UNIRL_GPU_CHECK_SUMMARY:-$build/gpu-check-summary.txt}"
logs="$build/gpu-check-logs"
mkdir -p "$logs"
t0=$(date +%s)
: > "$summary"
say() { echo "gpu-check: $*" | tee -a "$summary"; }
failed=0
step() {  # step [--expect-skip] NAME COMMAND...: runs, logs to $logs/NAME.log, records result and time
  local skip_ok=0 name start rc verdict
  if [ "$1" = --expect-skip ]; then skip_ok=1; shift; fi
  name="$1"
  shift
  start=$(date +%s)
  "$@" > "$logs/$name.log" 2>&1
  rc=$?
  verdict="FAILED (exit $rc)"
  [ "$rc" -eq 0 ] && verdict=ok
  if [ "$rc" -eq 4 ] && [ "$skip_ok" -eq 1 ]; then verdict="skipped, as a rehearsal expects (no GPU)"; rc=0; fi
  say "[$name] $verdict in $(( $(date +%s) - start )) s (log: $logs/$name.log)"
  [ "$rc" -eq 0 ] || { failed=1; tail -n 25 "$logs/$name.log" | sed 's/^/    /' | tee -a "$summary"; }
  return "$rc"
}

say "unirl $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '(not a git checkout)') on $(hostname), $(date -u +%FT%TZ)"
# What this machine has: PyTorch with CUDA and a visible GPU, nvcc, CMake.
if ! info="$(python3 - <<'EOF' 2>&1
import os, torch
print(torch.utils.cmake_prefix_path)
if not torch.cuda.is_available() and os.environ.get("UNIRL_GPU_CHECK_DRY") == "1":
    print("90")
    print(f"PyTorch {torch.__version__}, CUDA {torch.version.cuda}; no GPU (UNIRL_GPU_CHECK_DRY=1: a rehearsal)")
    raise SystemExit(0)
assert torch.cuda.is_available(), "torch.cuda.is_available() is False: no GPU visible to PyTorch"
p = torch.cuda.get_device_properties(0)
cap = torch.cuda.get_device_capability(0)
print(f"{cap[0]}{cap[1]}")
try:
    v = torch.cuda.nccl.version()
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
except Exception:
    nccl = "none"
print(f"PyTorch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; "
      f"{torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {cap[0]}.{cap[1]}")
EOF
)"; then
  say "python3 with PyTorch and a CUDA device is needed: $info"
  exit 1
fi
prefix="$(sed -n 1p <<< "$info")"
arch="${UNIRL_CUDA_ARCH:-$(sed -n 2p <<< "$info")}"
say "device: $(sed -n 3p <<< "$info")"
nvcc="$(command -v nvcc || true)"
[ -n "$nvcc" ] || for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do [ -x "$c" ] && nvcc="$c" && break; done
if [ -z "$nvcc" ]; then
  say "nvcc not found (PATH, /usr/local/cuda*/bin): unirl's kernels and PyTorch's CMake package need the CUDA toolkit"
  exit 1
fi
say "nvcc: $("$nvcc" --version | tail -n 1); CUDA architecture $arch; build directory $build"
command -v cmake >/dev/null || { say "cmake not found"; exit 1; }
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)

# The NCCL backend when this LibTorch was built with it (PyTorch's CUDA wheels are).
nccl=OFF
python3 -c 'import sys, torch, torch.distributed as d; sys.exit(0 if d.is_available() and d.is_nccl_available() else 1)' \
  2>/dev/null && nccl=ON
if step configure cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
     -DCMAKE_PREFIX_PATH="$prefix" -DTorch_DIR="$prefix/Torch" -DCMAKE_CUDA_COMPILER="$nvcc" \
     -DUNIRL_ENABLE_CUDA=ON -DUNIRL_ENABLE_NCCL="$nccl" -DCMAKE_CUDA_ARCHITECTURES="$arch" \
     -DUNIRL_BUILD_TESTS=ON -DUNIRL_BUILD_EXAMPLES=OFF -DUNIRL_BUILD_TOOLS=OFF; then
  if step build cmake --build "$build" -j "$(nproc)" --target unit_ops_cuda unit_ops; then
    cuda_tests="$(find "$build" -name unit_ops_cuda -type f -perm -u+x | head -n 1)"
    cpu_tests="$(find "$build" -name unit_ops -type f -perm -u+x | head -n 1)"
    # Catch2 exits 4 when every test skipped (no GPU): a failure here, where a GPU is the point,
    # and what a rehearsal expects.
    skipped_ok=()
    [ "${UNIRL_GPU_CHECK_DRY:-0}" = 1 ] && skipped_ok=(--expect-skip)
    step "${skipped_ok[@]}" cuda_tests "$cuda_tests" "[cuda]" --reporter compact --durations yes
    grep -E 'passed|failed|skipped' "$logs/cuda_tests.log" | tail -n 3 | sed 's/^/    /' | tee -a "$summary"
    step cpu_ops_tests "$cpu_tests" --reporter compact
    grep -E 'passed|failed' "$logs/cpu_ops_tests.log" | tail -n 2 | sed 's/^/    /' | tee -a "$summary"
    step "${skipped_ok[@]}" benchmarks "$cuda_tests" "[cuda-bench]" --reporter compact
    grep '^unirl-bench' "$logs/benchmarks.log" | sed 's/^unirl-bench /    /' | tee -a "$summary"
  fi
fi
say "total $(( $(date +%s) - t0 )) s; $([ "$failed" -eq 0 ] && echo 'every step passed' || echo 'a step FAILED'); summary: $summary"
exit "$failed"
