#!/usr/bin/env bash
# Installs dependencies (idempotent) and builds CPD into build/ (Release by default), saying
# what it does: a line per stage (packages, configure, compile) with its time, and the
# compiler's progress as ninja's [n/N] lines (one line redrawn on a terminal, plain lines in a
# file or a batch log).
#   scripts/build.sh [extra cmake args...]     e.g. -DCPD_WITH_CUDA=OFF
# Environment: BUILD_DIR (default build), BUILD_TYPE (default Release), JOBS (default nproc),
# QUIET=1 (the stage lines only; a failed step still shows its output).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
BUILD_TYPE=${BUILD_TYPE:-Release}
JOBS=${JOBS:-$(nproc)}
QUIET=${QUIET:-0}
stage_start=$SECONDS stage_no=0
stage() { stage_no=$1 stage_start=$SECONDS; echo "build.sh: [$1/3] $2"; }
took() { echo "build.sh: [$stage_no/3] done in $((SECONDS - stage_start)) s"; }
# Runs a step with its output to LOG (QUIET=1) or to the console; a failed quiet step shows the
# end of its log.
run_step() {
  local log=$1
  shift
  if [ "$QUIET" = 1 ]; then
    "$@" >"$log" 2>&1 || { tail -n 40 "$log" >&2; return 1; }
  else
    "$@"
  fi
}

stage 1 "Debian packages (scripts/install_deps.sh)"
bash scripts/install_deps.sh
took

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
mkdir -p "$BUILD_DIR"
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  stage 2 "configure $BUILD_DIR ($BUILD_TYPE; the output in $BUILD_DIR/configure.log)"
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" "$@" \
    >"$BUILD_DIR/configure.log" 2>&1 || { tail -n 40 "$BUILD_DIR/configure.log" >&2; exit 1; }
  took
elif [ $# -gt 0 ]; then
  stage 2 "configure $BUILD_DIR again with $* (the output in $BUILD_DIR/configure.log)"
  cmake -S . -B "$BUILD_DIR" "$@" >"$BUILD_DIR/configure.log" 2>&1 ||
    { tail -n 40 "$BUILD_DIR/configure.log" >&2; exit 1; }
  took
else
  stage 2 "configure: $BUILD_DIR is configured (cmake re-runs by itself when a CMakeLists.txt"
  echo "build.sh:       changes)"
fi
stage 3 "compile ($JOBS jobs; a fresh build of everything takes several minutes on 2 cores)"
run_step "$BUILD_DIR/build.log" cmake --build "$BUILD_DIR" -j "$JOBS"
took
