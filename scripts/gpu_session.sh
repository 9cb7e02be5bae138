#!/usr/bin/env bash
# The GPU session of issues 5 and 13 in ONE device call, WHOLE in under 10 minutes (a fresh
# H100 or H200 machine, 16 cores, no network, 600 s per command, 8 files back from $OUT):
#
#   scripts/fetch_gpu_debs.sh                                   # here, once: .gpudebs/ (~16 MB)
#   device run: command "bash scripts/gpu_session.sh", carry [".gpudebs"], timeout_s 600
#
# Steps in order of importance, each with its own time limit, each run even when an earlier one
# failed, the whole under $STRATA_SESSION_BUDGET_S (default 540 s, the build included; a step is
# cut to the time left and killed 10 s past its limit at most):
#   env        nvidia-smi, CPU, memory, disk, compilers
#   cublas     where libcublas.so is: the toolkit's lib64, else PyTorch's nvidia-cublas pip
#              package (python3 -c 'import nvidia.cublas'); exported in LD_LIBRARY_PATH for every
#              later step (the library dlopens it: gpu/cuda/cublas_loader.h)
#   deps       the libraries of scripts/install-deps.sh: present, or unpacked from .gpudebs/*.deb
#              into /tmp/strata-gpudeps (dpkg-deb -x; nothing is installed into /)
#   configure  Release, CUDA on, -DCMAKE_CUDA_ARCHITECTURES=90-real (Hopper only), Ninja
#   build      -j16 -k 0, only these targets: bench_train_step, the gpu-labelled test programs,
#              bench_gemm (where the toolkit has cuBLAS), bench_gpt_cuda, bench_copy
#   bench_train_step  FIRST: gpt2-1.5b and gpt-7b, resident and host-offloaded, MFU
#                                                               -> $OUT/bench_train_step.json
#   torch_baseline    bench/gpu/torch_gpt_baseline.py, the same shapes in plain PyTorch
#                                                               -> $OUT/torch_baseline.json
#   ctest_gpu  ctest -j8 -L gpu                                 -> $OUT/ctest_gpu.log
#   bench_gemm, bench_gpt_cuda, bench_copy: --benchmark_min_time=0.05, 3 repetitions, filtered
#              to the gpt2-1.5b shapes and 256 MiB copies        -> $OUT/<name>.json
# A benchmark writes its JSON to a temporary file, moved into $OUT when it ends; a killed one
# leaves a truncated file, which is repaired (the complete cases kept, "truncated" saying why)
# so every JSON in $OUT parses. Everything else goes to $OUT/session.log. The summary (steps,
# then MFU of Strata against PyTorch) is printed last.
#
# Options:
#   --no-build         skip deps, configure and build; use the binaries already in the build dir
#   --build-dir DIR    build directory (default build/gpu)
#   --train            also `strata train --model gpt2-1.5b` offloaded, 4 steps, if time is left
#                      (builds strata too)
# Without $OUT (not on the device machine) the files go to build/gpu-session-out/.
# The step functions run through `--internal` (shellcheck sees no call):
# shellcheck disable=SC2317
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
self=$root/scripts/gpu_session.sh

build_dir=${GPU_SESSION_BUILD_DIR:-build/gpu}
do_build=1
do_train=0
internal=""
while (($#)); do
  case "$1" in
    --no-build) do_build=0 ;;
    --train) do_train=1 ;;
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
      echo "gpu_session.sh: unknown option '$1' (--no-build, --build-dir DIR, --train)" >&2
      exit 2
      ;;
  esac
  shift
done
export GPU_SESSION_BUILD_DIR=$build_dir GPU_SESSION_TRAIN=$do_train

out=${OUT:-$root/build/gpu-session-out}
log=$out/session.log
budget=${STRATA_SESSION_BUDGET_S:-540}
jobs=${STRATA_JOBS:-16}
t_start=$SECONDS
deps_dir=/tmp/strata-gpudeps
bin=$build_dir
tmp_out=/tmp/strata-session-json  # benchmark JSON while it is written

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

# The directory holding libcublas.so*: the CUDA toolkit's lib64 (next to nvcc, /usr/local/cuda),
# else the nvidia-cublas pip package that PyTorch brings (nvidia.* are namespace packages:
# __path__[0], not __file__). Prints "DIR<TAB>where it came from"; nothing when none is found.
find_cublas_dir() {
  local d nvcc_dir
  nvcc_dir=$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")
  for d in "$nvcc_dir/../lib64" "$nvcc_dir/../targets/x86_64-linux/lib" /usr/local/cuda/lib64 \
    /usr/local/cuda/targets/x86_64-linux/lib; do
    if compgen -G "$d/libcublas.so*" >/dev/null && compgen -G "$d/libcublasLt.so*" >/dev/null; then
      printf '%s\t%s\n' "$(cd "$d" && pwd -P)" "CUDA toolkit"
      return
    fi
  done
  d=$(python3 -c '
import os
import nvidia.cublas as m
paths = list(getattr(m, "__path__", [])) or [os.path.dirname(m.__file__)]
print(os.path.join(paths[0], "lib"))' 2>/dev/null)
  if [[ -n $d ]] && compgen -G "$d/libcublas.so*" >/dev/null; then
    printf '%s\t%s\n' "$d" "PyTorch's nvidia-cublas package ($(command -v python3))"
  fi
}

# A header of each library scripts/install-deps.sh installs, looked for in the system include
# directories and in the unpacked .debs.
declare -A headers=(
  [liburing]=liburing.h [oneTBB]=oneapi/tbb.h [Eigen]=eigen3/Eigen/Core [xxHash]=xxhash.h
  [nlohmann-json]=nlohmann/json.hpp [CLI11]=CLI/CLI.hpp [fmt]=fmt/core.h [spdlog]=spdlog/spdlog.h
  [GoogleTest]=gtest/gtest.h [GoogleMock]=gmock/gmock.h [Google-Benchmark]=benchmark/benchmark.h
  [SentencePiece]=sentencepiece_processor.h [protobuf]=google/protobuf/message_lite.h
  [Boost]=boost/crc.hpp
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

# What the later steps run, most important first; bench_gemm only where configure made it (it
# links the toolkit's cuBLAS). -k 0: one target failing does not stop the others.
build() {
  local targets
  targets="bench_train_step $(gpu_test_targets) bench_gpt_cuda bench_copy"
  grep -q '^build bench/gpu/bench_gemm:' "$build_dir/build.ninja" 2>/dev/null &&
    targets+=" bench_gemm"
  ((GPU_SESSION_TRAIN)) && targets+=" strata"
  echo "targets: $targets"
  # shellcheck disable=SC2086
  cmake --build "$build_dir" -j "$jobs" --target $targets -- -k 0
}

# Makes $1 valid JSON in place, whatever a killed Google Benchmark left: the complete cases are
# kept, and "truncated" says so. Prints what it did.
repair_json() {
  python3 - "$1" "$2" <<'PY'
import json, sys
path, why = sys.argv[1], sys.argv[2]
text = open(path, errors="replace").read()
try:
    json.loads(text); print("valid"); sys.exit(0)
except ValueError:
    pass
doc = {"context": {}, "benchmarks": []}
start = text.find('"benchmarks"')
try:
    if start > 0:
        doc = json.loads(text[:start].rstrip().rstrip(",") + "}")
        doc["benchmarks"] = []
except ValueError:
    doc = {"context": {"raw_head": text[:2000]}, "benchmarks": []}
if start > 0:
    dec, i = json.JSONDecoder(), text.find("[", start) + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            break
        doc["benchmarks"].append(obj)
doc["truncated"] = why
json.dump(doc, open(path, "w"), indent=2)
print(f"repaired: {len(doc['benchmarks'])} complete cases kept")
PY
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

# bench NAME LIMIT ARGS...: runs a Google Benchmark program with its JSON going to a temporary
# file, moved into $OUT when the program ends; killed or failed, the JSON is repaired first.
bench() {
  local name=$1 limit=$2 exe="" d rc msg tmp
  shift 2
  for d in gpu models engine; do
    [[ -x $bin/bench/$d/$name ]] && exe=$bin/bench/$d/$name
  done
  if [[ -z $exe ]]; then
    record "$name" "NOT RUN (not built in $bin)" 0
    return 1
  fi
  mkdir -p "$tmp_out"
  tmp=$tmp_out/$name.json
  rm -f "$tmp" "$out/$name.json"
  step "$name" "$limit" "$log" stdbuf -oL "$exe" --benchmark_out="$tmp" \
    --benchmark_out_format=json --benchmark_counters_tabular=true "$@"
  rc=$?
  if [[ -s $tmp ]]; then
    if ((rc != 0)); then
      msg=$(repair_json "$tmp" "${results[-1]}" 2>&1)
      qualify "JSON $msg"
    fi
    mv "$tmp" "$out/$name.json"
  fi
  msg=$(bench_errors "$out/$name.json")
  [[ -n $msg ]] && qualify "$msg"
  return $rc
}

# torch_baseline ARGS...: one bench/gpu/torch_gpt_baseline.py run, its JSON line appended to
# $tmp_out/torch_baseline.jsonl (a skipped or failed shape says why in its own line).
torch_baseline() {
  local line
  line=$(PYTHONUNBUFFERED=1 python3 bench/gpu/torch_gpt_baseline.py "$@" | tail -1)
  local rc=${PIPESTATUS[0]}
  echo "$line"
  if [[ $line == "{"* ]]; then
    echo "$line" >>"$tmp_out/torch_baseline.jsonl"
  else
    printf '{"args": "%s", "skipped": "failed (exit %s); see session.log"}\n' "$*" "$rc" \
      >>"$tmp_out/torch_baseline.jsonl"
  fi
  return "$rc"
}

# The MFU table: Strata's cases (bench_train_step.json) against PyTorch's (torch_baseline.json).
mfu_table() {
  python3 - "$out/bench_train_step.json" "$out/torch_baseline.json" <<'PY'
import json, sys
rows = []
try:
    for b in json.load(open(sys.argv[1])).get("benchmarks", []):
        name = b["name"].split("/iterations")[0]
        if b.get("error_occurred"):
            rows.append((name, None, None, None, b.get("error_message", "")[:90]))
        else:
            rows.append((name, b.get("tokens_per_s"), b.get("model_TFLOP_per_s"), b.get("MFU"),
                         f"step {b.get('step_s', 0):.2f} s, offload cost {b.get('offload_cost', 1):.2f}"))
except (OSError, ValueError) as e:
    rows.append(("strata", None, None, None, f"no bench_train_step.json ({e})"))
try:
    for r in json.load(open(sys.argv[2])):
        name = r.get("name", "torch")
        if "skipped" in r:
            rows.append((name, None, None, None, r["skipped"][:90]))
        else:
            note = f"step {r['step_s']:.2f} s, {r['layers_run']} of {r['layers']} layers"
            rows.append((name, r["tokens_per_s"], r["model_TFLOP_per_s"], r["MFU"], note))
except (OSError, ValueError) as e:
    rows.append(("torch", None, None, None, f"no torch_baseline.json ({e})"))
f = lambda x, fmt: format("-", ">" + fmt.split(".")[0]) if x is None else format(x, fmt)
print(f"{'case':<34} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}  note")
for name, tps, tf, mfu, note in rows:
    print(f"{name:<34} {f(tps, '10.0f')} {f(tf, '8.1f')} {f(mfu, '6.1%')}  {note}")
PY
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
rm -rf "$tmp_out"
mkdir -p "$tmp_out"
: >"$log"
note "gpu_session.sh: $(date -u), budget ${budget} s, output in $out"
step env 20 "$log" env_info
# cuBLAS first: every later step (ctest, the benchmarks) loads it through LD_LIBRARY_PATH.
cublas=$(find_cublas_dir)
if [[ -n $cublas ]]; then
  export LD_LIBRARY_PATH=${cublas%%$'\t'*}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  record cublas "FOUND in ${cublas%%$'\t'*} (${cublas#*$'\t'})" 0
else
  record cublas "NOT FOUND (no libcublas.so in the toolkit or nvidia.cublas): GEMM tests skip" 0
fi
note "=== cublas: ${results[-1]}"
if ((do_build)); then
  step deps 60 "$log" deps
fi
# deps ran in a child process: point this shell (configure, build, the programs) at what it
# unpacked (or an earlier run did, with --no-build).
[[ -d $deps_dir/usr ]] && use_unpacked_deps
if ((do_build)); then
  step configure 60 "$log" configure
  step build 240 "$log" build
fi

# The engine step, first. Its own budget leaves ~25 s for the case in flight to end by itself
# and write its JSON (bench_train_step checks the budget before each case and after each
# warm-up step).
peak=()
[[ -n ${STRATA_PEAK_TFLOPS:-} ]] && peak=(--peak-tflops="$STRATA_PEAK_TFLOPS")
train_step_limit=$(($(left) - 150))  # ~150 s kept for the PyTorch baseline and the tests
((train_step_limit > 240)) && train_step_limit=240
if ((train_step_limit >= 40)); then
  STRATA_BENCH_BUDGET_S=$((train_step_limit - 25)) bench bench_train_step "$train_step_limit" \
    "${peak[@]}" --benchmark_filter='TrainStep/(gpt2-1\.5b|gpt-7b)/(resident|host)/'
else
  record bench_train_step "NOT RUN (out of time: $(left) s left)" 0
fi

# The same shapes in plain PyTorch (same B, T; gpt-7b with as many layers as fit, --fit-layers).
: >"$tmp_out/torch_baseline.jsonl"
tpeak=()
[[ -n ${STRATA_PEAK_TFLOPS:-} ]] && tpeak=(--peak-tflops "$STRATA_PEAK_TFLOPS")
step torch_gpt2-1.5b 60 "$log" torch_baseline --preset gpt2-1.5b --batch 8 --seq-len 1024 \
  --warmup 2 --steps 5 "${tpeak[@]}"
step torch_gpt-7b 90 "$log" torch_baseline --preset gpt-7b --batch 2 --seq-len 2048 \
  --warmup 1 --steps 3 --fit-layers "${tpeak[@]}"
python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump(rows, open(sys.argv[2], "w"), indent=2)' "$tmp_out/torch_baseline.jsonl" \
  "$out/torch_baseline.json" 2>>"$log"

if [[ -x $bin/tests/gpu/cuda_device_test ]]; then
  step ctest_gpu 90 "$out/ctest_gpu.log" ctest --test-dir "$build_dir" -L gpu -j 8 \
    --output-on-failure --timeout 80
  skipped=$(grep -c '\*\*\*Skipped' "$out/ctest_gpu.log" 2>/dev/null)
  ((skipped > 0)) && qualify "$skipped test cases skipped"
else
  record ctest_gpu "NOT RUN (no gpu tests in $bin)" 0
fi
short=(--benchmark_min_time=0.05 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true)
bench bench_gemm 40 "${short[@]}" --benchmark_filter='model:1/'
bench bench_gpt_cuda 40 "${short[@]}" --benchmark_filter='BM_GptCudaLayer/1/'
bench bench_copy 30 "${short[@]}" --benchmark_filter='bytes:268435456'
if ((do_train)) && [[ -x $bin/tools/strata ]]; then
  # A device budget far below the 1.5e9-parameter model's 22 GiB of state: the planner keeps 6
  # of 50 blocks resident and streams 44 from pinned host memory.
  train train_gpt2-1.5b 120 --model gpt2-1.5b --steps 4 --micro-batch-size 4 --seq-len 1024 \
    --grad-accum-steps 1 --warmup-steps 1 --lr 3e-4 --device-budget 2.25GiB \
    --offload-params host --offload-optimizer host --eval-every 0 --sample-bytes 0 --log-every 1
fi

# ---------------------------------------------------------------------------------------------
{
  echo
  echo "=== summary ($((SECONDS - t_start)) s of $budget s) ==="
  for i in "${!names[@]}"; do
    printf '%-17s %4s s  %s\n' "${names[$i]}" "${times[$i]}" "${results[$i]}"
  done
  echo
  echo "=== MFU (model FLOPs per second / dense bf16 peak; Strata's GEMMs are fp32) ==="
  mfu_table
  echo "files in $out: $(find "$out" -type f -printf '%f ')"
  n=$(find "$out" -type f | wc -l)
  ((n > 8)) && echo "WARNING: $n files in $out; the device tool returns only 8"
} | tee -a "$log"
exit 0
