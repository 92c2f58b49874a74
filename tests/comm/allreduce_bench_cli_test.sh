#!/usr/bin/env bash
# cpd-allreduce-bench's sizes are bounded before anything is allocated (issue 26: -e 10^18
# allocated until memory ran out, --pipeline-kb -1 was accepted): each bad value is one line on
# stderr naming it, exit 2, and nothing on stdout.
#   allreduce_bench_cli_test.sh BENCH
set -uo pipefail
bench=$1
failures=0
expect_usage() {  # expect_usage NEEDLE ARGS...
  local needle=$1
  shift
  local out err rc
  out=$(timeout 60 "$bench" "$@" 2>/tmp/bench_cli_err.$$)
  rc=$?
  err=$(cat /tmp/bench_cli_err.$$)
  if [ "$rc" -ne 2 ] || [ "$(printf '%s\n' "$err" | wc -l)" -ne 1 ] || [ -n "$out" ] ||
     [[ "$err" != *"$needle"* ]]; then
    echo "FAIL: $* -> exit $rc, stderr: $err, stdout: ${out:0:200}"
    failures=$((failures + 1))
  else
    echo "ok: $* -> $err"
  fi
}
expect_usage "-e 1000000000000000000 is not accepted" -e 1000000000000000000
expect_usage "bad -b/-e" -e 99999999999999999999999
expect_usage "bad -b/-e" -e 99999999999G
expect_usage "--pipeline-kb -1 is not accepted" --pipeline-kb -1 -e 1M
expect_usage "--pipeline-kb 2000000 is not accepted" --pipeline-kb 2000000 -e 1M
expect_usage "--bucket-mb" --bucket-mb 0 -e 1M
expect_usage "--threads" --threads 99999
rm -f /tmp/bench_cli_err.$$
[ "$failures" -eq 0 ]
