#!/usr/bin/env bash
# Downloads (apt-get download, no root needed) the Debian 12 amd64 packages that the build needs
# and a bare GPU machine may lack into .gpudebs/ (ignored by git), for scripts/gpu_session.sh to
# unpack there: the device machine reaches no package registry, so the libraries travel with the
# call (device tool: carry [".gpudebs"]).
#
# The list is the -dev packages of scripts/install-deps.sh's libraries and their shared-library
# dependencies, minus what every C++ build machine has (libc6, libstdc++6, libgcc-s1,
# linux-libc-dev), the source-only googletest package (libgtest-dev ships static libraries) and
# catch2 (spdlog's own tests), plus pkgconf for CMake's pkg_check_modules. libtbbbind is there
# because oneTBB's CMake config checks that it exists; its libhwloc15 is not: oneTBB loads
# tbbbind (thread binding to NUMA nodes) only when it can, and goes on without it.
# About 16 MB in all (9.5 MB of it Boost's headers, for Boost.CRC); the script fails if the
# folder exceeds 48 MiB (a device call carries at most 64 MiB, repository included).
#   scripts/fetch_gpu_debs.sh            # then: run(..., carry=[".gpudebs"])
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpudebs
pkgs=(liburing-dev liburing2 libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libeigen3-dev libxxhash-dev
      libxxhash0 nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libspdlog-dev libspdlog1.10
      libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian libsentencepiece-dev
      libsentencepiece0 libprotobuf-dev libprotobuf32 libprotobuf-lite32 protobuf-compiler
      libprotoc32 libboost-dev libboost1.74-dev pkgconf pkgconf-bin libpkgconf3)

if ! command -v apt-get >/dev/null; then
  echo "fetch_gpu_debs.sh: apt-get not found: run this on a Debian 12 machine" >&2
  exit 1
fi
apt_opts=()
if [[ $(dpkg --print-architecture) != amd64 ]]; then
  # The GPU machine is x86-64: fetch amd64 packages with package lists of their own.
  lists=/tmp/strata-amd64-lists
  mkdir -p "$lists/partial"
  apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$lists")
  apt-get "${apt_opts[@]}" update -qq
fi
if ! git check-ignore -q "$dest/x.deb"; then
  echo "fetch_gpu_debs.sh: $dest/ is not ignored by git (.gitignore lists /.gpudebs/)" >&2
  exit 1
fi
rm -rf "$dest"
mkdir -p "$dest"
# apt-get download writes into the current directory; as root it warns that the _apt user cannot
# write there (harmless: the download then runs unsandboxed).
(
  cd "$dest"
  apt-get "${apt_opts[@]}" download "${pkgs[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed'
) || true  # a failed download shows as a missing package below
missing=()
for p in "${pkgs[@]}"; do
  compgen -G "$dest/${p}_*.deb" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "fetch_gpu_debs.sh: not downloaded: ${missing[*]} (apt-get update, or check the mirror)" >&2
  exit 1
fi
bytes=$(du -sb "$dest" | cut -f1)
echo "fetch_gpu_debs.sh: ${#pkgs[@]} packages, $((bytes / 1024)) KiB in $dest/"
if ((bytes > 48 * 1024 * 1024)); then
  echo "fetch_gpu_debs.sh: $dest/ is over 48 MiB; a device call carries at most 64 MiB" >&2
  exit 1
fi
