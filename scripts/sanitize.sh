#!/usr/bin/env bash
# Builds unirl's unit tests with sanitizers (UNIRL_SANITIZE, tests/CMakeLists.txt) in their own
# build directories and runs them. LibTorch stays uninstrumented; the suppression files of
# tests/sanitize/ name the few reports that come from inside it (each one commented).
#   bash scripts/sanitize.sh asan                  # every unit suite, ASan + UBSan ([slow] too)
#   bash scripts/sanitize.sh tsan                  # TSan: the remote reward client/server and data-parallel tests
#   bash scripts/sanitize.sh all                   # both (the nightly run)
#   bash scripts/sanitize.sh asan unit_core unit_io:'[options]'   # chosen suites, an optional Catch2 test spec each
# Build directories: $UNIRL_SANITIZE_BUILD_DIR/{asan,tsan} (default build/sanitize). Compiler: the
# one CMake picks ($CXX), as in scripts/test.sh. Jobs: $UNIRL_SANITIZE_JOBS (default nproc).
# Exit status: non-zero when a build fails, a test fails or a sanitizer reports.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode="${1:-all}"
shift || true
base="${UNIRL_SANITIZE_BUILD_DIR:-$root/build/sanitize}"
jobs="${UNIRL_SANITIZE_JOBS:-$(nproc)}"
supp="$root/tests/sanitize"

# Default suites and Catch2 test specs of each mode ([cuda] never runs: CPU-only).
asan_default=(unit_core unit_io unit_tokenizers unit_data unit_batch unit_env unit_flow unit_hf unit_ops
              unit_token unit_train unirl_rewards_tests unit_distributed)
tsan_default=("unirl_rewards_tests:[remote]" "unit_distributed:[distributed]")

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0:strict_init_order=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
# die_after_fork=0: the remote-reward tests fork their server from a process LibTorch made
# multi-threaded; the child only serves and _exits (tests/sanitize/CMakeLists.txt).
export TSAN_OPTIONS="suppressions=$supp/tsan.supp:halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:die_after_fork=0${TSAN_OPTIONS:+:$TSAN_OPTIONS}"

run_mode() {  # run_mode NAME SANITIZERS SUITE[:SPEC]...
  local name="$1" flags="$2"
  shift 2
  local build="$base/$name" start targets=() s status=0
  mkdir -p "$base"
  start=$(date +%s)
  for s in "$@"; do targets+=("${s%%:*}"); done
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DUNIRL_BUILD_TESTS=ON \
    -DUNIRL_BUILD_EXAMPLES=OFF -DUNIRL_BUILD_TOOLS=OFF -DUNIRL_SANITIZE="$flags" > "$build.configure.log" 2>&1 ||
    { mkdir -p "$build"; tail -n 30 "$build.configure.log" >&2; return 1; }
  # Building runs each suite once (Catch2's test discovery), under the sanitizer too.
  cmake --build "$build" --target "${targets[@]}" -j "$jobs"
  local built=$(date +%s)
  for s in "$@"; do
    local exe="${s%%:*}" spec="~[cuda]"
    [[ "$s" == *:* ]] && spec="${s#*:}"
    local bin
    bin="$(find "$build/tests" -type f -name "$exe" -perm -u+x | head -1)"
    [ -n "$bin" ] || { echo "sanitize: no executable $exe in $build" >&2; status=1; continue; }
    echo "sanitize: $name: $exe '$spec'"
    if ! (cd "$(dirname "$bin")" && "$bin" "$spec" --reporter compact); then
      echo "sanitize: $name: $exe FAILED" >&2
      status=1
    fi
  done
  echo "sanitize: $name: build $((built - start)) s, tests $(($(date +%s) - built)) s"
  return "$status"
}

status=0
case "$mode" in
  asan)
    [ $# -gt 0 ] || set -- "${asan_default[@]}"
    run_mode asan address,undefined "$@" || status=$?
    ;;
  tsan)
    [ $# -gt 0 ] || set -- "${tsan_default[@]}"
    # One OpenMP thread under TSan: libgomp's workers would make the tests' forks multi-threaded
    # (TSan kills such a child when it starts a thread) and libgomp's barriers are invisible to
    # it (tests/sanitize/CMakeLists.txt, sanitize.tsan_reward_service).
    OMP_NUM_THREADS=1 run_mode tsan thread "$@" || status=$?
    ;;
  all)
    run_mode asan address,undefined "${asan_default[@]}" || status=$?
    OMP_NUM_THREADS=1 run_mode tsan thread "${tsan_default[@]}" || status=$?
    ;;
  *) echo "usage: sanitize.sh asan|tsan|all [SUITE[:CATCH_SPEC] ...]" >&2; exit 2 ;;
esac
exit "$status"
