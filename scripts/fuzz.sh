#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang, -fsanitize=fuzzer,address,undefined) into
# build-asan/ and runs each for SECONDS seconds (default 30) from its committed seed corpus
# (tests/fuzz/corpus/<target>/, read only: new inputs go to build-asan/fuzz/<target>/).
#   scripts/fuzz.sh [SECONDS] [TARGET...]        e.g. scripts/fuzz.sh 600 format_fuzz
# Prints one line per target (executions, corpus size, crashes) and a total; exits 1 when any
# target found a crash, leak, sanitizer report or timeout (the reproducer is named: run the
# target on it to see the report). Environment: ASAN_BUILD_DIR (build-asan), JOBS (build
# jobs), FUZZ_JOBS (targets run at once; default: the cores).
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
secs=${1:-30}
shift || true
TARGETS=(format_fuzz checkpoint_raw_fuzz checkpoint_fuzz idx_fuzz cifar_fuzz token_stream_fuzz train_config_fuzz
         coordinator_validate_fuzz format_search_partial_fuzz token_file_fuzz study_file_fuzz
         run_state_fuzz)
if [ $# -gt 0 ]; then TARGETS=("$@"); fi

BUILD=${ASAN_BUILD_DIR:-build-asan}
bash scripts/configure_asan.sh "$BUILD"
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}"

work="$BUILD/fuzz"
mkdir -p "$work"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
run_one() {
  local t=$1
  mkdir -p "$work/$t"
  rm -f "$work/$t.log" "$work/$t"-crash-* "$work/$t"-leak-* "$work/$t"-timeout-* "$work/$t"-oom-*
  # -rss_limit_mb: an input that makes a reader allocate what the data does not back (a header
  # that announces gigabytes) fails the run instead of passing on a big machine.
  "$BUILD/bin/$t" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=30 -print_final_stats=1 \
    -artifact_prefix="$work/$t-" "$work/$t" "tests/fuzz/corpus/$t" >"$work/$t.log" 2>&1
}
pids=()
status=0
for t in "${TARGETS[@]}"; do
  run_one "$t" &
  pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "${FUZZ_JOBS:-$(nproc)}" ]; do wait -n || true; done
done
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then status=1; fi
done

total=0
printf '%-28s %14s %10s %8s\n' target executions corpus crashes
for t in "${TARGETS[@]}"; do
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t.log" | tail -1)
  found=("$work/$t"-crash-* "$work/$t"-leak-* "$work/$t"-timeout-* "$work/$t"-oom-*)
  crashes=${#found[@]}
  printf '%-28s %14s %10s %8s\n' "$t" "${execs:-?}" "$(ls "$work/$t" | wc -l)" "$crashes"
  total=$((total + ${execs:-0}))
  if [ "$crashes" -gt 0 ] || ! grep -q '^stat::number_of_executed_units' "$work/$t.log"; then
    status=1
    echo "  $t failed: see $work/$t.log; reproduce with $BUILD/bin/$t <the file above>" >&2
    grep -m 5 -E 'ERROR|runtime error|invariant|deadly signal' "$work/$t.log" >&2 || true
  fi
done
echo "fuzz: $total executions in total, ${secs} s per target"
exit $status
