#!/usr/bin/env bash
# Installs the Debian 12 packages Strata builds and tests with. Safe to run again.
#   --python  also PyTorch for the Python package's tests (large: about 1 GB)
#   --clang   also clang with its sanitizer runtimes and libFuzzer, which scripts/check.sh builds with
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config git ca-certificates
      liburing-dev libtbb-dev libeigen3-dev libxxhash-dev nlohmann-json3-dev libcli11-dev
      libfmt-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev libsentencepiece-dev
      libpcre2-dev libicu-dev
      libprotobuf-dev protobuf-compiler libboost-dev libopenmpi-dev openmpi-bin python3 ccache
      python3-jinja2)
for arg in "$@"; do
  case "$arg" in
    --python) pkgs+=(python3-torch python3-numpy python3-protobuf) ;;
    --clang) pkgs+=(clang libclang-rt-14-dev llvm) ;;
    *) echo "install-deps.sh: unknown option '$arg' (--python, --clang)" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p"); done
if ((${#missing[@]})); then
  sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
