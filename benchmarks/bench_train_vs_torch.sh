#!/usr/bin/env bash
# Side by side, in one run: CPD's training step (bench_train_step) and PyTorch's (torch_step.py)
# for the same model, batch and thread count. Prints the ratios the issue targets: CPD fp32 /
# PyTorch fp32 (<= 1.0) and CPD quantised / CPD fp32 (<= 1.25).
#   benchmarks/bench_train_vs_torch.sh [ARCH ...]      default: lenet5 resnet20
#   (ARCH: lenet5, mlp or a CIFAR ResNet resnet<6n+2> such as resnet20, resnet56; the GPU
#   machine's table, scripts/gpu_run.sh bench, is lenet5 resnet20 resnet56; gpt and lstm,
#   cpd-train's default language models, with AdamW, on LM_BATCH windows of BLOCK tokens)
# Environment: THREADS (2), BATCH (128), LM_BATCH (16), BLOCK (256), STEPS (30; resnet uses
#   STEPS/3 on the CPU, gpt and lstm STEPS/5),
#   DEVICES ("cpu cuda"): which tables to print. The CPU table compares with Debian's
#   python3-torch (installed when missing). The GPU table (bench_train_step --device cuda against
#   torch_step.py --device cuda) needs a GPU and a PyTorch built with CUDA: TORCH_PYTHON, else
#   /usr/bin/python3 or python3 if their torch sees the GPU, else a venv in $BUILD_DIR/torch-venv
#   (pip install torch, when the network allows; TORCH_INSTALL=0 forbids it). Whatever is missing
#   is reported on a line starting with "SKIP:" and the script goes on (exit 0).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
BIN=$BUILD_DIR/bin
THREADS=${THREADS:-2}
BATCH=${BATCH:-128}
STEPS=${STEPS:-30}
LM_BATCH=${LM_BATCH:-16}
BLOCK=${BLOCK:-256}
DEVICES=${DEVICES:-"cpu cuda"}

[ -x "$BIN/bench_train_step" ] || { echo "build first: scripts/build.sh" >&2; exit 2; }

archs=("$@")
[ ${#archs[@]} -eq 0 ] && archs=(lenet5 resnet20)

header() {
  printf "%-10s %-9s %6s %7s %12s %12s %10s\n" arch config batch threads "cpd ms/step" \
    "torch ms/st" ratio
}

# table DEVICE TORCH_PYTHON STEPS_FOR_RESNET_DIVISOR: one block of rows per arch.
table() {
  local device=$1 py=$2 resnet_div=$3
  for arch in "${archs[@]}"; do
    local steps=$STEPS batch=$BATCH lm=()
    [[ $arch == resnet* ]] && steps=$(( STEPS / resnet_div > 5 ? STEPS / resnet_div : 5 ))
    if [[ $arch == gpt || $arch == lstm ]]; then
      batch=$LM_BATCH
      lm=(--block-size "$BLOCK")
      [ "$device" = cpu ] && steps=$(( STEPS / 5 > 3 ? STEPS / 5 : 3 ))
    fi
    local torch_ms="-"
    if [ -n "$py" ]; then
      torch_ms=$("$py" benchmarks/torch_step.py --arch "$arch" --batch "$batch" "${lm[@]}" \
        --threads "$THREADS" --steps "$steps" --device "$device" | awk '{print $5}')
    fi
    local fp32_ms=""
    while read -r _ a config b t ms; do
      if [ "$config" = fp32 ]; then
        fp32_ms=$ms
        local ratio="-"
        [ "$torch_ms" != "-" ] && ratio=$(awk -v x="$ms" -v y="$torch_ms" \
          'BEGIN{printf "%.3f x torch", x/y}')
        printf "%-10s %-9s %6s %7s %12.3f %12s %10s\n" "$a" "$config" "$b" "$t" "$ms" \
          "$torch_ms" "$ratio"
      else
        printf "%-10s %-9s %6s %7s %12.3f %12s %10s\n" "$a" "$config" "$b" "$t" "$ms" "-" \
          "$(awk -v x="$ms" -v y="$fp32_ms" 'BEGIN{printf "%.3f x fp32", x/y}')"
      fi
    done < <("$BIN/bench_train_step" --arch "$arch" --batch "$batch" "${lm[@]}" \
               --threads "$THREADS" --steps "$steps" --device "$device" $(lm_configs "$arch"))
  done
}

# The language models' quantised rows are the issue's: CPT at 8/8 bits and FP134 A+E.
lm_configs() {
  [[ $1 == gpt || $1 == lstm ]] && echo "--configs fp32,cpt8,fp134ae"
  return 0
}

# A python whose torch sees a GPU, or nothing.
find_cuda_torch() {
  local cands=()
  [ -n "${TORCH_PYTHON:-}" ] && cands+=("$TORCH_PYTHON")
  cands+=(/usr/bin/python3 python3 "$BUILD_DIR/torch-venv/bin/python")
  for py in "${cands[@]}"; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
         >/dev/null 2>&1; then
      echo "$py"
      return
    fi
  done
}

for device in $DEVICES; do
  case $device in
    cpu)
      if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
        echo "bench_train_vs_torch: installing python3-torch (Debian) for the reference"
        SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
          python3-torch >/dev/null
      fi
      echo "# CPU: CPD vs PyTorch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)')"
      header
      table cpu /usr/bin/python3 3
      ;;
    cuda)
      probe=$("$BIN/bench_train_step" --device cuda --arch mlp --batch 2 --steps 1 --warmup 0 \
                --configs fp32 2>&1 || true)
      if [[ $probe == SKIP:* || $probe != cpd-cuda* ]]; then
        echo "SKIP: GPU table: ${probe#SKIP: }"
        continue
      fi
      py=$(find_cuda_torch)
      if [ -z "$py" ] && [ "${TORCH_INSTALL:-1}" != 0 ]; then
        echo "bench_train_vs_torch: no PyTorch with CUDA found; trying pip install torch into" \
          "$BUILD_DIR/torch-venv"
        if python3 -m venv "$BUILD_DIR/torch-venv" >/dev/null 2>&1 &&
           "$BUILD_DIR/torch-venv/bin/pip" install --quiet --timeout 20 --retries 1 torch; then
          py=$(find_cuda_torch)
        fi
      fi
      if [ -z "$py" ]; then
        echo "SKIP: PyTorch on the GPU: no python3 whose torch sees the GPU (set TORCH_PYTHON," \
          "or allow pip install torch); CPD's GPU times follow without a ratio"
      fi
      echo "# GPU: CPD --device cuda vs PyTorch ${py:+$("$py" -c \
        'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')} (float32, no TF32)"
      header
      table cuda "$py" 1
      ;;
    *)
      echo "bench_train_vs_torch: DEVICES may hold cpu and cuda, not '$device'" >&2
      exit 2
      ;;
  esac
done
