#!/usr/bin/env bash
# Packs a GPU check for the device machine into .gpurun/ (run from the repository root):
#   .gpurun/strata-gpu.tar.xz  the working tree (tracked + untracked-not-ignored files), the build
#                              directory's programs and shared objects (stripped) with every CTest
#                              file, and .gpulibs/: the shared libraries those programs load that
#                              are not glibc, libstdc++ or CUDA's own (the GPU machine runs another
#                              distribution and reaches no package registry)
#   .gpurun/run.sh             what the device runs: scripts/gpu/device.sh
# The tree carries every tracked or staged file, so the Python that phases run there comes along:
# scripts/gpu/*.py, bench/gpu/*.py, and tests/python/*.py, whose fixture builders the `families`
# phase imports (scripts/gpu/families_vs_transformers.py).
# Usage: scripts/gpu/pack.sh [BUILD_DIR]   (default build/gpu; scripts/gpu_session.sh calls it)
set -euo pipefail
build=${1:-build/gpu}
root=$(pwd -P)
[[ -d $build ]] || { echo "pack.sh: no build directory '$build' (build the GPU targets first: scripts/gpu_session.sh build)" >&2; exit 1; }
stage=$(mktemp -d /tmp/gpupack.XXXXXX)
trap 'rm -rf "$stage"' EXIT
git ls-files -co --exclude-standard -z | tar --null -T - -c | tar -x -C "$stage"
find "$build" -type f \( -perm -u+x -o -name '*.so*' \) ! -path '*/CMakeFiles/*' ! -name '*.o' \
  -exec sh -c 'file -b "$1" | grep -q ELF' _ {} \; -print >"$stage/.elf-list"
find "$build" \( -name 'CTestTestfile.cmake' -o -name '*_include.cmake' -o -name '*_tests.cmake' \) \
  -print >"$stage/.ctest-list"
tar -c -T "$stage/.elf-list" -T "$stage/.ctest-list" | tar -x -C "$stage"
find "$stage/$build" -type f -perm -u+x -exec strip --strip-unneeded {} \; 2>/dev/null || true
mkdir -p "$stage/.gpulibs"
skip='linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libstdc\+\+|libgcc_s|libcuda\.so|libcublas|libcudart|libnccl'
while read -r f; do ldd "$f" 2>/dev/null; done <"$stage/.elf-list" |
  awk '/=> \//{print $3}' | sort -u | grep -Ev "$skip" | grep -v "^$root/" |
  while read -r lib; do cp -L "$lib" "$stage/.gpulibs/"; done
rm -f "$stage/.elf-list" "$stage/.ctest-list"
printf '%s\n%s\n' "$root" "$build" >"$stage/.gpurun-paths"
mkdir -p .gpurun
tar -C "$stage" -c . | xz -T2 --lzma2=preset=2,dict=192MiB >.gpurun/strata-gpu.tar.xz
cp "$root/scripts/gpu/device.sh" .gpurun/run.sh
size=$(du -sb .gpurun | cut -f1)
echo "pack.sh: .gpurun/ is $((size >> 20)) MiB"
((size < 48 * 1024 * 1024)) || echo "pack.sh: .gpurun is $((size >> 20)) MiB; a device call carries 64 MiB with the repository" >&2
