#!/usr/bin/env bash
# The main job: install what is needed, build, and run the quickstart example.
#   bash scripts/quickstart.sh [--out DIR] [key=value ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
build="${UNIRL_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUNIRL_BUILD_TESTS=OFF >/dev/null
target=quickstart
example=examples/01_quickstart
if [ ! -f "$root/$example/CMakeLists.txt" ]; then target=digit_bandit; example=examples/00_digit_bandit; fi
cmake --build "$build" --target "$target" -j "$(nproc)"
args=("$@")
if [[ " $* " != *" --out "* ]]; then args=(--out "$root/runs/$target" "${args[@]}"); fi
exec "$build/$example/$target" "${args[@]}"
