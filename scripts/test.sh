#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite with ctest.
#   scripts/test.sh [extra cmake args...]
# CUDA tests skip cleanly on machines without a GPU. Under CI (CI=true, as .ci/run sets it) every
# fuzz target runs for FUZZ_SECONDS seconds (scripts/fuzz.sh, default 30); with HARDEN=1 the
# unit tests under sanitizers (scripts/sanitize.sh: ASan+UBSan and TSan builds with clang) run
# first. Each stage prints its wall time.
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
# The sanitizer builds of the unit tests (ASan+UBSan, TSan) are two more clang builds that would
# take CI past its 30-minute budget on two cores: they run with HARDEN=1. CI runs the fuzz
# targets, whose build is ASan+UBSan too.
if [ "${HARDEN:-0}" = 1 ]; then
  stage sanitize bash scripts/sanitize.sh all
fi
if [ "${CI:-}" = true ] || [ "${HARDEN:-0}" = 1 ]; then
  stage fuzz bash scripts/fuzz.sh "${FUZZ_SECONDS:-30}"
fi
