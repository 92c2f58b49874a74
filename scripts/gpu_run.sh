#!/usr/bin/env bash
# Runs the GPU bundle that scripts/gpu_bundle.sh packed, on a machine that has CUDA and NVIDIA's
# libraries but none of CPD's Debian packages (the lent GPU machine), or here as a dry run.
#   bash scripts/gpu_run.sh env          the GPU, the libraries found, each executable's needs
#   bash scripts/gpu_run.sh test         every test in the bundle (CUDA ones and CPU ones)
#   bash scripts/gpu_run.sh cuda-tests   the CUDA tests only
#   bash scripts/gpu_run.sh bench        bench_quantize_cuda, the GPU table of
#                                        benchmarks/bench_train_vs_torch.sh (lenet5, resnet20)
#   bash scripts/gpu_run.sh train        cpd-train LeNet-5, Fashion-MNIST, 10 epochs, on cuda and
#                                        on cpu (EPOCHS to change), accuracies and images/s
#   bash scripts/gpu_run.sh all          env, test, bench, train
#   bash scripts/gpu_run.sh exec CMD...  CMD with the bundle's environment (bin/ first on PATH)
# Environment: BUNDLE_DIR (.gpu), CPD_GPU_HOME (where it unpacks; /tmp/cpd-gpu), OUT (logs;
# $CPD_GPU_HOME/out when unset), TORCH_PYTHON (a python whose torch has CUDA; found otherwise).
# NVIDIA's libraries: the nvidia/*/lib folders of that python's site-packages (PyTorch's pip
# packages), then /usr/local/cuda/lib64. Exit status: non-zero when a test failed or a library
# is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
BUNDLE_DIR=${BUNDLE_DIR:-.gpu}
HOME_DIR=${CPD_GPU_HOME:-/tmp/cpd-gpu}
OUT=${OUT:-$HOME_DIR/out}
mkdir -p "$OUT"

die() { echo "gpu_run: $*" >&2; exit 1; }

unpack() {
  local payload=$BUNDLE_DIR/payload.tar.xz
  [ -f "$payload" ] || die "no bundle at $payload (build it here: scripts/gpu_bundle.sh)"
  local stamp
  stamp=$(stat -c %Y-%s "$payload")
  if [ "$(cat "$HOME_DIR/.stamp" 2>/dev/null)" != "$stamp" ]; then
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
  echo "  torch python: ${TORCH_PY:-none}"
  echo "# libraries (LD_LIBRARY_PATH)"
  tr ':' '\n' <<<"$LD_LIBRARY_PATH" | sed 's/^/  /'
  echo "# resolved by cpd-train and nccl_communicator_test"
  { ldd "$HOME_DIR/bin/cpd-train"; ldd "$HOME_DIR/bin/nccl_communicator_test"; } |
    grep -E '=>.*(cudart|cublas|cudnn|nccl|gomp)' | sed 's/ (0x.*//; s/^\s*/  /' | sort -u
  echo "# executables whose libraries are missing"
  if check_libraries; then echo "  none"; else return 1; fi
}

# Runs the named test executables; one line each (passed, skipped, failed, seconds) and a total.
run_tests() {
  local log=$OUT/tests.log summary=$OUT/tests_summary.txt failed_any=0
  : >"$log"
  {
    printf "%-28s %7s %8s %7s %8s\n" executable passed skipped failed seconds
  } | tee "$summary"
  local tp=0 ts=0 tf=0 t
  for t in "$@"; do
    local start end rc out
    start=$(date +%s.%N)
    set +e
    out=$(cd "$HOME_DIR" && "$HOME_DIR/bin/$t" --gtest_color=no 2>&1)
    rc=$?
    set -e
    end=$(date +%s.%N)
    { echo "===== $t (exit $rc)"; echo "$out"; } >>"$log"
    # One line per finished test, each ending in its time: "[  SKIPPED ] Suite.Name (0 ms)".
    local p s f
    p=$(grep -cE '^\[       OK \] .* \([0-9]+ ms\)$' <<<"$out" || true)
    s=$(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' <<<"$out" || true)
    f=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' <<<"$out" || true)
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi  # a crash or a failing set-up
    [ "$f" -gt 0 ] && failed_any=1
    tp=$((tp + p)); ts=$((ts + s)); tf=$((tf + f))
    printf "%-28s %7d %8d %7d %8.1f\n" "$t" "$p" "$s" "$f" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b - a}')" |
      tee -a "$summary"
  done
  printf "%-28s %7d %8d %7d\n" total "$tp" "$ts" "$tf" | tee -a "$summary"
  [ "$failed_any" -eq 0 ] || { echo "gpu_run: failures: see $log" >&2; return 1; }
}

cmd_bench() {
  {
    echo "# bench_quantize_cuda (64 MiB; ratio to the device-to-device copy)"
    "$HOME_DIR/bin/bench_quantize_cuda"
    echo
    DEVICES=cuda BUILD_DIR=$HOME_DIR TORCH_PYTHON=${TORCH_PY:-} TORCH_INSTALL=0 \
      THREADS=$(nproc) bash "$REPO/benchmarks/bench_train_vs_torch.sh" lenet5 resnet20
  } 2>&1 | tee "$OUT/bench.txt"
}

cmd_train() {
  local epochs=${EPOCHS:-10} device
  for device in cuda cpu; do
    echo "# cpd-train --device $device, LeNet-5, Fashion-MNIST, $epochs epochs"
    "$HOME_DIR/bin/cpd-train" --device "$device" --arch lenet5 --dataset fashion-mnist \
      --data-dir "$HOME_DIR/data/fashion-mnist" --epochs "$epochs" --no-progress \
      --threads "$(nproc)" --metrics-out "$OUT/train_$device.jsonl" 2>&1 |
      tee "$OUT/train_$device.log"
  done
}

action=${1:-all}
[ $# -gt 0 ] && shift
setup_env
case $action in
  env) cmd_env ;;
  test) run_tests $(cat "$HOME_DIR/cuda_tests" "$HOME_DIR/cpu_tests") ;;
  cuda-tests) run_tests $(cat "$HOME_DIR/cuda_tests") ;;
  bench) cmd_bench ;;
  train) cmd_train ;;
  all)
    status=0
    cmd_env | tee "$OUT/env.txt" || status=1
    run_tests $(cat "$HOME_DIR/cuda_tests" "$HOME_DIR/cpu_tests") || status=1
    cmd_bench || status=1
    cmd_train || status=1
    exit $status
    ;;
  exec) [ $# -gt 0 ] || die "exec needs a command"; exec "$@" ;;
  *) die "unknown action '$action' (accepted: env, test, cuda-tests, bench, train, all, exec)" ;;
esac
