#!/usr/bin/env bash
# Installs the Debian 12 packages unirl needs to build, test and run its examples.
# Idempotent: installs only what is missing; runs `apt-get update` only then.
set -euo pipefail
packages=(
  g++ cmake ninja-build git pkg-config
  libtorch-dev python3-torch libsleef-dev libgloo-dev
  libopenblas0-openmp                # LibTorch calls libblas.so.3: OpenBLAS (OpenMP), not the reference BLAS
  libeigen3-dev libboost-dev catch2 libbenchmark-dev
  nlohmann-json3-dev libyaml-cpp-dev libstb-dev zlib1g-dev
)
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
