#!/usr/bin/env bash
# Installs every Debian package CPD needs to build and test. Idempotent and quiet: packages
# already present are skipped, so a second run costs one dpkg query.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libfmt-dev nlohmann-json3-dev
  libopenblas-dev libdnnl-dev
  libopenmpi-dev openmpi-bin
  libgrpc++-dev libabsl-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libsqlite3-dev libyaml-cpp-dev libspdlog-dev zlib1g-dev
  dataset-fashion-mnist python3 python3-numpy python3-matplotlib openssl
  # The emulated cluster network of benchmarks/allreduce_netns.sh (ip netns, tc).
  iproute2
  # The sanitizer and fuzzing builds (scripts/sanitize.sh, scripts/fuzz.sh): clang with its
  # sanitizer and libFuzzer runtimes, its OpenMP, and llvm-symbolizer for readable reports.
  clang libclang-rt-14-dev libomp-dev llvm
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install_deps: installing ${#missing[@]} package(s): ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
