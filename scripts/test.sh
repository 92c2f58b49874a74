#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite with ctest.
#   scripts/test.sh [extra cmake args...]
# CUDA tests skip cleanly on machines without a GPU. Under CI (CI=true, as .ci/run sets it) or
# with HARDEN=1, two more stages follow: the unit tests under sanitizers (scripts/sanitize.sh:
# ASan+UBSan and TSan builds with clang) and every fuzz target for FUZZ_SECONDS seconds
# (scripts/fuzz.sh, default 30). Each stage prints its wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() {  # stage NAME COMMAND...: runs it and says how long it took
  local name=$1 start=$SECONDS
  shift
  "$@"
  echo "test.sh: stage '$name' took $((SECONDS - start)) s"
}
BUILD_DIR=${BUILD_DIR:-build}
stage build bash scripts/build.sh "$@"
stage ctest bash -c "cd '$BUILD_DIR' && ctest --output-on-failure -j '${JOBS:-$(nproc)}' --timeout 900"
if [ "${CI:-}" = true ] || [ "${HARDEN:-0}" = 1 ]; then
  stage sanitize bash scripts/sanitize.sh all
  stage fuzz bash scripts/fuzz.sh "${FUZZ_SECONDS:-30}"
fi
