#!/usr/bin/env bash
# The GPU check in one device call: build here, pack, run on the GPU machine, record the figures.
#
#   scripts/gpu_session.sh build           # here: configure build/gpu (CUDA on, sm_90 only) and
#                                          # build the gpu-labelled tests (target gpu_tests),
#                                          # bench_train_step, strata, strata_shared (~5 min, 2 cores)
#   scripts/gpu_session.sh pack            # here: .gpurun/ (~13 MB): the tree, the programs and the
#                                          # shared libraries they load (scripts/gpu/pack.sh)
#   device tool: run(command="bash .gpurun/run.sh check; BUDGET=330 bash .gpurun/run.sh perf",
#                    carry=[".gpurun"], timeout_s=600)          # check ~2 min, perf ~5.5 min
#   (issue 43's families: "bash .gpurun/run.sh check; BUDGET=330 bash .gpurun/run.sh families")
#   scripts/gpu_session.sh record DIR      # here: DIR = the call's files_at; prints the summaries
#                                          # and appends them, dated, with the machine, to
#                                          # bench/RESULTS.md
# `scripts/gpu_session.sh` alone = build, then pack. What the device runs is scripts/gpu/device.sh
# (its header lists the steps); the summary it prints (each step's time and result, then Strata's
# tokens/s and MFU against PyTorch's in the same call) comes back as summary-check.txt and
# summary-perf.txt.
#
# Why the build is here: the GPU machine (Ubuntu 24.04, nvcc 13.0, torch) has neither the Debian
# -dev packages nor MPI, and a machine start costs minutes of a 15-minute device budget.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${GPU_SESSION_BUILD_DIR:-build/gpu}
jobs=${STRATA_JOBS:-$(nproc)}

build() {
  local launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache
    -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real -DBUILD_TESTING=ON -DSTRATA_BUILD_BENCHMARKS=ON "${launcher[@]}"
  cmake --build "$build" -j "$jobs" --target gpu_tests bench_train_step bench_memory_roofline strata strata_shared
}

record() {
  local dir=${1:?record needs the directory the device call returned (files_at)}
  local f text machine
  [[ -d $dir ]] || { echo "gpu_session.sh: no directory '$dir'" >&2; exit 1; }
  text=""
  local phase phases=() seen=" "
  # check and perf first (as the call runs them), then any other phase's summary (families, ...).
  for f in "$dir"/summary-check.txt "$dir"/summary-perf.txt "$dir"/summary-*.txt; do
    phase=${f##*/summary-} && phase=${phase%.txt}
    [[ -f $f && $seen != *" $phase "* ]] || continue
    seen+="$phase " && phases+=("\`$phase\`") && text+=$(cat "$f")$'\n'
  done
  [[ -n $text ]] || { echo "gpu_session.sh: no summary-*.txt in $dir (did the call run .gpurun/run.sh?)" >&2; exit 1; }
  machine=$(tar -xzOf "$dir/logs-check.tar.gz" ./env.txt 2>/dev/null |
    grep -m1 -oE 'NVIDIA H[0-9]+' | sed 's/ *$//' || true)
  printf '%s' "$text"
  {
    echo
    echo "## $(date -u +%F) GPU check ($(git rev-parse --short HEAD)), ${machine:-GPU machine}"
    echo
    echo "scripts/gpu_session.sh: one device call, \`.gpurun/run.sh\` phases ${phases[*]}."
    echo
    echo '```'
    printf '%s' "$text"
    echo '```'
  } >>bench/RESULTS.md
  echo "gpu_session.sh: appended to bench/RESULTS.md"
}

case ${1:-all} in
  build) build ;;
  pack) scripts/gpu/pack.sh "$build" ;;
  all) build && scripts/gpu/pack.sh "$build" ;;
  record) record "${2:-}" ;;
  *) echo "gpu_session.sh: unknown command '$1' (build, pack, record DIR; none = build and pack)" >&2; exit 2 ;;
esac
