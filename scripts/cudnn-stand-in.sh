#!/usr/bin/env bash
# Run inside scripts/cuda-build.sh's Debian 13 root (as root). cuDNN is not in Debian: the
# nvidia-cudnn package only downloads it from NVIDIA at install time, which a machine without that
# network access cannot do (cuda-build.sh declines the download). Debian's CUDA LibTorch
# (libtorch_cuda.so) needs libcudnn.so.9 to link and load, so this builds a stand-in with every
# cudnn* function LibTorch imports, each returning a failure status. Nothing calls cuDNN without
# a GPU; the stand-in only lets the CPU build link and run. On a GPU machine the real cuDNN of
# that machine's PyTorch is used (scripts/gpu-check.sh). Does nothing when a libcudnn.so.9 exists.
set -euo pipefail
libdir=/usr/lib/x86_64-linux-gnu
if [ -e "$libdir/libcudnn.so.9" ]; then echo "cudnn-stand-in: $libdir/libcudnn.so.9 exists"; exit 0; fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for lib in "$libdir"/libtorch_cuda.so.* "$libdir"/libtorch_python.so.*; do
  [ -e "$lib" ] && nm -D --undefined-only "$lib" | awk '{ print $2 }' | grep '^cudnn' | sed 's/@.*//'
done | sort -u > "$work/symbols"
[ -s "$work/symbols" ] || { echo "cudnn-stand-in: no cudnn symbol imported by $libdir/libtorch_cuda.so.*" >&2; exit 1; }
{
  echo '/* Stand-in cuDNN (scripts/cudnn-stand-in.sh): every function fails; nothing calls it without a GPU. */'
  echo 'static const char unavailable[] = "cuDNN is not installed (stand-in library of unirl'"'"'s cuda-build.sh)";'
  while read -r s; do
    case "$s" in
      cudnnGetErrorString) echo "const char* $s(int status) { (void)status; return unavailable; }" ;;
      cudnnGetVersion|cudnnGetCudartVersion|cudnnGetMaxDeviceVersion) echo "unsigned long $s(void) { return 0; }" ;;
      *) echo "int $s(void) { return 4000; /* a failure status: not initialised */ }" ;;
    esac
  done < "$work/symbols"
} > "$work/cudnn.c"
echo 'libcudnn.so.9 { global: *; };' > "$work/version.map"
gcc -shared -fPIC -O1 -o "$libdir/libcudnn.so.9" "$work/cudnn.c" -Wl,-soname,libcudnn.so.9 \
  -Wl,--version-script="$work/version.map"
echo "cudnn-stand-in: $libdir/libcudnn.so.9 with $(wc -l < "$work/symbols") failing functions"
