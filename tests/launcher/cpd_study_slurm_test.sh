#!/usr/bin/env bash
# cpd-study on the real one-node Slurm of scripts/slurm_local.sh: a tiny study of 2 runs, 2 ranks
# each, submitted as a 2-task job array (`run --launcher slurm --wait`); every task runs its run
# with srun --mpi=pmix. Checks the runs' files, that a second submission submits nothing, and
# the report. Skipped (exit 77) when Slurm is not installed or not running here: ctest never
# starts Slurm (scripts/test.sh does under CI, as root).
# Usage: cpd_study_slurm_test.sh <cpd-study binary>
set -euo pipefail

STUDY=${1:?usage: cpd_study_slurm_test.sh <cpd-study binary>}
skip() { echo "cpd_study_slurm_test: SKIPPED: $*"; exit 77; }
fail() { echo "cpd_study_slurm_test: FAILED: $*" >&2; exit 1; }

[ -x "$STUDY" ] || fail "$STUDY is not an executable"
command -v sbatch >/dev/null 2>&1 || skip "sbatch not found (Slurm not installed; see scripts/slurm_local.sh)"
states=$(timeout 20 sinfo -h -o '%T' 2>/dev/null || true)
echo "$states" | grep -qxE 'idle|mixed|allocated' \
  || skip "no usable Slurm node (sinfo states: '${states//$'\n'/ }'; run scripts/slurm_local.sh)"
timeout 20 srun --mpi=list 2>&1 | grep -qw pmix || skip "Slurm has no pmix MPI plugin (srun --mpi=list)"

# The batch tasks run as the submitting user in its working directory: a directory they can
# reach, not one private to this process.
dir=$(mktemp -d /tmp/cpd_study_slurm.XXXXXX)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/tiny.yaml" <<'YAML'
name: tiny-slurm
ranks: 2
base:
  arch: mlp
  dataset: synthetic
  epochs: 1
  max-steps: 6
  threads: 1
  allreduce: emulate
  allreduce-format: e4m3
  stats-every: 2
grid:
  aps: [false, true]
seeds: [1]
YAML
out=$dir/out
cd "$dir"
echo "cpd_study_slurm_test: $STUDY run tiny.yaml --launcher slurm --wait"
set +e
timeout 300 "$STUDY" run tiny.yaml --out "$out" --launcher slurm --wait >"$dir/run.log" 2>&1
rc=$?
set -e
cat "$dir/run.log"
[ "$rc" -ne 124 ] || fail "the study did not finish within 300 s"
[ "$rc" -eq 0 ] || {
  for f in "$out"/slurm/*.log "$out"/runs/*/log.txt; do [ -f "$f" ] && { echo "== $f"; tail -20 "$f"; }; done
  fail "cpd-study run --launcher slurm exited with $rc"
}
grep -q -- "--array=0-1" "$dir/run.log" || fail "the array was not 0-1"
for run in aps_off.seed_1 aps_on.seed_1; do
  r=$out/runs/$run
  grep -q '"state": *"done"' "$r/state.json" || fail "$run is not done: $(cat "$r/state.json")"
  grep -q '^srun --mpi=pmix -n 2 ' "$r/cmd.txt" || fail "$run did not start with srun: $(cat "$r/cmd.txt")"
  grep -q 'replicas bit-identical on 2 rank' "$r/log.txt" || fail "$run did not run on 2 ranks"
  [ "$(grep -c '"type":"epoch"' "$r/metrics.jsonl")" -eq 1 ] || fail "$run has no epoch record"
done
[ "$(ls "$out"/slurm/*.log | wc -l)" -eq 2 ] || fail "expected one Slurm log per array task"

# Everything is done: a second submission submits nothing and leaves the runs as they are.
before=$(cat "$out"/runs/*/state.json | md5sum)
"$STUDY" run tiny.yaml --out "$out" --launcher slurm --wait >"$dir/again.log" 2>&1 \
  || fail "second run: $(cat "$dir/again.log")"
grep -q "2 done or diverged, 0 failed or running (not submitted), 0 to submit" "$dir/again.log" \
  || fail "second run submitted again: $(cat "$dir/again.log")"
[ "$(cat "$out"/runs/*/state.json | md5sum)" = "$before" ] || fail "a finished run was touched"

"$STUDY" report tiny.yaml --out "$out" --no-plot >"$dir/report.log" 2>&1 || fail "report: $(cat "$dir/report.log")"
[ "$(tail -n +2 "$out/report/runs.csv" | wc -l)" -eq 2 ] || fail "runs.csv does not have 2 rows"
grep -q "aps" "$out/report/summary.md" || fail "summary.md lacks the aps axis"
echo "cpd_study_slurm_test: PASSED (2-task array, 2 ranks per run under srun --mpi=pmix, report)"
