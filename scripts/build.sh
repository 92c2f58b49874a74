#!/usr/bin/env bash
# Installs dependencies (idempotent) and builds CPD into build/ (Release by default).
#   scripts/build.sh [extra cmake args...]     e.g. -DCPD_WITH_CUDA=OFF
# Environment: BUILD_DIR (default build), BUILD_TYPE (default Release), JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh

BUILD_DIR=${BUILD_DIR:-build}
BUILD_TYPE=${BUILD_TYPE:-Release}
JOBS=${JOBS:-$(nproc)}
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" "$@" >/dev/null
elif [ $# -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" "$@" >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
