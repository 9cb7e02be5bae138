#!/usr/bin/env bash
# The continuous checks beyond the README's test command (issue 7), each a build preset of its
# own so they never mix with the release build, all built with clang (scripts/install-deps.sh
# --clang), which compiles an instrumented file in about 0.6 of GCC's time:
#   asan  - ASan + UBSan build of the libraries and the tests of the folders where a memory error
#           can hide (the CLI and its subprocess tests are left out: docs/continuous-checks.md)
#   tsan  - TSan build of the io, engine, offload and data tests, run (oneTBB on one thread: see
#           tests/tbb_limit.cc)
#   fuzz  - libFuzzer: every parser of outside data fuzzed for a few seconds each from its
#           committed seed corpus (tests/fuzz/corpus/<target>/)
# Usage: scripts/check.sh [asan] [tsan] [fuzz]   (no argument: all three). Zero reports or it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${STRATA_JOBS:-$(nproc)}
checks=("$@")
((${#checks[@]})) || checks=(asan tsan fuzz)
./scripts/install-deps.sh --clang

for check in "${checks[@]}"; do
  echo "=== check: $check ==="
  case "$check" in
    asan)
      cmake --preset asan
      cmake --build --preset asan -j "$jobs"
      ctest --preset asan -j "$jobs"
      ;;
    tsan)
      cmake --preset tsan
      cmake --build --preset tsan -j "$jobs" --target io_test io_uring_test engine_test optimizer_pipeline_test \
        overlap_test family_offload_test token_dataset_test tokenizer_test offload_optimizer_test \
        engine_optimizers_test data_parallel_test device_optimizer_home_test frozen_params_test packed_batch_test \
        layer_major_test activation_checkpointing_test gpu_fault_test preference_objective_test \
        shared_frozen_base_test
      ctest --preset tsan -j "$jobs"
      ;;
    fuzz)
      cmake --preset fuzz
      cmake --build --preset fuzz -j "$jobs"
      ctest --preset fuzz -j "$jobs"
      ;;
    *)
      echo "scripts/check.sh: unknown check '$check' (asan, tsan or fuzz)" >&2
      exit 2
      ;;
  esac
done
