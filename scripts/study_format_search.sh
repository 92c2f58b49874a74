#!/usr/bin/env bash
# The format-search study of docs/studies/format-search.md (MODEL=lenet5, the default) and of
# docs/studies/lm.md (MODEL=gpt): does the gradient-angle indicator (Lee, Park, Jeon, ICLR 2022)
# rank formats by how well they train? On this machine (2 cores), about an hour and a half each.
#   1. the model in fp32, seeds 1-3 (seed 1's checkpoint is the model the search judges; all three
#      are the fp32 baseline): LeNet-5 on Fashion-MNIST, 10 epochs; or the default GPT on Debian's
#      fortunes with run_main.sh --arch gpt's recipe, 2 epochs of 2^19 tokens (docs/studies/lm.md);
#   2. cpd-format-search over every enumerated 8-bit per-binade candidate plus the named 8-bit
#      formats (fp134, fp143, fp152, e4m3, e5m2, int8, int8:ch, mxfp8), sites A, E and A+E,
#      N = 100 batches, on 2 ranks (timed), and once on 1 rank (the scaling);
#   3. from scratch, A and E quantised to each of about ten formats: fp134, fp143, e4m3, int8,
#      (LeNet-5: 8-bit fixed point,) and ones spread over the A+E ranking (best, (LeNet-5: 1/8,)
#      1/4, 1/2, 3/4, worst; equal grids picked once), seeds 1-3, as long as step 1;
#   4. the report (scripts/study_format_search_report.py): tables, Spearman correlations.
#   scripts/study_format_search.sh [OUTDIR]   (default: build/studies/format-search[-gpt])
# Environment: MODEL (lenet5 | gpt), EPOCHS (10 | 2), SEEDS ("1 2 3"), BATCHES (100 | 32),
# BATCH_SIZE (128 | 16: the search's mini-batch), RANKS (2), SKIP_SCALING (unset), PARALLEL
# (trainings at a time, each with nproc / PARALLEL threads; 1).
# Re-running skips what is already there (finished runs leave their metrics files).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-lenet5}
case "$MODEL" in
  lenet5)
    OUT=${1:-build/studies/format-search}
    EPOCHS=${EPOCHS:-10}
    BATCHES=${BATCHES:-100}
    BATCH_SIZE=${BATCH_SIZE:-128}
    MODEL_FLAGS=(--arch lenet5 --dataset fashion-mnist)
    TRAIN_FLAGS=()
    ;;
  gpt)
    # The default GPT (4 x 128, 4 heads, block 128) and the recipe of docs/studies/lm.md.
    OUT=${1:-build/studies/format-search-gpt}
    EPOCHS=${EPOCHS:-2}
    BATCHES=${BATCHES:-32}
    BATCH_SIZE=${BATCH_SIZE:-16}
    MODEL_FLAGS=(--arch gpt --dataset text)
    TRAIN_FLAGS=(--tokens-per-epoch 524288 --global-batch 32 --optimizer adamw --lr 1e-3
                 --beta2 0.95 --weight-decay 0.1 --clip-grad-norm 1 --warmup-steps 20)
    ;;
  *)
    echo "study_format_search.sh: MODEL must be lenet5 or gpt, not '$MODEL'" >&2
    exit 2
    ;;
esac
SEEDS=${SEEDS:-"1 2 3"}
RANKS=${RANKS:-2}
PARALLEL=${PARALLEL:-1}
THREADS=$(( $(nproc) / PARALLEL > 0 ? $(nproc) / PARALLEL : 1 ))
BIN=${BUILD_DIR:-build}/bin
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*"; }
mpi=(mpirun -np "$RANKS" --bind-to none)
[ "$(id -u)" -ne 0 ] || mpi+=(--allow-run-as-root)
[ "$RANKS" -le "$(nproc)" ] || mpi+=(--oversubscribe)

# train NAME SEED [cpd-train flags...]: EPOCHS of the model, THREADS threads; skipped when its
# metrics file holds the last epoch already, or when the run diverged before (cpd-train's exit 3:
# a "stop" record in the metrics, which the report counts as chance).
train() {
  local name=$1 seed=$2
  shift 2
  local metrics="$OUT/train/$name.seed$seed.jsonl"
  mkdir -p "$OUT/train"
  if [ -f "$metrics" ] && grep -q -E "\"epoch\":$EPOCHS[,}]|\"type\":\"stop\"" "$metrics"; then
    log "train $name seed $seed: done already"
    return
  fi
  rm -f "$metrics"
  log "train $name seed $seed"
  local rc=0
  "$BIN/cpd-train" "${MODEL_FLAGS[@]}" "${TRAIN_FLAGS[@]}" --epochs "$EPOCHS" --seed "$seed" \
    --threads "$THREADS" --no-progress --stats-every 0 --metrics-out "$metrics" "$@" \
    >"$OUT/train/$name.seed$seed.log" 2>&1 || rc=$?
  tail -n 2 "$OUT/train/$name.seed$seed.log"
  if [ "$rc" -eq 3 ]; then
    log "train $name seed $seed: diverged (exit 3)"
  elif [ "$rc" -ne 0 ]; then
    log "train $name seed $seed: failed (exit $rc)"
    exit "$rc"
  fi
}

# in_parallel COMMAND...: runs it in the background, at most PARALLEL at a time; a failure stops
# the study at the next wait.
in_parallel() {
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do
    wait -n
  done
  "$@" &
}

# 1. The fp32 model and baseline.
for s in $SEEDS; do
  if [ "$s" = 1 ]; then
    in_parallel train fp32 1 --checkpoint-dir "$OUT/fp32-ckpt"
  else
    in_parallel train fp32 "$s"
  fi
done
while [ -n "$(jobs -rp)" ]; do wait -n; done
CKPT=$(ls "$OUT"/fp32-ckpt/ckpt-*.cpd | sort | tail -n 1)

# 2. The search: 2 ranks (timed), and 1 rank for the scaling.
NAMED=(--format fp134 --format fp143 --format fp152 --format e4m3 --format e5m2 --format int8
       --format int8:ch --format mxfp8)
search() {
  local prefix=$1
  shift
  if [ -f "$prefix.json" ]; then
    log "search $prefix: done already"
    return
  fi
  log "search $prefix: $*"
  local t0 t1
  t0=$(date +%s.%N)
  "$@" "$BIN/cpd-format-search" --checkpoint "$CKPT" "${MODEL_FLAGS[@]}" \
    --bits 8 "${NAMED[@]}" --sites A,E,A+E --batches "$BATCHES" --batch-size "$BATCH_SIZE" \
    --threads 1 --top 15 \
    --out "$prefix" --resume
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f\n", b - a}' >"$prefix.seconds"
  log "search $prefix: $(cat "$prefix.seconds") s"
}
search "$OUT/search-np$RANKS" "${mpi[@]}"
if [ -z "${SKIP_SCALING:-}" ]; then
  search "$OUT/search-np1"
fi

# 3. Formats spread over the A+E ranking, trained from scratch with A and E in them.
mapfile -t PICKS < <(python3 - "$OUT/search-np$RANKS.json" "$MODEL" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
lenet = sys.argv[2] == "lenet5"
cands = doc["candidates"]  # ranked by A+E
n = len(cands)
angle = {x["spec"]: x["angles"]["A+E"]["mean_deg"] for x in cands}
seen = []
def take(i, step):
    # The candidate at rank i, or the nearest one (moving by `step`) whose grid is not already
    # picked: equal grids (fp143 and binades:3x15,2,1,0) have equal angles to the last digit.
    while 0 <= i < n:
        spec = cands[i]["spec"]
        if all(angle[spec] != angle[p] for p in seen):
            seen.append(spec)
            return
        i += step
# The GPT's list is shorter (nine formats, not eleven): its trainings take four times as long.
for named in ("fp134", "fp143", "e4m3", "int8") + (("binades:6,5,4,3,2,1,0",) if lenet else ()):
    take([x["spec"] for x in cands].index(named), 1)
for i in (0, n // 8, n // 4, n // 2, (3 * n) // 4) if lenet else (0, n // 4, n // 2, (3 * n) // 4):
    take(i, 1)
take(n - 1, -1)
print("\n".join(seen))
EOF
)
printf '%s\n' "${PICKS[@]}" >"$OUT/picks.txt"
for f in "${PICKS[@]}"; do
  safe=$(echo "$f" | tr ':,=' '___')
  for s in $SEEDS; do
    in_parallel train "q-$safe" "$s" --a-format "$f" --e-format "$f"
  done
done
while [ -n "$(jobs -rp)" ]; do wait -n; done

# 4. The report.
python3 scripts/study_format_search_report.py --out "$OUT" --ranks "$RANKS" --seeds "$SEEDS" \
  --model "$MODEL" \
  | tee "$OUT/report.md"
log "report: $OUT/report.md"
