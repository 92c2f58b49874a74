#!/usr/bin/env bash
# Installs every Debian package CPD needs to build and test. Idempotent: packages already
# present are skipped, so a second run costs one dpkg query and prints one line. An install
# says what it installs and shows a line per package as apt sets it up (a fresh machine's
# install takes minutes: it must not look hung).
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
  # The default corpus of cpd-train --dataset text (language models): Debian's fortune cookies,
  # about 2.5 MB of English in /usr/share/games/fortunes.
  fortunes
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
  echo "install_deps: all ${#PACKAGES[@]} Debian packages are installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install_deps: installing ${#missing[@]} package(s): ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
start=$SECONDS
echo "install_deps: apt-get update"
$SUDO apt-get update -qq
# apt's own progress redraws one line with \r; its "Setting up" lines (one per package, with
# the dependencies pulled in) are the plain progress a log can hold.
$SUDO apt-get install -y -q --no-install-recommends -o Dpkg::Use-Pty=0 "${missing[@]}" |
  { grep --line-buffered -E '^Setting up ' || true; } | sed -u 's/^/install_deps: /'
echo "install_deps: done in $((SECONDS - start)) s"
