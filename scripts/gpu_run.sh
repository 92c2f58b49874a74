#!/usr/bin/env bash
# Runs the GPU bundle that scripts/gpu_bundle.sh packed, on a machine that has CUDA and NVIDIA's
# libraries but none of CPD's Debian packages (the lent GPU machine), or here as a dry run.
#   bash scripts/gpu_run.sh all          everything below, in this order, then the summary table
#                                        (also $OUT/summary.txt): one command for a lent machine
#   bash scripts/gpu_run.sh env          the GPU, the libraries found, each executable's needs
#   bash scripts/gpu_run.sh test         every test in the bundle (CUDA ones and CPU ones)
#   bash scripts/gpu_run.sh cuda-tests   the CUDA tests only
#   bash scripts/gpu_run.sh mpi          under the machine's mpirun, ranks sharing the one GPU:
#                                        gradient_allreduce_cuda_test at -np 2 and 4,
#                                        gradient_allreduce_test at -np 2, cpd-allreduce-bench
#                                        --device cuda at -np 2 and 4 (64 MiB, packed e4m3 + APS
#                                        against the staged fp32 all-reduce), cpd-train --device
#                                        cuda on 2 ranks (LeNet-5, 1 epoch, fp32 and packed e4m3)
#   bash scripts/gpu_run.sh bench        bench_quantize_cuda, the GPU table of
#                                        benchmarks/bench_train_vs_torch.sh (lenet5, resnet20,
#                                        resnet56)
#   bash scripts/gpu_run.sh train        cpd-train LeNet-5, Fashion-MNIST, EPOCHS (2) epochs, on
#                                        cuda and on cpu, accuracies and images/s
#   bash scripts/gpu_run.sh summary      the summary table of what $OUT holds
#   bash scripts/gpu_run.sh exec CMD...  CMD with the bundle's environment (bin/ first on PATH)
#
# The budget of `all`: at most about 7 minutes on the lent machine, so that a rerun still fits in
# its 15 minutes of device time; expected about 5. From the first run (H200, 2026-11-27) and the
# dry run here: unpacking and env ~10 s; the CUDA tests ~100 s (94 s in the first run, each
# executable 6-28 s); the CPU tests ~30 s on 16 cores (the dry run's 2 cores: 37 s idle, 170 s
# busy, most of it trainer_test); mpi ~90 s (gradient_allreduce_cuda_test at 2 and 4 ranks, ~15 and ~25 s against
# 11 s for one; gradient_allreduce_test ~10 s; cpd-allreduce-bench ~10 s per world size; two
# 1-epoch trainings ~8 s each); bench ~60 s (bench_quantize_cuda ~5 s; per model a PyTorch
# start-up of ~8 s and CPD's 4 configurations x 35 steps, at most 35 ms a step); train ~20 s
# (2 epochs on each device: 1.2 ms a step on the GPU). About 310 s in all.
# Each executable runs under its own `timeout` (limits below: about 3x its first-run time, at
# least 30 s); a timeout counts as a failure and says so on one line. `all` also stops starting
# new steps once ALL_BUDGET_S (480) seconds have passed (each is then reported as a SKIP) and
# cuts every limit to what is left of that budget, so that a hang costs at most about 8 minutes.
#
# Environment: BUNDLE_DIR (.gpu), CPD_GPU_HOME (where it unpacks; /tmp/cpd-gpu), OUT (logs;
# $CPD_GPU_HOME/out when unset), TORCH_PYTHON (a python whose torch has CUDA; found otherwise),
# EPOCHS (2, for train), STEPS (30, for bench), ALL_BUDGET_S (480).
# NVIDIA's libraries: the nvidia/*/lib folders of that python's site-packages (PyTorch's pip
# packages), then /usr/local/cuda/lib64. MPI: the machine's own mpirun and libmpi.so.40 (Open MPI
# 4.1), single node: shared memory only (ob1/vader, no single-copy mechanism, which containers
# often forbid), unless OMPI_MCA_* says otherwise. Exit status: non-zero when a test failed or
# timed out, a step failed, or a library is missing; 2 (and one line) for a bad argument.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
BUNDLE_DIR=${BUNDLE_DIR:-.gpu}
HOME_DIR=${CPD_GPU_HOME:-/tmp/cpd-gpu}
OUT=${OUT:-$HOME_DIR/out}
EPOCHS=${EPOCHS:-2}
STEPS=${STEPS:-30}
ALL_BUDGET_S=${ALL_BUDGET_S:-480}
DEADLINE=""  # seconds since start (bash's SECONDS) after which `all` starts nothing new

die() { echo "gpu_run: $*" >&2; exit 2; }
for v in EPOCHS STEPS ALL_BUDGET_S; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer, not '${!v}'"
done
mkdir -p "$OUT"
RESULTS=$OUT/results.tsv  # one row per test executable run: name pass skip fail secs note

# Per-executable limits in seconds: about 3x the first run's time on an H200, at least 30.
test_limit() {
  case $1 in
    quantize_cuda_test) echo 45 ;;          # 11 s in the first run
    codec_cuda_test) echo 60 ;;             # 17 s
    reduce_kernels_cuda_test) echo 30 ;;    # 9 s
    layers_cuda_test) echo 30 ;;            # 6 s
    transformer_layers_cuda_test) echo 60 ;;  # not run on a GPU yet (small shapes: seconds)
    train_cuda_test) echo 120 ;;            # 28 s, before the language models' 4 x 60 steps
    cpd_train_cuda_test) echo 30 ;;         # 6 s
    nccl_communicator_test) echo 30 ;;      # 6 s
    gradient_allreduce_cuda_test) echo 45 ;;  # 11 s
    # CPU tests: about 3x their time in the dry run on 2 busy cores (trainer_test 106 s, 15 s
    # when idle; cpd_train_cli_test 26 s, 12 s idle; the others 0-11 s), ample for 16 cores.
    trainer_test) echo 300 ;;
    cpd_train_cli_test) echo 90 ;;
    *) echo 60 ;;
  esac
}

unpack() {
  local payload=$BUNDLE_DIR/payload.tar.xz
  [ -f "$payload" ] || die "no bundle at $payload (build it here: scripts/gpu_bundle.sh)"
  local stamp
  stamp=$(stat -c %Y-%s "$payload")
  if [ "$(cat "$HOME_DIR/.stamp" 2>/dev/null)" != "$stamp" ]; then
    echo "gpu_run: unpacking $payload into $HOME_DIR"
    rm -rf "$HOME_DIR/bin" "$HOME_DIR/lib" "$HOME_DIR/data"
    mkdir -p "$HOME_DIR"
    xz -dc "$payload" | tar -C "$HOME_DIR" -xf -
    echo "$stamp" >"$HOME_DIR/.stamp"
  fi
}

# A python whose torch was built with CUDA, else any python3 (for its site-packages).
torch_python() {
  local py
  for py in ${TORCH_PYTHON:-} /opt/torch/.venv/bin/python3 python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
      echo "$py"
      return
    fi
  done
}

nvidia_lib_dirs() {
  local py=$1 site
  if [ -n "$py" ]; then
    for site in $("$py" -c 'import site; print(" ".join(site.getsitepackages()))'); do
      [ -d "$site/nvidia" ] && find "$site/nvidia" -name 'lib*.so*' -printf '%h\n'
    done | sort -u
  fi
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && echo "$d"
  done
}

setup_env() {
  unpack
  TORCH_PY=$(torch_python)
  local dirs
  dirs=$(nvidia_lib_dirs "$TORCH_PY" | paste -sd: -)
  export LD_LIBRARY_PATH="$HOME_DIR/lib${dirs:+:$dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PATH="$HOME_DIR/bin:$PATH"
  export CPD_BIN_DIR="$HOME_DIR/bin"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
  # Open MPI, one node: shared memory between the ranks, nothing that a container may forbid.
  # Root may start ranks (the lent machine runs as root); a singleton MPI_Init needs this too.
  export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
  export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader}
  export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
  if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  # Whether CPD sees a usable GPU (its own check, as the benchmarks make it): "" or the reason.
  local probe
  probe=$("$HOME_DIR/bin/bench_train_step" --device cuda --arch mlp --batch 2 --steps 1 \
            --warmup 0 --configs fp32 2>&1 || true)
  if [[ $probe == cpd-cuda* ]]; then
    NO_GPU=""
  else
    NO_GPU=${probe#SKIP: bench_train_step --device cuda: }
    NO_GPU=${NO_GPU:-no answer from bench_train_step --device cuda}
  fi
}

# True (0) when `all`'s time is spent: the step named by $1 is then reported as skipped.
over_budget() {
  if [ -n "$DEADLINE" ] && [ "$SECONDS" -ge "$DEADLINE" ]; then
    echo "SKIP: $1: the budget of 'all' (ALL_BUDGET_S=$ALL_BUDGET_S s) is spent"
    touch "$OUT/budget_spent"  # a file: bench_body runs in a pipeline's subshell
    return 0
  fi
  return 1
}

# within LIMIT: LIMIT seconds, or what is left of `all`'s budget when less (at least 10), so that
# a step started near the end cannot run far past it.
within() {
  local limit=$1
  if [ -n "$DEADLINE" ] && [ $((DEADLINE - SECONDS)) -lt "$limit" ]; then
    limit=$((DEADLINE - SECONDS > 10 ? DEADLINE - SECONDS : 10))
  fi
  echo "$limit"
}

check_libraries() {
  local missing=0 f
  for f in "$HOME_DIR"/bin/*; do
    if ldd "$f" | grep -q "not found"; then
      echo "  $(basename "$f"): $(ldd "$f" | awk '/not found/ {print $1}' | paste -sd' ' -)"
      missing=1
    fi
  done
  return $missing
}

cmd_env() {
  echo "# bundle"
  sed 's/^/  /' "$BUNDLE_DIR/MANIFEST"
  echo "# machine"
  echo "  $(uname -srm), $(nproc) cores"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
      --format=csv,noheader | sed 's/^/  gpu: /'
  else
    echo "  gpu: none (no nvidia-smi)"
  fi
  echo "  CPD's view: ${NO_GPU:-a usable GPU}"
  echo "  torch python: ${TORCH_PY:-none}"
  if command -v mpirun >/dev/null 2>&1; then
    echo "  mpirun: $(command -v mpirun), $(mpirun --version 2>&1 | head -1)"
  else
    echo "  mpirun: none"
  fi
  echo "# libraries (LD_LIBRARY_PATH)"
  tr ':' '\n' <<<"$LD_LIBRARY_PATH" | sed 's/^/  /'
  echo "# resolved by cpd-train and nccl_communicator_test"
  { ldd "$HOME_DIR/bin/cpd-train"; ldd "$HOME_DIR/bin/nccl_communicator_test"; } |
    grep -E '=>.*(cudart|cublas|cudnn|nccl|gomp|libmpi)' | sed 's/ (0x.*//; s/^\s*/  /' | sort -u
  echo "# executables whose libraries are missing"
  if check_libraries; then echo "  none"; else return 1; fi
}

# run_one NAME LIMIT CMD...: runs CMD (a gtest executable, possibly under mpirun) with the limit,
# appends its output to $OUT/tests.log and one row to $RESULTS, prints the row. Returns 1 when a
# test failed, the run crashed or timed out.
run_one() {
  local name=$1 limit=$2 start end rc out secs note=""
  shift 2
  if over_budget "$name"; then
    printf "%s\t0\t0\t0\t0\tnot run (budget)\n" "$name" >>"$RESULTS"
    return 0
  fi
  limit=$(within "$limit")
  start=$(date +%s.%N)
  set +e
  out=$(cd "$HOME_DIR" && timeout -k 10 "$limit" "$@" --gtest_color=no 2>&1)
  rc=$?
  set -e
  end=$(date +%s.%N)
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b - a}')
  { echo "===== $name (exit $rc, ${secs} s, limit ${limit} s)"; echo "$out"; } >>"$OUT/tests.log"
  # One line per finished test, each ending in its time: "[  SKIPPED ] Suite.Name (0 ms)".
  local p s f
  p=$(grep -cE '^\[       OK \] .* \([0-9]+ ms\)$' <<<"$out" || true)
  s=$(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' <<<"$out" || true)
  f=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' <<<"$out" || true)
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note="TIMEOUT after ${limit} s"
    echo "gpu_run: TIMEOUT: $name ran past its ${limit} s limit; counted as a failure" >&2
    f=$((f + 1))
  elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    note="exit $rc"  # a crash or a failing set-up
    f=1
  fi
  printf "%s\t%d\t%d\t%d\t%s\t%s\n" "$name" "$p" "$s" "$f" "$secs" "$note" >>"$RESULTS"
  printf "%-36s %7d %8d %7d %8s  %s\n" "$name" "$p" "$s" "$f" "$secs" "$note"
  [ "$f" -eq 0 ]
}

tests_header() {
  printf "%-36s %7s %8s %7s %8s\n" executable passed skipped failed seconds
}

# Runs the named test executables, each under its own limit, one line each.
run_tests() {
  local failed_any=0 t
  tests_header
  for t in "$@"; do
    run_one "$t" "$(test_limit "$t")" "$HOME_DIR/bin/$t" || failed_any=1
  done
  [ "$failed_any" -eq 0 ] || { echo "gpu_run: failures: see $OUT/tests.log" >&2; return 1; }
}

# mpirun NP [VAR=VALUE...]: the command that starts NP ranks with the bundle's environment
# (and VAR=VALUE), sharing the node's cores and its GPU; the program and its arguments follow.
mpi_cmd() {
  local np=$1 kv
  shift
  MPI_CMD=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np"
           -x LD_LIBRARY_PATH -x PATH -x CPD_BIN_DIR -x OMPI_MCA_pml -x OMPI_MCA_btl
           -x OMPI_MCA_btl_vader_single_copy_mechanism)
  for kv in "$@"; do MPI_CMD+=(-x "$kv"); done
}

# Cores per rank when NP ranks share the node.
per_rank() { local n=$(( $(nproc) / $1 )); echo $(( n > 0 ? n : 1 )); }

cmd_mpi() {
  local status=0
  if ! command -v mpirun >/dev/null 2>&1; then
    echo "SKIP: mpi: no mpirun on this machine (Open MPI 4.1 with libmpi.so.40 is needed)"
    return 0
  fi
  echo "# under $(command -v mpirun) ($(mpirun --version 2>&1 | head -1)), ranks sharing the GPU"
  tests_header
  # The device all-reduce against the host reducer, bit for bit (each test skips without a GPU).
  local np
  for np in 2 4; do
    mpi_cmd "$np" "OMP_NUM_THREADS=$(per_rank "$np")"
    run_one "gradient_allreduce_cuda_test -np $np" $((30 + 30 * np)) \
      "${MPI_CMD[@]}" "$HOME_DIR/bin/gradient_allreduce_cuda_test" || status=1
  done
  # The bundle's MPI suites (gradient_allreduce_test: the host all-reduce, the device one's
  # reference) on this machine's Open MPI, one thread per rank as ctest runs them.
  local t
  mpi_cmd 2 OMP_NUM_THREADS=1
  for t in $(cat "$HOME_DIR/mpi_tests"); do
    run_one "$t -np 2" 120 "${MPI_CMD[@]}" "$HOME_DIR/bin/$t" || status=1
  done
  # The device all-reduce's speed (issue 15's target): packed e4m3 + APS against the float32
  # all-reduce staged through the host, on the same 64 MiB, 2 and 4 ranks sharing the GPU.
  : >"$OUT/allreduce_bench.txt"
  for np in 2 4; do
    local bench=(cpd-allreduce-bench --device cuda -b 64M -e 64M --algos fp32,packed
                 --formats e4m3 --aps on)
    echo "# mpirun -np $np ${bench[*]}" | tee -a "$OUT/allreduce_bench.txt"
    over_budget "cpd-allreduce-bench -np $np" && continue
    mpi_cmd "$np"
    local limit
    limit=$(within 90)
    timeout -k 10 "$limit" "${MPI_CMD[@]}" "$HOME_DIR/bin/${bench[0]}" "${bench[@]:1}" 2>&1 |
      tee -a "$OUT/allreduce_bench.txt" || {
      echo "gpu_run: cpd-allreduce-bench -np $np failed or ran past its $limit s limit" |
        tee -a "$OUT/allreduce_bench.txt" >&2
      status=1
    }
  done
  # Data-parallel training on the GPU, 2 ranks sharing it (the gradients stay in device memory;
  # staged MPI carries them): fp32, then packed e4m3 codes with APS.
  local threads name args
  threads=$(per_rank 2)
  mpi_cmd 2 "OMP_NUM_THREADS=$threads"
  for name in fp32 packed-e4m3-aps; do
    args=(--allreduce fp32)
    [ "$name" = packed-e4m3-aps ] && args=(--allreduce packed --allreduce-format e4m3 --aps)
    local log=$OUT/train_mpi2_$name.log
    echo "# cpd-train --device cuda, 2 ranks (mpirun -np 2), LeNet-5, Fashion-MNIST, 1 epoch," \
      "global batch 128, all-reduce $name"
    if [ -n "$NO_GPU" ]; then
      echo "SKIP: cpd-train --device cuda on 2 ranks: $NO_GPU" | tee "$log"
      continue
    fi
    over_budget "cpd-train on 2 ranks ($name)" && { echo "SKIP: budget" >"$log"; continue; }
    local limit
    limit=$(within 180)
    set +e
    timeout -k 10 "$limit" "${MPI_CMD[@]}" "$HOME_DIR/bin/cpd-train" --device cuda \
      --arch lenet5 --dataset fashion-mnist --data-dir "$HOME_DIR/data/fashion-mnist" \
      --epochs 1 --global-batch 128 --threads "$threads" --no-progress "${args[@]}" \
      --metrics-out "$OUT/train_mpi2_$name.jsonl" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "gpu_run: TIMEOUT: cpd-train on 2 ranks ($name) ran past its $limit s limit" |
        tee -a "$log" >&2
      status=1
    elif [ "$rc" -ne 0 ]; then
      echo "gpu_run: cpd-train on 2 ranks ($name) exited $rc" | tee -a "$log" >&2
      status=1
    fi
  done
  return $status
}

cmd_bench() {
  bench_body 2>&1 | tee "$OUT/bench.txt"
  return "${PIPESTATUS[0]}"
}

bench_body() {
  local status=0
  echo "# bench_quantize_cuda (64 MiB; ratio to the device-to-device copy)"
    if over_budget bench_quantize_cuda; then
      :
    else
      local limit
      limit=$(within 120)
      timeout -k 10 "$limit" "$HOME_DIR/bin/bench_quantize_cuda" || {
        echo "gpu_run: bench_quantize_cuda failed or ran past its $limit s limit (exit $?)"
        status=1
      }
    fi
    echo
    echo "# benchmarks/bench_train_vs_torch.sh lenet5 resnet20 resnet56 (DEVICES=cuda, STEPS=$STEPS)"
    if over_budget bench_train_vs_torch.sh; then
      :
    else
      local limit
      limit=$(within 300)
      DEVICES=cuda BUILD_DIR=$HOME_DIR TORCH_PYTHON=${TORCH_PY:-} TORCH_INSTALL=0 STEPS=$STEPS \
        THREADS=$(nproc) timeout -k 10 "$limit" bash "$REPO/benchmarks/bench_train_vs_torch.sh" \
        lenet5 resnet20 resnet56 || {
        echo "gpu_run: bench_train_vs_torch.sh failed or ran past its $limit s limit (exit $?)"
        status=1
      }
    fi
  return $status
}

cmd_train() {
  local device status=0
  for device in cuda cpu; do
    local log=$OUT/train_$device.log
    echo "# cpd-train --device $device, LeNet-5, Fashion-MNIST, $EPOCHS epochs"
    if [ "$device" = cuda ] && [ -n "$NO_GPU" ]; then
      echo "SKIP: cpd-train --device cuda: $NO_GPU" | tee "$log"
      continue
    fi
    over_budget "cpd-train --device $device" && { echo "SKIP: budget" >"$log"; continue; }
    local limit
    limit=$(within $((60 + 60 * EPOCHS)))
    set +e
    timeout -k 10 "$limit" "$HOME_DIR/bin/cpd-train" --device "$device" \
      --arch lenet5 --dataset fashion-mnist --data-dir "$HOME_DIR/data/fashion-mnist" \
      --epochs "$EPOCHS" --no-progress --threads "$(nproc)" \
      --metrics-out "$OUT/train_$device.jsonl" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "gpu_run: TIMEOUT: cpd-train --device $device ran past its $limit s limit" |
        tee -a "$log" >&2
      status=1
    elif [ "$rc" -ne 0 ]; then
      echo "gpu_run: cpd-train --device $device exited $rc" | tee -a "$log" >&2
      status=1
    fi
  done
  return $status
}

# The summary of what $OUT holds: tests, benchmark ratios against the issue's targets, training.
cmd_summary() {
  echo "# summary: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(sed -n 's/^built .* from /bundle of /p' \
    "$BUNDLE_DIR/MANIFEST"), GPU: $(if [ -n "$NO_GPU" ]; then echo "none ($NO_GPU)"; else
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1; fi)"
  echo "## tests"
  tests_header
  if [ -s "$RESULTS" ]; then
    awk -F'\t' '{printf "%-36s %7d %8d %7d %8s  %s\n", $1, $2, $3, $4, $5, $6;
                 p += $2; s += $3; f += $4}
                END {printf "%-36s %7d %8d %7d\n", "total", p, s, f}' "$RESULTS"
  else
    echo "(no test ran)"
  fi
  echo "## bench (vs copy: GB/s against cudaMemcpy D2D in the same run; step: ms against PyTorch or CPD fp32)"
  if [ -f "$OUT/bench.txt" ] && grep -q '^memcpy ' "$OUT/bench.txt"; then
    awk '
      function add(g, v) { if (!(g in lo) || v < lo[g]) lo[g] = v; if (!(g in hi) || v > hi[g]) hi[g] = v }
      $1 ~ /^(e4m3|e5m2|bf16|fp16|e2m1)$/ && $2 == "stochastic" { add("sto", $NF) }
      $1 ~ /^(fp134|int8)$/ && $2 == "nearest" { add("two", $NF) }
      $1 ~ /^mx/ && $2 == "nearest" { add("mx", $NF) }
      $1 == "enc" && $3 == "nearest" { add("enc", $NF) }
      $1 == "dec" { add("dec", $NF) }
      function row(g, what, target, cmp, bound) {
        if (!(g in lo)) { printf "%-44s %18s  target %s\n", what, "-", target; return }
        r = (lo[g] == hi[g]) ? sprintf("%.3f", lo[g]) : sprintf("%.3f-%.3f", lo[g], hi[g])
        ok = (cmp == ">=") ? (lo[g] >= bound) : (hi[g] <= bound)
        printf "%-44s %18s  target %-7s %s\n", what, r " x copy", target, ok ? "met" : "MISSED"
      }
      END {
        row("sto", "stochastic (e4m3 e5m2 bf16 fp16 e2m1)", ">= 0.7", ">=", 0.7)
        row("two", "two-pass scaled, nearest (fp134 int8)", ">= 0.6", ">=", 0.6)
        row("mx", "MX, nearest (mxfp8 mxfp4)", ">= 0.8", ">=", 0.8)
        row("enc", "encode nearest (e4m3 ... int8)", ">= 0.7", ">=", 0.7)
        row("dec", "decode (e4m3 ... int8)", ">= 0.7", ">=", 0.7)
      }' "$OUT/bench.txt"
  else
    echo "bench_quantize_cuda: $(grep -m1 -E '^(SKIP|gpu_run)' "$OUT/bench.txt" 2>/dev/null ||
      echo 'not run')"
  fi
  if [ -f "$OUT/bench.txt" ] && grep -qE '^(lenet5|resnet)' "$OUT/bench.txt"; then
    # Rows: arch config batch threads cpd-ms torch-ms ratio ("0.43 x torch", "1.2 x fp32", "-").
    awk '$1 ~ /^(lenet5|resnet[0-9]+)$/ && NF >= 7 {
           what = sprintf("step %s %s", $1, $2)
           if ($7 == "-") { printf "%-44s %15.3f ms  (no PyTorch)\n", what, $5; next }
           if ($2 == "fp32") {
             printf "%-44s %12.3f x torch  target <= 0.8  %-6s (%.3f vs %.3f ms)\n", what,
               $7, $7 <= 0.8 ? "met" : "MISSED", $5, $6
           } else if ($2 == "cpt8" || $2 == "lee2022") {
             printf "%-44s %13.3f x fp32  target <= 1.25 %-6s (%.3f ms)\n", what, $7,
               $7 <= 1.25 ? "met" : "MISSED", $5
           } else {
             printf "%-44s %13.3f x fp32  %-21s (%.3f ms)\n", what, $7, "", $5
           }
         }' "$OUT/bench.txt"
  else
    echo "step table: $(sed -n '/^# benchmarks\/bench_train_vs_torch.sh/,$p' "$OUT/bench.txt" \
      2>/dev/null | grep -m1 -E '^(SKIP|gpu_run)' || echo 'not run')"
  fi
  if [ -f "$OUT/allreduce_bench.txt" ]; then
    # Rows: size count format algo time algbw busbw fp32-busbw x_base relerr #wrong.
    awk 'function none() { if (np != "" && !said) printf "all-reduce -np %s: no result\n", np }
         /^# mpirun -np / { none(); np = $4; said = 0; next }
         /^(SKIP|gpu_run)/ { printf "all-reduce -np %s: %s\n", np, $0; said = 1; next }
         END { none() }
         $3 == "e4m3" && $4 == "packed" {
           said = 1
           printf "%-44s %11.3f x staged  target <= 1.0  %-6s (%.0f us, relerr %s)\n",
             "all-reduce -np " np " packed e4m3 + APS, 64M", $9, $9 <= 1.0 ? "met" : "MISSED", $5, $10
         }' "$OUT/allreduce_bench.txt"
  fi
  echo "## train (LeNet-5, Fashion-MNIST; the last epoch's line)"
  local f
  for f in "$OUT"/train_cuda.log "$OUT"/train_cpu.log "$OUT"/train_mpi2_*.log; do
    [ -f "$f" ] || continue
    local what
    what=$(basename "$f" .log)
    what=${what#train_}
    what=${what/mpi2_/cuda 2 ranks }
    local line
    line=$(awk '/^epoch [0-9]+\/[0-9]+ / { e = $0 } END { if (e == "") exit
             n = split(e, w, " ")
             for (i = 1; i <= n; ++i) { if (w[i] == "test") t = w[i+1]; if (w[i] == "img/s") r = w[i-1] }
             printf "epoch %s: test %s, %s img/s", w[2], t, r }' "$f")
    [ -n "$line" ] || line=$(grep -m1 -E '^(SKIP|gpu_run)|rror' "$f" || echo "no epoch line")
    printf "%-30s %s\n" "$what" "$line"
  done
}

action=${1:-all}
[ $# -gt 0 ] && shift
case $action in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
  env|test|cuda-tests|mpi|bench|train|summary|all|exec) ;;
  *) die "unknown action '$action' (accepted: env, test, cuda-tests, mpi, bench, train, summary, all, exec)" ;;
esac
[ "$action" = exec ] || [ $# -eq 0 ] || die "'$action' takes no arguments (got: $*)"
setup_env
case $action in
  env) cmd_env ;;
  test) : >"$RESULTS"; : >"$OUT/tests.log"; run_tests $(cat "$HOME_DIR/cuda_tests" "$HOME_DIR/cpu_tests") ;;
  cuda-tests) : >"$RESULTS"; : >"$OUT/tests.log"; run_tests $(cat "$HOME_DIR/cuda_tests") ;;
  mpi) : >"$RESULTS"; : >"$OUT/tests.log"; cmd_mpi ;;
  bench) cmd_bench ;;
  train) cmd_train ;;
  summary) cmd_summary | tee "$OUT/summary.txt" ;;
  all)
    DEADLINE=$((SECONDS + ALL_BUDGET_S))
    status=0
    : >"$RESULTS"; : >"$OUT/tests.log"
    rm -f "$OUT"/bench.txt "$OUT"/allreduce_bench.txt "$OUT"/train_*.log "$OUT"/train_*.jsonl \
      "$OUT/budget_spent"
    echo "gpu_run: [1/6] env"
    cmd_env | tee "$OUT/env.txt" || status=1
    echo "gpu_run: [2/6] tests, each under its own limit (about 130 s)"
    run_tests $(cat "$HOME_DIR/cuda_tests" "$HOME_DIR/cpu_tests") || status=1
    echo "gpu_run: [3/6] mpi (about 90 s)"
    cmd_mpi || status=1
    echo "gpu_run: [4/6] bench (about 60 s)"
    cmd_bench || status=1
    echo "gpu_run: [5/6] train, $EPOCHS epochs on each device (about 20 s)"
    cmd_train || status=1
    if [ -f "$OUT/budget_spent" ]; then
      echo "gpu_run: the budget of 'all' ran out (ALL_BUDGET_S=$ALL_BUDGET_S s): steps were" \
        "skipped (their SKIP lines above); counted as a failure" >&2
      status=1
    fi
    echo "gpu_run: [6/6] summary (after $SECONDS s; also $OUT/summary.txt)"
    echo
    { cmd_summary; echo "wall time of 'all': $SECONDS s; exit status $status"; } |
      tee "$OUT/summary.txt"
    exit $status
    ;;
  exec) [ $# -gt 0 ] || die "exec needs a command"; exec "$@" ;;
esac
