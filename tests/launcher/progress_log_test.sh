#!/usr/bin/env bash
# A batch job's log: cpd-train's stdout redirected to a file holds no carriage return and at
# most 10 progress lines an epoch. Three launches, as cluster jobs run it:
#   local  one process, and 2 ranks under mpirun (Open MPI gives each rank a pseudo-terminal, so
#          isatty says yes although the job's output is a file);
#   srun   2 ranks under Slurm's `srun --mpi=pmix` (skipped, exit 77, where no Slurm runs here:
#          scripts/slurm_local.sh starts one).
# --progress-interval 0 is the worst case: only the tenth-of-an-epoch bound limits the lines.
# Usage: progress_log_test.sh local|srun <bin dir> [mpiexec]
set -euo pipefail

MODE=${1:?usage: progress_log_test.sh local|srun <bin dir> [mpiexec]}
BIN=${2:?usage: progress_log_test.sh local|srun <bin dir> [mpiexec]}
MPIEXEC=${3:-}
EPOCHS=2
skip() { echo "progress_log_test: SKIPPED: $*"; exit 77; }
fail() { echo "progress_log_test: FAILED: $*" >&2; exit 1; }

log=$(mktemp /tmp/progress_log_test.XXXXXX.log)
trap 'rm -f "$log"' EXIT
# 8192 synthetic images, global batch 64: 128 steps an epoch.
train=("$BIN/cpd-train" --dataset synthetic --arch mlp --epochs "$EPOCHS" --global-batch 64
       --threads 1 --progress-interval 0)

check_log() {  # check_log WHAT: the log of one launch
  local what=$1 crs lines e
  crs=$(tr -cd '\r' <"$log" | wc -c)
  [ "$crs" -eq 0 ] || { cat -A "$log" | head -20; fail "$what: $crs carriage return(s) in the log"; }
  grep -q "^epoch $EPOCHS/$EPOCHS " "$log" || { cat "$log"; fail "$what: no final epoch line"; }
  for e in $(seq 1 "$EPOCHS"); do
    lines=$(grep -c "^  epoch $e/$EPOCHS step " "$log" || true)
    [ "$lines" -ge 1 ] && [ "$lines" -le 10 ] ||
      { cat "$log"; fail "$what: epoch $e has $lines progress lines (expected 1..10)"; }
  done
  echo "progress_log_test: $what: $(wc -l <"$log") lines, no carriage return, $lines progress lines in epoch $EPOCHS"
}

case "$MODE" in
  local)
    "${train[@]}" >"$log" 2>&1 || { cat "$log"; fail "one process: cpd-train exited with $?"; }
    check_log "one process"
    [ -n "$MPIEXEC" ] || skip "no mpiexec given (a build without MPI): one process passed"
    as_root=()
    [ "$(id -u)" -ne 0 ] || as_root=(--allow-run-as-root)
    # Whether this mpirun hands its ranks a terminal: the case auto must see through.
    tty=$("$MPIEXEC" "${as_root[@]}" -np 1 sh -c 'if [ -t 1 ]; then echo a terminal; else echo not a terminal; fi' </dev/null 2>/dev/null || echo unknown)
    echo "progress_log_test: under mpirun a rank's stdout is $tty"
    timeout 300 "$MPIEXEC" "${as_root[@]}" -np 2 "${train[@]}" >"$log" 2>&1 </dev/null ||
      { cat "$log"; fail "mpirun -np 2: exited with $?"; }
    check_log "mpirun -np 2"
    ;;
  srun)
    command -v srun >/dev/null 2>&1 || skip "srun not found (see scripts/slurm_local.sh)"
    states=$(timeout 20 sinfo -h -o '%T' 2>/dev/null || true)
    echo "$states" | grep -qxE 'idle|mixed' || skip "no idle Slurm node (run scripts/slurm_local.sh)"
    timeout 20 srun --mpi=list 2>&1 | grep -qw pmix || skip "Slurm has no pmix MPI plugin"
    timeout 300 srun --mpi=pmix --overcommit -n 2 --job-name=cpd_progress_log_test "${train[@]}" \
      >"$log" 2>&1 </dev/null || { cat "$log"; fail "srun -n 2: exited with $?"; }
    check_log "srun -n 2"
    ;;
  *) fail "unknown mode '$MODE'" ;;
esac
echo "progress_log_test: PASSED ($MODE)"
