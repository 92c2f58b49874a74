#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite with ctest.
#   scripts/test.sh [extra cmake args...]
# CUDA tests skip cleanly on machines without a GPU. Under CI (CI=true, as .ci/run sets it), as
# root, scripts/slurm_local.sh first starts a one-node Slurm for the Slurm tests (they skip where
# it cannot start); after ctest the unit tests under ASan+UBSan (scripts/sanitize.sh asan) and
# every fuzz target for FUZZ_SECONDS seconds (scripts/fuzz.sh, default 30) follow; HARDEN=1 adds
# the TSan build. Each stage prints its wall time.
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
# Under CI (root) a real one-node Slurm comes up so that the Slurm tests run (srun --mpi=pmix of
# the MPI suite, a cpd-study job array); where it cannot start they say so and skip.
if [ "${CI:-}" = true ] && [ "$(id -u)" -eq 0 ]; then
  stage slurm bash -c 'bash scripts/slurm_local.sh || echo "test.sh: Slurm could not start here; the Slurm tests will skip"'
fi
stage ctest bash -c "cd '$BUILD_DIR' && ctest --output-on-failure -j '${JOBS:-$(nproc)}' --timeout 900"
# Under CI the ASan+UBSan suites run (their clang build is the fuzz targets' too); the TSan build
# (a second clang build, of the coordinator and its client) would take CI past its 30-minute
# budget on two cores: it runs with HARDEN=1.
if [ "${HARDEN:-0}" = 1 ]; then
  stage sanitize bash scripts/sanitize.sh all
elif [ "${CI:-}" = true ]; then
  stage sanitize bash scripts/sanitize.sh asan
fi
if [ "${CI:-}" = true ] || [ "${HARDEN:-0}" = 1 ]; then
  stage fuzz bash scripts/fuzz.sh "${FUZZ_SECONDS:-30}"
fi
