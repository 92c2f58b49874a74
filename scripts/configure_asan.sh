#!/usr/bin/env bash
# Configures (once) the clang build with AddressSanitizer, UndefinedBehaviorSanitizer and the
# fuzzer's coverage (CPD_FUZZ) that scripts/fuzz.sh and scripts/sanitize.sh share.
#   scripts/configure_asan.sh [BUILD_DIR]     (default build-asan)
# Without CUDA (nvcc knows no sanitizers), MPI (its libraries are not instrumented) and the
# benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-asan}
bash scripts/install_deps.sh
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCPD_FUZZ=ON -DCPD_SANITIZE=address,undefined -DCPD_WITH_CUDA=OFF -DCPD_WITH_MPI=OFF \
    -DCPD_BUILD_BENCHMARKS=OFF >/dev/null
fi
