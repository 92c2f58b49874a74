#!/usr/bin/env bash
# Test accuracy of LeNet-5 on Fashion-MNIST trained by 8 data-parallel workers whose gradients
# are summed in low precision: the fp32 all-reduce against CPD's emulated sum (every addition
# rounded to the format) and the packed low-bit all-reduce, in e4m3, e5m2 and e3m0, each with
# and without auto-precision scaling (APS). 8 workers = --emulate-ranks 8 in one process; a
# second block runs mpirun -np 4 x --emulate-ranks 2 (the same computation, so the same
# accuracies bit for bit where the sum is defined element-wise).
#   benchmarks/allreduce_accuracy.sh [--epochs N] [--quick] [--report]
#   (--quick: 1 epoch, a subset; --report: print the table of the runs already in $OUT_DIR)
# Prints a markdown table; per-run logs and metrics go to $OUT_DIR (default /tmp/cpd_ar_acc),
# one line per finished run to $OUT_DIR/results.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=10
QUICK=0
REPORT=0
while [ $# -gt 0 ]; do
  case "$1" in
    --epochs) EPOCHS=$2; shift 2 ;;
    --quick) QUICK=1; EPOCHS=1; shift ;;
    --report) REPORT=1; shift ;;
    -h|--help) sed -n 2,11p "$0"; exit 0 ;;
    *) echo "allreduce_accuracy.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
BIN=${BUILD_DIR:-build}/bin
[ -x "$BIN/cpd-train" ] || { echo "allreduce_accuracy.sh: build first (scripts/build.sh)" >&2; exit 1; }
OUT_DIR=${OUT_DIR:-/tmp/cpd_ar_acc}
mkdir -p "$OUT_DIR"
common=(--arch lenet5 --dataset fashion-mnist --epochs "$EPOCHS" --global-batch 128
        --no-progress --stats-every 0)
mpi=(--bind-to none --oversubscribe)
[ "$(id -u)" -ne 0 ] || mpi+=(--allow-run-as-root)

# name | launcher | flags
runs=()
add() { runs+=("$1|$2|$3"); }
add "fp32" single "--allreduce fp32"
formats=(e4m3 e5m2 e3m0)
algos=(emulate packed)
[ "$QUICK" -eq 0 ] || { formats=(e4m3 e3m0); algos=(packed); }
for algo in "${algos[@]}"; do
  for f in "${formats[@]}"; do
    add "$algo $f APS" single "--allreduce $algo --allreduce-format $f --aps"
    add "$algo $f" single "--allreduce $algo --allreduce-format $f"
  done
done
add "fp32" mpi4 "--allreduce fp32"
add "packed e4m3 APS" mpi4 "--allreduce packed --allreduce-format e4m3 --aps"
[ "$QUICK" -eq 1 ] || add "emulate e3m0 APS" mpi4 "--allreduce emulate --allreduce-format e3m0 --aps"

RESULTS="$OUT_DIR/results.txt"
[ "$REPORT" -eq 1 ] || : >"$RESULTS"
for r in "${runs[@]}"; do
  [ "$REPORT" -eq 0 ] || break
  IFS='|' read -r name how flags <<<"$r"
  tag=$(echo "$how $name" | tr ' ' '_')
  metrics="$OUT_DIR/$tag.jsonl"
  rm -f "$metrics"
  start=$(date +%s)
  if [ "$how" = single ]; then
    # shellcheck disable=SC2086
    "$BIN/cpd-train" "${common[@]}" --emulate-ranks 8 --threads "$(nproc)" $flags \
      --metrics-out "$metrics" >"$OUT_DIR/$tag.log" 2>&1 || { echo "FAILED: $name ($how), see $OUT_DIR/$tag.log" >&2; continue; }
  else
    # shellcheck disable=SC2086
    mpirun -np 4 "${mpi[@]}" "$BIN/cpd-train" "${common[@]}" --emulate-ranks 2 --threads 1 \
      $flags --metrics-out "$metrics" >"$OUT_DIR/$tag.log" 2>&1 || { echo "FAILED: $name ($how), see $OUT_DIR/$tag.log" >&2; continue; }
  fi
  secs=$(( $(date +%s) - start ))
  read -r acc skipped < <(python3 -c '
import json, sys
last = [json.loads(l) for l in open(sys.argv[1]) if "\"epoch\"" in l and json.loads(l)["type"] == "epoch"][-1]
print("%.2f %d" % (100 * last["test_accuracy"], last.get("skipped_steps", 0)))' "$metrics")
  echo "$name|$how|$acc|$skipped|$secs" >>"$RESULTS"
  echo "done: $name ($how) test $acc% in ${secs}s" >&2
done

[ -s "$RESULTS" ] || { echo "allreduce_accuracy.sh: no finished runs in $RESULTS" >&2; exit 1; }
base=$(awk -F'|' '$1 == "fp32" && $2 == "single" { print $3; exit }' "$RESULTS")
echo
echo "LeNet-5 / Fashion-MNIST, global batch 128 over 8 workers"
echo
echo "| all-reduce | workers | test acc (%) | vs fp32 | skipped steps | time (s) |"
echo "|---|---|---:|---:|---:|---:|"
while IFS='|' read -r n h a s t; do
  where="1 process x 8 emulated"
  [ "$h" = mpi4 ] && where="mpirun -np 4 x 2 emulated"
  delta=$(python3 -c "print('%+.2f' % ($a - ${base:-$a}))")
  echo "| $n | $where | $a | $delta | $s | $t |"
done <"$RESULTS"
