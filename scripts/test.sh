#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite with ctest.
#   scripts/test.sh [extra cmake args...]
# CUDA tests skip cleanly on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
BUILD_DIR=${BUILD_DIR:-build}
cd "$BUILD_DIR"
ctest --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 900
