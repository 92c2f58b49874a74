#!/usr/bin/env bash
# cpd-study's own cost, each figure beside a baseline measured in the same run:
#   plan    a 10,000-run grid, against the process start of `cpd-study --version`
#   report  500 runs x ~2 MiB of metrics (~1 GB; copies of a real LeNet-5 run's metrics with
#           per-layer statistics every step), against reading the same bytes with `cat`
#   driver  N tiny runs through `cpd-study run`, against the same cpd-train commands run one
#           after another by a shell loop: the difference per run is what the driver adds
# Targets (issue 14): plan < 1 s, report < 30 s, driver < 1 s per run.
# Usage: benchmarks/bench_study.sh [build dir, default build] [runs for the driver, default 20]
set -euo pipefail
BUILD=${1:-build}
N=${2:-20}
BIN=$(cd "$BUILD/bin" && pwd)
STUDY=$BIN/cpd-study
TRAIN=$BIN/cpd-train
[ -x "$STUDY" ] && [ -x "$TRAIN" ] || { echo "bench_study: build $BUILD first" >&2; exit 2; }
WORK=$(mktemp -d /tmp/bench_study.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.3f}')"; }

# --- plan: 10,000 runs -------------------------------------------------------------------------
python3 - "$WORK/plan.yaml" <<'PY'
import sys
lrs = ", ".join(f"{0.001 * (i + 1):.3f}" for i in range(100))
open(sys.argv[1], "w").write(f"""name: big
base:
  arch: mlp
  dataset: synthetic
grid:
  lr: [{lrs}]
  momentum: [0.5, 0.6, 0.7, 0.8, 0.9]
  global-batch: [64, 128, 256, 512]
  allreduce-format: [e4m3, e5m2, e3m0, fp16, bf16]
seeds: [1]
""")
PY
t0=$(now); "$STUDY" --version >/dev/null; t1=$(now)
"$STUDY" plan "$WORK/plan.yaml" >"$WORK/plan.txt"; t2=$(now)
plan_runs=$(wc -l <"$WORK/plan.txt")
plan_s=$(secs "$t1" "$t2"); start_s=$(secs "$t0" "$t1")

# --- report: 500 runs of ~2 MiB metrics ----------------------------------------------------------
"$TRAIN" --arch lenet5 --dataset synthetic --epochs 2 --max-steps 60 --emulate-ranks 4 \
  --global-batch 64 --allreduce emulate --allreduce-format e4m3 --aps --stats-every 1 \
  --threads 2 --quiet --metrics-out "$WORK/template.jsonl"
python3 - "$WORK" 500 <<'PY'
import json, os, sys
work, runs = sys.argv[1], int(sys.argv[2])
lrs = ", ".join(f"{0.0001 * (i + 1):.4f}" for i in range(runs))
open(os.path.join(work, "report.yaml"), "w").write(
    f"name: many\nbase:\n  arch: lenet5\ngrid:\n  lr: [{lrs}]\nseeds: [1]\n")
tmpl = open(os.path.join(work, "template.jsonl")).read()
body = tmpl * max(1, (2 << 20) // len(tmpl))  # ~2 MiB: the template's records repeated
state = json.dumps({"state": "done", "exit_code": 0, "start_ms": 0, "end_ms": 1000,
                    "wall_s": 1.0, "total_wall_s": 1.0, "attempts": 1, "host": "h", "pid": 0})
for i in range(runs):
    d = os.path.join(work, "out", "runs", f"lr_{0.0001 * (i + 1):.4f}.seed_1")
    os.makedirs(d)
    open(os.path.join(d, "metrics.jsonl"), "w").write(body)
    open(os.path.join(d, "state.json"), "w").write(state)
PY
bytes=$(cat "$WORK"/out/runs/*/metrics.jsonl | wc -c)
sync
t0=$(now); cat "$WORK"/out/runs/*/metrics.jsonl >/dev/null; t1=$(now)
"$STUDY" report "$WORK/report.yaml" --out "$WORK/out" --no-plot >/dev/null; t2=$(now)
cat_s=$(secs "$t0" "$t1"); report_s=$(secs "$t1" "$t2")
rows=$(($(wc -l <"$WORK/out/report/runs.csv") - 1))

# --- driver overhead: N tiny runs ------------------------------------------------------------------
seeds=$(seq -s, 1 "$N")
cat >"$WORK/tiny.yaml" <<YAML
name: tiny
base:
  arch: mlp
  dataset: synthetic
  max-steps: 2
  threads: 1
  stats-every: 0
grid:
  lr: [0.05]
seeds: [$seeds]
YAML
mkdir -p "$WORK/direct"
t0=$(now)
for s in $(seq 1 "$N"); do
  "$TRAIN" --arch mlp --dataset synthetic --max-steps 2 --threads 1 --stats-every 0 --lr 0.05 --seed "$s" \
    --resume auto --checkpoint-dir "$WORK/direct/$s" --metrics-out "$WORK/direct/$s.jsonl" >/dev/null
done
t1=$(now)
"$STUDY" run "$WORK/tiny.yaml" --out "$WORK/tiny" >/dev/null; t2=$(now)
direct_s=$(secs "$t0" "$t1"); driver_s=$(secs "$t1" "$t2")

python3 - <<PY
plan, start, report, cat_s, direct, driver = $plan_s, $start_s, $report_s, $cat_s, $direct_s, $driver_s
gb = $bytes / 1e9
print("| measure | cpd-study | baseline (same run) | ratio | target |")
print("|---|---|---|---|---|")
print(f"| plan, $plan_runs runs | {plan:.3f} s | process start {start:.3f} s | {plan / start:.1f}x | < 1 s |")
print(f"| report, $rows runs, {gb:.2f} GB | {report:.2f} s ({gb / report:.2f} GB/s) | cat {cat_s:.2f} s ({gb / cat_s:.2f} GB/s) | {report / cat_s:.1f}x | < 30 s |")
print(f"| run, $N tiny runs | {driver:.2f} s | shell loop {direct:.2f} s | {driver / direct:.2f}x | < 1 s per run |")
print(f"| driver's cost per run | {(driver - direct) / $N:.3f} s | | | < 1 s |")
PY
