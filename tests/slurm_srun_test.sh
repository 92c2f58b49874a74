#!/usr/bin/env bash
# comm_mpi_test as 3 MPI ranks launched by Slurm (`srun --mpi=pmix --overcommit`) instead of mpirun.
# Skipped (exit 77) when Slurm is not installed or not running here, or has no idle node or no pmix
# plugin: ctest never starts Slurm (scripts/slurm_local.sh does that, by hand).
# Usage: slurm_srun_test.sh <comm_mpi_test binary> [ranks, default 3]
set -euo pipefail

BIN=${1:?usage: slurm_srun_test.sh <comm_mpi_test binary> [ranks]}
NP=${2:-3}
skip() { echo "slurm_srun_test: SKIPPED: $*"; exit 77; }
fail() { echo "slurm_srun_test: FAILED: $*" >&2; exit 1; }

[ -x "$BIN" ] || fail "$BIN is not an executable"
command -v srun >/dev/null 2>&1 || skip "srun not found (Slurm not installed; see scripts/slurm_local.sh)"
command -v sinfo >/dev/null 2>&1 || skip "sinfo not found (Slurm not installed; see scripts/slurm_local.sh)"

# A configured but stopped controller makes sinfo retry for a while: bound it.
states=$(timeout 20 sinfo -h -o '%T' 2>/dev/null || true)
echo "$states" | grep -qxE 'idle|mixed' \
  || skip "no idle Slurm node (sinfo states: '${states//$'\n'/ }'; run scripts/slurm_local.sh)"
timeout 20 srun --mpi=list 2>&1 | grep -qw pmix || skip "Slurm has no pmix MPI plugin (srun --mpi=list)"

# Open MPI 4.1.4 + PMIx 4.2 under Slurm 22.05's mpi/pmix_v4 needs no extra OMPI_MCA_/PMIX_MCA_ env.
export OMP_NUM_THREADS=1
log=$(mktemp /tmp/slurm_srun_test.XXXXXX.log)
trap 'rm -f "$log"' EXIT
echo "slurm_srun_test: srun --mpi=pmix --overcommit -n $NP $BIN"
set +e
timeout 120 srun --mpi=pmix --overcommit -n "$NP" --job-name=cpd_slurm_srun_test "$BIN" >"$log" 2>&1
rc=$?
set -e
cat "$log"
[ "$rc" -ne 124 ] || fail "srun timed out after 120 s"
[ "$rc" -eq 0 ] || fail "srun exited with status $rc"
# Only rank 0 prints gtest's summary, so exactly one PASSED line also shows that the ranks formed one
# world of $NP (ranks that fell back to singleton MPI would each print one).
passed=$(grep -c '^\[  PASSED  \]' "$log" || true)
[ "$passed" -eq 1 ] || fail "expected one '[  PASSED  ]' line from rank 0, saw $passed"
if grep -q '^\[  FAILED  \]' "$log"; then fail "gtest reported FAILED"; fi
echo "slurm_srun_test: PASSED ($NP ranks under srun --mpi=pmix)"
