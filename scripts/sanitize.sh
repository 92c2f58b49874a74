#!/usr/bin/env bash
# Unit tests under sanitizers, in two clang builds of their own:
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (build-asan, shared with fuzz.sh): the
#         suites of every input path and of the core (formats, quantisers, codecs, data
#         readers, checkpoints and the run's stop rules, the command lines, the coordinator's
#         service), each filtered as in ASAN_SUITES below;
#   tsan  ThreadSanitizer (build-tsan): the coordinator's service (coordinator_test: gRPC
#         threads, the store's writer thread, streams) and the worker's client
#         (coordinator_client_test: its session and watch threads) against a TSan-built
#         cpd-coordinator.
#   scripts/sanitize.sh [asan|tsan|all]        (default all)
# The CUDA, MPI and GPU suites are not built here (nvcc and Open MPI are not instrumented), nor
# the long training suites (ResNet, all-reduce sweeps): ASan makes them 3-10x slower and they
# add no input path; the plain build runs them (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
JOBS=${JOBS:-$(nproc)}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1}
# Third-party allocations kept for the process's life (libomp, c-ares) are not reported.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/sanitizers/lsan.supp}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# gRPC (not instrumented) does its own fd synchronisation: tests/sanitizers/tsan.supp.
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/sanitizers/tsan.supp}

passed=0
failed=0
failures=()
# run_suite BUILD SUITE [GTEST_FILTER]
run_suite() {
  local build=$1 suite=$2 filter=${3:-*}
  local log="$build/sanitize-$suite.log"
  if "$build/bin/$suite" --gtest_filter="$filter" >"$log" 2>&1; then
    passed=$((passed + 1))
    echo "  $suite: $(grep -E '^\[  PASSED  \]' "$log" | tail -1)"
  else
    failed=$((failed + 1))
    failures+=("$suite (see $log)")
    echo "  $suite: FAILED"
    grep -m 10 -E 'ERROR: |WARNING: ThreadSanitizer|runtime error|\[  FAILED  \]' "$log" || true
  fi
}

# suite:filter
ASAN_SUITES=(
  status_test format_test codec_test properties_test hysteresis_test schedule_test
  quant_sites_test optimizer_test data_test
  "trainer_test:TrainerCheckpoint.*:TrainerDivergence.*:TrainerOptions.*:TrainerResume.Fp32*"
  cpd_quant_cli_test
  "cpd_train_cli_test:CpdTrainCli.*-CpdTrainCli.CptPreset*"
  coordinator_test cpdctl_lib_test
)
if [ "$stage" = asan ] || [ "$stage" = all ]; then
  echo "sanitize: ASan + UBSan"
  bash scripts/configure_asan.sh build-asan
  cmake -S . -B build-asan -DCPD_BUILD_TESTS=ON >/dev/null
  targets=()
  for s in "${ASAN_SUITES[@]}"; do targets+=("${s%%:*}"); done
  cmake --build build-asan -j "$JOBS" --target "${targets[@]}" cpd-quant cpd-train
  for s in "${ASAN_SUITES[@]}"; do
    suite=${s%%:*}
    filter='*'
    [ "$suite" != "$s" ] && filter=${s#*:}
    run_suite build-asan "$suite" "$filter"
  done
fi
if [ "$stage" = tsan ] || [ "$stage" = all ]; then
  echo "sanitize: TSan"
  bash scripts/install_deps.sh
  if [ ! -f build-tsan/CMakeCache.txt ]; then
    CC=clang CXX=clang++ cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCPD_SANITIZE=thread -DCPD_WITH_CUDA=OFF -DCPD_WITH_MPI=OFF -DCPD_WITH_DNNL=OFF \
      -DCPD_BUILD_BENCHMARKS=OFF >/dev/null
  fi
  cmake --build build-tsan -j "$JOBS" --target coordinator_test coordinator_client_test \
    cpd-coordinator
  run_suite build-tsan coordinator_test
  run_suite build-tsan coordinator_client_test
fi
echo "sanitize: $passed passed, $failed failed"
for f in "${failures[@]+"${failures[@]}"}"; do echo "  failed: $f"; done
[ "$failed" -eq 0 ]
