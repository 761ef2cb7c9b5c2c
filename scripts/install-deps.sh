#!/usr/bin/env bash
# Installs the Debian packages unirl needs to build, test and run its examples, by release:
# Debian 12 (bookworm: LibTorch 1.13, Catch2 2) and Debian 13 (trixie: LibTorch 2.6, Catch2 3).
# Idempotent: installs only what is missing; runs `apt-get update` only then.
#   bash scripts/install-deps.sh          # the CPU LibTorch
#   bash scripts/install-deps.sh --cuda   # Debian 13 with contrib and non-free: the CUDA LibTorch,
#                                         # the CUDA toolkit and NCCL instead (scripts/cuda-build.sh)
set -euo pipefail
cuda=0
case "${1:-}" in
  "") ;;
  --cuda) cuda=1 ;;
  *) echo "unirl: install-deps.sh: unknown argument '$1' (expected nothing or --cuda)" >&2; exit 2 ;;
esac
codename=""
if [ -r /etc/os-release ]; then codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"; fi

# The same on both releases.
packages=(
  g++ cmake ninja-build git pkg-config
  libsleef-dev
  libopenblas0-openmp                # LibTorch calls libblas.so.3: OpenBLAS (OpenMP), not the reference BLAS
  libeigen3-dev libboost-dev libbenchmark-dev
  nlohmann-json3-dev libyaml-cpp-dev libstb-dev zlib1g-dev
  libre2-dev                         # RE2: linear-time regular expressions of the rule rewards
  chromium                           # headless browser of the run report's test (tool.unirl_report_browser)
)
# What differs (names checked with apt-cache on each release).
bookworm_packages=(
  catch2                             # Catch2 2.13
  clang libclang-rt-14-dev           # clang 14 and its libFuzzer runtime
)
trixie_packages=(
  libcatch2-dev                      # Catch2 3 ("catch2" is only a transitional package there)
  clang libclang-rt-19-dev           # clang 19 and its libFuzzer runtime
  python3-safetensors                # the official safetensors library: io.official_reads_unirl (Debian 12 has none)
)
# LibTorch: the CPU build, or (--cuda) the CUDA build, which replaces it (the two conflict).
if [ "$cuda" -eq 1 ]; then
  if [ "$codename" != trixie ]; then
    echo "unirl: --cuda needs Debian 13 (trixie) with contrib and non-free, got '${codename:-unknown}'" >&2; exit 2
  fi
  packages+=(
    libtorch-cuda-dev python3-torch-cuda   # LibTorch 2.6 built with CUDA 12 and NCCL (contrib)
    libgloo-cuda-dev                       # Gloo as that LibTorch was built with it (replaces libgloo-dev)
    nvidia-cuda-toolkit                    # nvcc 12.4 (non-free)
    libnccl-dev                            # NCCL 2.22 (contrib)
    ccache
  )
else
  packages+=(libtorch-dev python3-torch libgloo-dev)
fi
case "$codename" in
  bookworm) packages+=("${bookworm_packages[@]}") ;;
  trixie) packages+=("${trixie_packages[@]}") ;;
  *)
    echo "unirl: release '${codename:-unknown}' is not one the scripts know (Debian 12 bookworm, Debian 13 trixie);" \
         "trying Debian 13's package names" >&2
    packages+=("${trixie_packages[@]}") ;;
esac

command -v dpkg-query >/dev/null || { echo "unirl: install-deps.sh needs Debian's dpkg and apt" >&2; exit 1; }
missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then missing+=("$p"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "unirl: installing ${missing[*]}"
  sudo_cmd=""
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -q
  $sudo_cmd apt-get install -y -q "${missing[@]}"
fi
