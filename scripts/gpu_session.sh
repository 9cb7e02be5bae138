#!/usr/bin/env bash
# The GPU verification of issue 5 in ONE device call (a fresh H200 machine, 16 cores, no network,
# at most 10 minutes per command and 8 files back from $OUT):
#
#   scripts/fetch_gpu_debs.sh                                   # here, once: .gpudebs/ (~3 MB)
#   device run: command "bash scripts/gpu_session.sh", carry [".gpudebs"], timeout_s 600
#
# Steps, each time-limited, each run even when an earlier one failed; the whole stays under
# $STRATA_SESSION_BUDGET_S (default 550 s; a step past its limit is killed 10 s later at most):
#   env        nvidia-smi, CPU, memory, disk, compilers
#   deps       the libraries of scripts/install-deps.sh: present, or unpacked from .gpudebs/*.deb
#              into /tmp/strata-gpudeps (dpkg-deb -x; nothing is installed into /), or installed
#              by scripts/install-deps.sh where a Debian mirror resolves; else it names what is
#              missing and how to bring it
#   configure  Release, CUDA on, -DCMAKE_CUDA_ARCHITECTURES=90-real (Hopper only), in build/gpu
#   build      -j16, only what the later steps run: strata, the GPU benchmarks and the
#              gpu-labelled tests
#   ctest_gpu  ctest -L gpu                                     -> $OUT/ctest_gpu.log
#   bench_copy, bench_gemm, bench_gpt_cuda                      -> $OUT/<name>.json
#   train_default  strata train --device cuda (the defaults)    -> $OUT/train_default.json
#   train_gpt2-1.5b  strata train --device cuda --model gpt2-1.5b with a 2.25 GiB device
#              budget, 4 steps                                  -> $OUT/train_gpt2-1.5b.json
#   bench_train_step  last, with the time that is left as its STRATA_BENCH_BUDGET_S (it skips,
#              with the reason, the cases that would not fit)   -> $OUT/bench_train_step.json
# Everything else (nvidia-smi, build and benchmark console output, train logs, this summary)
# goes to $OUT/session.log: 8 files in all. The summary table of the steps is printed last.
#
# Options:
#   --no-build         skip deps, configure and build; use the binaries already in the build dir
#   --build-dir DIR    build directory (default build/gpu)
# Without $OUT (not on the device machine) the files go to build/gpu-session-out/.
# The step functions run through `--internal` (shellcheck sees no call):
# shellcheck disable=SC2317
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
self=$root/scripts/gpu_session.sh

build_dir=${GPU_SESSION_BUILD_DIR:-build/gpu}
do_build=1
internal=""
while (($#)); do
  case "$1" in
    --no-build) do_build=0 ;;
    --build-dir)
      build_dir=${2:?--build-dir needs a directory}
      shift
      ;;
    --internal)  # run one of the functions below (`timeout` runs programs, not functions)
      internal=${2:?}
      shift 2
      break
      ;;
    *)
      echo "gpu_session.sh: unknown option '$1' (--no-build, --build-dir DIR)" >&2
      exit 2
      ;;
  esac
  shift
done
export GPU_SESSION_BUILD_DIR=$build_dir

out=${OUT:-$root/build/gpu-session-out}
log=$out/session.log
budget=${STRATA_SESSION_BUDGET_S:-550}
jobs=${STRATA_JOBS:-16}
t_start=$SECONDS
deps_dir=/tmp/strata-gpudeps
bin=$build_dir

note() { echo "$*" | tee -a "$log"; }
left() { echo $((budget - (SECONDS - t_start))); }

# step NAME LIMIT_S LOGFILE CMD...: runs CMD (a program, or a function of this script) with a
# time limit of min(LIMIT_S, time left - 5 s), output appended to LOGFILE; records PASS, FAIL
# (exit code), TIMEOUT or NOT RUN for the summary.
names=()
results=()
times=()
record() {
  names+=("$1")
  results+=("$2")
  times+=("$3")
}
step() {
  local name=$1 limit=$2 file=$3
  shift 3
  local remaining
  remaining=$(($(left) - 5))
  ((limit > remaining)) && limit=$remaining
  if ((limit < 10)); then
    record "$name" "NOT RUN (out of time)" 0
    note "=== $name: not run, $(left) s left of the session's $budget s"
    return 1
  fi
  note "=== $name (limit ${limit} s): $*"
  [[ $(type -t "$1") == function ]] && set -- bash "$self" --internal "$@"
  local t0=$SECONDS rc offset last
  touch "$file"
  offset=$(stat -c %s "$file")
  timeout -k 10 "$limit" "$@" >>"$file" 2>&1
  rc=$?
  # The last line the step printed, to say why it failed.
  last=$(tail -c +$((offset + 1)) "$file" | grep -v '^[[:space:]]*$' | tail -1 | cut -c1-160)
  case $rc in
    0) record "$name" "PASS" $((SECONDS - t0)) ;;
    124 | 137) record "$name" "TIMEOUT after ${limit} s: $last" $((SECONDS - t0)) ;;
    *) record "$name" "FAIL (exit $rc): $last" $((SECONDS - t0)) ;;
  esac
  note "=== $name: ${results[-1]} in $((SECONDS - t0)) s"
  return $rc
}
# Appends a qualifier to the last step's result ("PASS" -> "PASS, 2 of 6 cases skipped: ...").
qualify() { results[-1]="${results[-1]}, $*"; }

# ---------------------------------------------------------------------------------------------
env_info() {
  date -u
  nvidia-smi || echo "nvidia-smi: not available"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>/dev/null
  uname -a
  grep -m1 'model name' /proc/cpuinfo
  echo "cores: $(nproc)"
  free -g
  df -h / /tmp /var/tmp 2>/dev/null
  for t in nvcc g++ cmake ninja pkg-config dpkg-deb python3 ccache; do
    printf '%-10s %s\n' "$t" "$(command -v "$t" || echo MISSING)"
  done
  nvcc --version 2>/dev/null | tail -2
  g++ --version 2>/dev/null | head -1
  cmake --version 2>/dev/null | head -1
}

# A header of each library scripts/install-deps.sh installs, looked for in the system include
# directories and in the unpacked .debs.
declare -A headers=(
  [liburing]=liburing.h [oneTBB]=oneapi/tbb.h [Eigen]=eigen3/Eigen/Core [xxHash]=xxhash.h
  [nlohmann-json]=nlohmann/json.hpp [CLI11]=CLI/CLI.hpp [fmt]=fmt/core.h [spdlog]=spdlog/spdlog.h
  [GoogleTest]=gtest/gtest.h [GoogleMock]=gmock/gmock.h [Google-Benchmark]=benchmark/benchmark.h
)
missing_libs() {
  local lib h d found miss=()
  for lib in "${!headers[@]}"; do
    h=${headers[$lib]}
    found=0
    # shellcheck disable=SC2086  # STRATA_SESSION_SYSTEM_INCLUDE: a list (a test seam)
    for d in ${STRATA_SESSION_SYSTEM_INCLUDE:-/usr/include /usr/local/include} "$deps_dir/usr/include"; do
      [[ -e $d/$h ]] && found=1 && break
    done
    ((found)) || miss+=("$lib")
  done
  command -v pkg-config >/dev/null || miss+=(pkg-config)
  echo "${miss[*]}"
}

unpack_debs() {
  local f n=0 data
  rm -rf "$deps_dir"
  mkdir -p "$deps_dir"
  for f in "$root"/.gpudebs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$f" "$deps_dir" || return 1
    else  # a .deb is an ar archive holding data.tar.{xz,zst,gz}
      data=$(ar t "$f" | grep '^data\.tar') || return 1
      ar p "$f" "$data" | tar -x -a -f - -C "$deps_dir" 2>/dev/null ||
        ar p "$f" "$data" | tar -xJ -C "$deps_dir" || return 1
    fi
    n=$((n + 1))
  done
  # The pkg-config files name /usr; point them at the unpacked tree.
  find "$deps_dir" -name '*.pc' -exec sed -i "s|=/usr|=$deps_dir/usr|g" {} +
  echo "unpacked $n packages into $deps_dir"
}

use_unpacked_deps() {
  local lib=$deps_dir/usr/lib/x86_64-linux-gnu
  export CMAKE_PREFIX_PATH=$deps_dir/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export PKG_CONFIG_PATH=$lib/pkgconfig:$deps_dir/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$PATH:$deps_dir/usr/bin  # its pkg-config only where the machine has none
}

deps() {
  local miss
  if compgen -G "$root/.gpudebs/*.deb" >/dev/null; then
    unpack_debs || return 1
    use_unpacked_deps
  fi
  miss=$(missing_libs)
  if [[ -n $miss ]] && timeout 5 getent hosts deb.debian.org >/dev/null 2>&1; then
    echo "missing: $miss; a Debian mirror resolves: scripts/install-deps.sh"
    scripts/install-deps.sh || return 1
    miss=$(missing_libs)
  fi
  if [[ -n $miss ]]; then
    echo "MISSING LIBRARIES: $miss"
    echo "Install them (scripts/install-deps.sh) or, on a machine without a package registry (the"
    echo "GPU device machine), carry them: on a Debian 12 machine run scripts/fetch_gpu_debs.sh"
    echo "(writes .gpudebs/) and name .gpudebs in the device call's carry."
    return 1
  fi
  echo "all libraries found$([[ -d $deps_dir/usr ]] && echo " (unpacked ones under $deps_dir)")"
}

configure() {
  local extra=()
  command -v ccache >/dev/null &&
    extra+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real -DBUILD_TESTING=ON -DSTRATA_BUILD_BENCHMARKS=ON "${extra[@]}"
}

# The targets of the gpu-labelled tests, read from tests/*/CMakeLists.txt (CTest knows the test
# cases only once their executables are built: gtest_discover_tests).
gpu_test_targets() {
  python3 -c '
import re, sys
names = []
for path in sys.argv[1:]:
    for m in re.finditer(r"strata_cc_test\((.*?)\)", open(path).read(), re.S):
        if re.search(r"\bLABELS\s+gpu\b", m.group(1)):
            names.append(re.search(r"NAME\s+(\S+)", m.group(1)).group(1))
print(" ".join(names))' tests/*/CMakeLists.txt
}

build() {
  local targets
  targets="strata bench_copy bench_gemm bench_gpt_cuda bench_train_step $(gpu_test_targets)"
  echo "targets: $targets"
  # shellcheck disable=SC2086
  cmake --build "$build_dir" -j "$jobs" --target $targets
}

# "k of n cases skipped: <first reason>" for a benchmark JSON with errored (skipped) cases.
bench_errors() {
  [[ -s $1 ]] || {
    echo "no JSON written"
    return
  }
  python3 -c '
import json, sys
try:
    runs = json.load(open(sys.argv[1])).get("benchmarks", [])
except Exception as e:
    print(f"unreadable JSON ({e})"); sys.exit(0)
bad = [r for r in runs if r.get("error_occurred")]
if bad:
    why = bad[0].get("error_message", "")[:160]
    print(f"{len(bad)} of {len(runs)} cases skipped: {why}")
' "$1" || true
}

bench() {
  local name=$1 limit=$2 exe="" d rc msg
  shift 2
  for d in gpu models engine; do
    [[ -x $bin/bench/$d/$name ]] && exe=$bin/bench/$d/$name
  done
  if [[ -z $exe ]]; then
    record "$name" "NOT RUN (not built in $bin)" 0
    return 1
  fi
  rm -f "$out/$name.json"
  step "$name" "$limit" "$log" stdbuf -oL "$exe" --benchmark_out="$out/$name.json" \
    --benchmark_out_format=json --benchmark_counters_tabular=true "$@"
  rc=$?
  msg=$(bench_errors "$out/$name.json")
  [[ -n $msg ]] && qualify "$msg"
  return $rc
}

train() {
  local name=$1 limit=$2 swap=/var/tmp/strata-session-swap
  shift 2
  mkdir -p "$swap"
  step "$name" "$limit" "$log" "$bin/tools/strata" train --device cuda --nvme-path "$swap" \
    --summary-json "$out/$name.json" "$@"
  rm -rf "$swap"
}

# ---------------------------------------------------------------------------------------------
if [[ -n $internal ]]; then
  "$internal" "$@"
  exit $?
fi
mkdir -p "$out"
: >"$log"
note "gpu_session.sh: $(date -u), budget ${budget} s, output in $out"
step env 30 "$log" env_info
if ((do_build)); then
  step deps 200 "$log" deps
fi
# deps ran in a child process: point this shell (configure, build, the programs) at what it
# unpacked (or an earlier run did, with --no-build).
[[ -d $deps_dir/usr ]] && use_unpacked_deps
if ((do_build)); then
  step configure 120 "$log" configure
  step build 330 "$log" build
fi
if [[ -x $bin/tools/strata ]]; then
  step ctest_gpu 120 "$out/ctest_gpu.log" ctest --test-dir "$build_dir" -L gpu \
    --output-on-failure --timeout 100
  skipped=$(grep -c '\*\*\*Skipped' "$out/ctest_gpu.log" 2>/dev/null)
  ((skipped > 0)) && qualify "$skipped test cases skipped"
else
  record ctest_gpu "NOT RUN (no strata in $bin/tools)" 0
fi
bench bench_copy 60
bench bench_gemm 60
bench bench_gpt_cuda 90
if [[ -x $bin/tools/strata ]]; then
  train train_default 120
  # A device budget far below the 1.5e9-parameter model's 22 GiB of state: the planner keeps 6
  # of 50 blocks resident and streams 44 from pinned host memory (strata estimate, same flags).
  # Optimizer state on the host (the NVMe placement is measured by bench_train_step).
  train train_gpt2-1.5b 150 --model gpt2-1.5b --steps 4 --micro-batch-size 4 --seq-len 1024 \
    --grad-accum-steps 1 --warmup-steps 1 --lr 3e-4 --device-budget 2.25GiB \
    --offload-params host --offload-optimizer host --eval-every 0 --sample-bytes 0 --log-every 1
else
  record train_default "NOT RUN (no strata in $bin/tools)" 0
  record train_gpt2-1.5b "NOT RUN (no strata in $bin/tools)" 0
fi
# Last: it gets the time that is left and skips, with the reason, the cases that would not fit
# (checked before a case and after its warm-up step: 60 s of margin for a case's setup and
# warm-up past its budget, so that it ends by itself and writes its JSON).
bench_budget=$(($(left) - 60))
if ((bench_budget >= 30)); then
  STRATA_BENCH_BUDGET_S=$bench_budget bench bench_train_step 600
else
  record bench_train_step "NOT RUN (out of time: $(left) s left)" 0
fi

# ---------------------------------------------------------------------------------------------
{
  echo
  echo "=== summary ($((SECONDS - t_start)) s of $budget s) ==="
  for i in "${!names[@]}"; do
    printf '%-17s %4s s  %s\n' "${names[$i]}" "${times[$i]}" "${results[$i]}"
  done
  echo "files in $out: $(find "$out" -type f -printf '%f ')"
  n=$(find "$out" -type f | wc -l)
  ((n > 8)) && echo "WARNING: $n files in $out; the device tool returns only 8"
} | tee -a "$log"
exit 0
