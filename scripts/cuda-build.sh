#!/usr/bin/env bash
# Builds unirl with its CUDA kernels and the NCCL backend against Debian 13's CUDA LibTorch, and
# runs the CPU test suite against that LibTorch (no GPU is needed: the [cuda] tests are compiled
# and skip, saying why). Run it after every change to CUDA code, kernels or device placement.
#
# Makes a Debian 13 (trixie) root with debootstrap (components main, contrib and non-free:
# libtorch-cuda-dev is LibTorch 2.6 with CUDA, nvidia-cuda-toolkit is CUDA 12.4, libnccl-dev is
# NCCL 2.22), installs unirl's dependencies there (scripts/install-deps.sh --cuda), puts the
# repository in it and, inside it with chroot, configures with UNIRL_ENABLE_CUDA=ON, the NCCL
# backend and CMAKE_CUDA_ARCHITECTURES "80;90", builds and runs `ctest -LE full`. The root is a
# cache: a second run on the same DIR reuses it (and its build directory and ccache) and copies
# the repository in again. Needs root, debootstrap and chroot, and disk: the root with its
# packages installed is about 11 GB (the 6 GB downloaded are removed after installing), plus the
# build (the CPU build's tree is about 2 GB).
#
#   sudo bash scripts/cuda-build.sh [options] DIR
#     DIR              the root (made when it does not exist or is empty; reused when this script
#                      made it); or set UNIRL_CUDA_ROOT
#     --worktree       copy the working tree (uncommitted changes included) instead of a clone of HEAD
#     --mirror URL     Debian mirror (default: the first one the host's apt sources name)
#     --targets "A B"  build only these targets (default: all)
#     --tests REGEX    run only the CTest entries matching REGEX (default: all but `full`)
#     --no-tests       build only
#     -j N             build and test jobs (default 1: one nvcc or g++ with LibTorch takes GBs)
#     --slot NAME      the repository's copy and build directory in the root: /root/NAME and
#                      /root/NAME-build (default unirl), so that two runs can share one root
#
# Logs: DIR/unirl-cuda/{setup,configure,build,test}.log (DIR/NAME-cuda/ for another slot).
# Build directory: DIR/root/unirl-build.
set -euo pipefail

worktree=0
mirror=""
targets=""
tests_regex=""
run_tests=1
jobs=1
slot=unirl
dir="${UNIRL_CUDA_ROOT:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --worktree) worktree=1; shift ;;
    --mirror) mirror="$2"; shift 2 ;;
    --mirror=*) mirror="${1#*=}"; shift ;;
    --targets) targets="$2"; shift 2 ;;
    --targets=*) targets="${1#*=}"; shift ;;
    --tests) tests_regex="$2"; shift 2 ;;
    --tests=*) tests_regex="${1#*=}"; shift ;;
    --no-tests) run_tests=0; shift ;;
    --slot) slot="$2"; shift 2 ;;
    --slot=*) slot="${1#*=}"; shift ;;
    -j) jobs="$2"; shift 2 ;;
    -j*) jobs="${1#-j}"; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "cuda-build: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) dir="$1"; shift ;;
  esac
done
if [ -z "$dir" ]; then
  echo "cuda-build: give the root's directory (DIR or UNIRL_CUDA_ROOT); it is kept as a cache" >&2; exit 2
fi
case "$slot" in ''|*[!A-Za-z0-9_-]*) echo "cuda-build: --slot '$slot': expected letters, digits, - or _" >&2; exit 2 ;; esac
case "$jobs" in ''|*[!0-9]*|0) echo "cuda-build: -j '$jobs': expected a positive integer" >&2; exit 2 ;; esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tag=cuda-build
# shellcheck source=scripts/debian-root.sh
. "$repo/scripts/debian-root.sh"
require_root_tools
git -C "$repo" rev-parse --git-dir >/dev/null 2>&1 || { echo "cuda-build: $repo is not a git repository" >&2; exit 2; }
mirror="${mirror:-$(host_mirror)}"
mirror="${mirror%/}"

mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
logs="$dir/$slot-cuda"
trap unmount_all EXIT
trap "exit 143" TERM INT

t0=$(date +%s)
if [ -x "$dir/usr/bin/apt-get" ]; then
  echo "cuda-build: reusing the root in $dir"
  mkdir -p "$logs"
elif [ -n "$(ls -A "$dir")" ]; then
  echo "cuda-build: $dir is neither empty nor a root this script made" >&2; exit 2
else
  echo "cuda-build: debootstrap trixie (main, contrib, non-free) from $mirror into $dir"
  mkdir -p "$logs"
  debootstrap --variant=minbase --components=main,contrib,non-free trixie "$dir" "$mirror" > "$logs/setup.log" 2>&1 ||
    { tail -n 20 "$logs/setup.log"; echo "cuda-build: debootstrap failed" >&2; exit 1; }
fi
# contrib and non-free hold the CUDA packages (also in a root made from a main-only one).
echo "deb $mirror trixie main contrib non-free" > "$dir/etc/apt/sources.list"
rm -f "$dir/etc/apt/sources.list.d/debian.sources"
prepare_root

echo "cuda-build: copying the repository"
dest="$dir/root/$slot"
what="$(copy_repo "$repo" "$dest" "$worktree" 0)"
echo "cuda-build: installing the dependencies (CUDA LibTorch, CUDA toolkit, NCCL; large the first time)"
# nvidia-cudnn only downloads cuDNN from NVIDIA when its licence question is agreed to; declined,
# it installs nothing, and scripts/cudnn-stand-in.sh provides the libcudnn.so.9 LibTorch links to.
echo "nvidia-cudnn nvidia-cudnn/question select I Decline" | in_root debconf-set-selections
{ in_root apt-get update -q && in_root apt-get install -y -q git && in_root bash "/root/$slot/scripts/install-deps.sh" --cuda &&
  in_root bash "/root/$slot/scripts/cudnn-stand-in.sh" && in_root apt-get clean; } \
  >> "$logs/setup.log" 2>&1 || { tail -n 20 "$logs/setup.log"; echo "cuda-build: installing failed" >&2; exit 1; }
setup_s=$(( $(date +%s) - t0 ))
echo "cuda-build: $what in /root/$slot; setup ${setup_s} s"

step() {  # step NAME COMMAND: runs COMMAND in the root, logs it, records its exit status and time
  local name="$1" start rc
  shift
  start=$(date +%s)
  echo "cuda-build: [$name] (log: $logs/$name.log)"
  set +e
  in_root CCACHE_DIR=/root/.ccache /bin/bash -c "$*" > "$logs/$name.log" 2>&1
  rc=$?
  set -e
  eval "${name}_rc=$rc; ${name}_s=$(( $(date +%s) - start ))"
  return $rc
}

build="/root/$slot-build"
configure_rc=1; build_rc=skipped; test_rc=skipped; configure_s=0; build_s=0; test_s=0
if step configure "cmake -S /root/$slot -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DUNIRL_BUILD_TESTS=ON \
      -DUNIRL_BUILD_EXAMPLES=ON -DUNIRL_ENABLE_CUDA=ON -DUNIRL_ENABLE_NCCL=ON -DCMAKE_CUDA_ARCHITECTURES='80;90' \
      -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"; then
  target_args=""
  for t in $targets; do target_args="$target_args --target $t"; done
  if step build "nice -n 19 cmake --build $build -j $jobs $target_args" && [ "$run_tests" -eq 1 ]; then
    if [ -n "$tests_regex" ]; then test_args="-R '$tests_regex'"; else test_args="-LE full"; fi
    step test "ctest --test-dir $build -j $jobs --output-on-failure $test_args" || true
  fi
fi
[ "$configure_rc" = 0 ] || { tail -n 30 "$logs/configure.log"; }
[ "$build_rc" = 0 ] || [ "$build_rc" = skipped ] || grep -E 'error|FAILED' "$logs/build.log" | head -n 30
if [ "$test_rc" != skipped ]; then
  grep -E 'tests passed|tests failed|The following tests FAILED|^[[:space:]]+[0-9]+ - ' "$logs/test.log" || tail -n 20 "$logs/test.log"
  # What the [cuda] tests said when they skipped.
  grep -hoE 'SKIP.*|skipped: .*no CUDA.*' "$logs/test.log" | sort | uniq -c | head -n 5 || true
fi
verdict() { case "$1" in 0) echo "ok" ;; skipped) echo "skipped" ;; *) echo "FAILED (exit $1)" ;; esac; }
tests_line=""
[ "$test_rc" = skipped ] || tests_line="$(grep -E '[0-9]+% tests passed' "$logs/test.log" | tail -n 1 || true)"
echo "cuda-build: CUDA LibTorch ($what): setup ${setup_s} s; configure $(verdict "$configure_rc") in ${configure_s} s;" \
     "build $(verdict "$build_rc") in ${build_s} s; test $(verdict "$test_rc") in ${test_s} s${tests_line:+ ($tests_line)};" \
     "total $(( $(date +%s) - t0 )) s"
for rc in "$configure_rc" "$build_rc" "$test_rc"; do [ "$rc" = 0 ] || [ "$rc" = skipped ] || exit 1; done
exit 0
