#!/usr/bin/env bash
# The gradient all-reduce between emulated hosts: MPI ranks one per network namespace, linked at
# a cluster's speed (scripts/netns_cluster.sh), so that the bytes on the wire cost what they cost
# between machines. For each link rate and world size: cpd-allreduce-bench at one size, its rows
# for MPI_Allreduce (fp32, the baseline of the same run), emulate and packed in e4m3 and e3m0.
#   benchmarks/allreduce_netns.sh [--rates "none 25gbit 10gbit 1gbit"] [--np "2 4"] [--size 64M]
#                                 [--iters 5] [--model] [--pipeline-kb K]
# --model adds the performance model's prediction of every mpi and packed row (comm/perf_model.h,
# parameters measured in the same run: ping-pong alpha/beta, the element loops' cost) and prints
# the parameters of each run as '#' lines. --pipeline-kb 0 measures the sequential schedule.
# Needs root (namespaces, tc). On a fresh machine it first installs the dependencies and builds
# (scripts/build.sh). Prints one table; removes the namespaces at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
RATES="none 25gbit 10gbit 1gbit"
NPS="2 4"
SIZE=64M
ITERS=5
MODEL=()
PIPELINE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rates) RATES=$2; shift 2 ;;
    --np) NPS=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --model) MODEL=(--model); shift ;;
    --pipeline-kb) PIPELINE=(--pipeline-kb "$2"); shift 2 ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    *) echo "allreduce_netns.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
BIN=${BUILD_DIR:-build}/bin
if [ ! -x "$BIN/cpd-allreduce-bench" ]; then
  echo "allreduce_netns.sh: no $BIN/cpd-allreduce-bench yet: installing dependencies and building" \
       "(scripts/build.sh, several minutes)" >&2
  bash scripts/build.sh >&2
fi
trap 'scripts/netns_cluster.sh down >/dev/null' EXIT
max_np=0
for np in $NPS; do [ "$np" -gt "$max_np" ] && max_np=$np; done
printf '# cpd-allreduce-bench between emulated hosts (one rank per network namespace, TCP), %s, median of %s\n' "$SIZE" "$ITERS"
if [ ${#MODEL[@]} -gt 0 ]; then
  printf '%8s %3s %6s %8s %11s %7s %8s %9s %7s %9s %7s\n' link np format algo 'time(ms)' x_mpi \
    relerr 'pp(ms)' 'err(%)' 'load(ms)' 'err(%)'
else
  printf '%8s %3s %6s %8s %11s %7s %8s\n' link np format algo 'time(ms)' x_mpi relerr
fi
for rate in $RATES; do
  scripts/netns_cluster.sh up "$max_np" "$rate" >/dev/null
  for np in $NPS; do
    out=$(scripts/netns_cluster.sh mpirun "$np" "$BIN/cpd-allreduce-bench" -b "$SIZE" -e "$SIZE" \
            --formats e4m3,e3m0 --iters "$ITERS" "${MODEL[@]}" "${PIPELINE[@]}" 2>&1) ||
      { echo "$out" >&2; exit 1; }
    # Data rows: size count format algo time algbw busbw fp32-busbw x_mpi relerr #wrong
    # [model err]; with --model the measured parameters too.
    echo "$out" | awk -v rate="$rate" -v np="$np" '
      /^# model/ { sub(/^# /, ""); printf "# %s np %s: %s\n", rate, np, $0 }
      $1 ~ /^[0-9]+[KMG]?$/ && NF >= 11 && $4 != "fp32" {
        if (NF >= 15 && $12 != "-") {
          printf "%8s %3s %6s %8s %11.1f %7.3f %8s %9.1f %7s %9.1f %7s\n", rate, np, $3, $4,
                 $5 / 1000, $9, $10, $12 / 1000, $13, $14 / 1000, $15
        } else if (NF >= 15) {
          printf "%8s %3s %6s %8s %11.1f %7.3f %8s %9s %7s %9s %7s\n", rate, np, $3, $4,
                 $5 / 1000, $9, $10, "-", "-", "-", "-"
        } else {
          printf "%8s %3s %6s %8s %11.1f %7.3f %8s\n", rate, np, $3, $4, $5 / 1000, $9, $10
        }
      }'
  done
done
