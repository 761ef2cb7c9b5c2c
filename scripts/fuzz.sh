#!/usr/bin/env bash
# Builds and runs one libFuzzer target of tests/fuzz/.
#   bash scripts/fuzz.sh TARGET SECONDS     # TARGET: safetensors_header for tests/fuzz/fuzz_safetensors_header.cpp
#   bash scripts/fuzz.sh all SECONDS        # every tests/fuzz/fuzz_*.cpp in turn
#   bash scripts/fuzz.sh list
# A new target is a tests/fuzz/fuzz_NAME.cpp defining LLVMFuzzerTestOneInput (catch unirl::error
# only), with optional seeds in tests/fuzz/corpus/NAME/ and an optional libFuzzer dictionary
# tests/fuzz/fuzz_NAME.dict. A target whose source contains the line
# `// unirl-fuzz: links unirl::unirl` (yaml-cpp, Boost.Beast, ...) is built through the nested CMake
# project tests/fuzz/cmake (configured once per compiler under the build directory); one with
# `// unirl-fuzz: includes LibTorch` too, but with $UNIRL_FUZZ_TORCH_CXX (default c++), ASan +
# UBSan and the mutation driver tests/fuzz/support/mutation_driver.cpp instead of libFuzzer
# (LibTorch 1.13's headers do not compile with clang 14 in C++20); the others with one clang++
# command line. Binaries, the growing corpus and crash
# artifacts go to $UNIRL_FUZZ_BUILD_DIR (default build/fuzz); the seed corpus is only read.
# Compiler: $UNIRL_FUZZ_CXX, else clang++, else clang++-14. Exit 77 (skipped) when no clang with
# libFuzzer is found; otherwise libFuzzer's status (non-zero on a finding).
set -euo pipefail
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${1:?usage: fuzz.sh TARGET|all|list SECONDS}"
seconds="${2:-60}"
build="${UNIRL_FUZZ_BUILD_DIR:-$root/build/fuzz}"
fuzz_src="$root/tests/fuzz"

if [ "$target" = list ]; then
  for f in "$fuzz_src"/fuzz_*.cpp; do n="$(basename "$f" .cpp)"; echo "${n#fuzz_}"; done
  exit 0
fi
if [ "$target" = all ]; then
  status=0
  for f in "$fuzz_src"/fuzz_*.cpp; do
    n="$(basename "$f" .cpp)"
    bash "${BASH_SOURCE[0]}" "${n#fuzz_}" "$seconds" || status=$?
    [ "$status" -eq 0 ] || [ "$status" -eq 77 ] || exit "$status"
  done
  exit "$status"
fi

target="${target#fuzz_}"
target="${target%.cpp}"
src="$fuzz_src/fuzz_$target.cpp"
[ -f "$src" ] || { echo "fuzz: no $src (targets: $(bash "${BASH_SOURCE[0]}" list | tr '\n' ' '))" >&2; exit 2; }

bin="$build/fuzz_$target"
mkdir -p "$build/corpus/$target" "$build/artifacts"
if grep -q 'unirl-fuzz: includes LibTorch' "$src"; then
  # LibTorch < 2.1's headers do not compile with clang in C++20 (tests/fuzz/cmake/CMakeLists.txt):
  # such a target is built with the project's compiler and ASan + UBSan, linked with the mutation
  # driver of tests/fuzz/support/ instead of libFuzzer (no coverage feedback).
  cxx="${UNIRL_FUZZ_TORCH_CXX:-c++}"
  nested=1
else
  cxx="${UNIRL_FUZZ_CXX:-}"
  if [ -z "$cxx" ]; then
    for c in clang++ clang++-14; do
      if command -v "$c" > /dev/null 2>&1; then cxx="$c"; break; fi
    done
  fi
  if [ -z "$cxx" ]; then
    echo "fuzz: SKIPPED $target: no clang++ found (Debian: apt-get install clang libclang-rt-14-dev)"
    exit 77
  fi
  probe="$build/.libfuzzer-probe"
  if [ ! -x "$probe" ]; then
    if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
        "$cxx" -x c++ -fsanitize=fuzzer,address,undefined - -o "$probe" > /dev/null 2>&1; then
      echo "fuzz: SKIPPED $target: $cxx cannot link libFuzzer (Debian: apt-get install libclang-rt-14-dev)"
      exit 77
    fi
  fi
  nested=0
  grep -q 'unirl-fuzz: links unirl::unirl' "$src" && nested=1
fi

if [ "$nested" = 1 ]; then
  # A target that needs unirl::unirl's dependencies (yaml-cpp, Boost.Beast, LibTorch): built by the
  # nested CMake project tests/fuzz/cmake, which finds them as the main build does.
  cbuild="$build/cmake-$(basename "$cxx")"
  # Several fuzz CTests may build here at once: one configure / build at a time.
  if command -v flock > /dev/null 2>&1; then exec 9> "$cbuild.lock"; flock 9; fi
  if [ ! -f "$cbuild/build.ninja" ]; then
    echo "fuzz: configuring $cbuild with $cxx"
    cmake -S "$fuzz_src/cmake" -B "$cbuild" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" > "$cbuild.configure.log" 2>&1 ||
      { tail -n 30 "$cbuild.configure.log" >&2; exit 1; }
  fi
  echo "fuzz: building $bin (CMake, $cxx)"
  cmake --build "$cbuild" --target "fuzz_$target" -j "${UNIRL_FUZZ_JOBS:-2}" > "$build/fuzz_$target.build.log" 2>&1 ||
    { tail -n 40 "$build/fuzz_$target.build.log" >&2; exit 1; }
  cp -p "$cbuild/fuzz_$target" "$bin.tmp"
  mv "$bin.tmp" "$bin"
  if command -v flock > /dev/null 2>&1; then exec 9>&-; fi
# Rebuild when the target or any header is newer than the binary.
elif [ ! -x "$bin" ] || [ -n "$(find "$src" "$root/include" -newer "$bin" -print -quit)" ]; then
  echo "fuzz: building $bin with $cxx"
  "$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -I "$root/include" "$src" -o "$bin.tmp"
  mv "$bin.tmp" "$bin"
fi

seeds=()
[ -d "$fuzz_src/corpus/$target" ] && seeds=("$fuzz_src/corpus/$target")
dict=()
[ -f "$fuzz_src/fuzz_$target.dict" ] && dict=("-dict=$fuzz_src/fuzz_$target.dict")
log="$build/fuzz_$target.log"
echo "fuzz: running $target for $seconds s (corpus $build/corpus/$target)"
status=0
"$bin" -max_total_time="$seconds" -error_exitcode=1 -timeout=10 -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1 "${dict[@]}" \
  -artifact_prefix="$build/artifacts/$target-" "$build/corpus/$target" "${seeds[@]}" > "$log" 2>&1 || status=$?
grep -E '^(#[0-9]+ +(INITED|DONE)|Done [0-9]+ runs|stat::number_of_executed_units|==[0-9]+==ERROR|SUMMARY:|artifact_prefix|Test unit written)' "$log" || true
runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
files="$(find "$build/corpus/$target" -type f | wc -l)"
if [ "$status" -ne 0 ]; then
  echo "fuzz: $target FAILED (status $status) after ${runs:-?} executions; log: $log" >&2
  tail -n 60 "$log" >&2
  exit "$status"
fi
echo "fuzz: $target: ${runs:-?} executions in $seconds s, corpus $files files, no finding"
