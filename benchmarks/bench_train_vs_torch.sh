#!/usr/bin/env bash
# Side by side, in one run: CPD's training step (bench_train_step) and PyTorch's (torch_step.py,
# Debian's python3-torch) for the same model, batch and thread count. Prints the ratios the
# issue targets: CPD fp32 / PyTorch fp32 (<= 1.0) and CPD quantised / CPD fp32 (<= 1.25).
#   benchmarks/bench_train_vs_torch.sh [ARCH ...]      default: lenet5 resnet20
# Environment: THREADS (2), BATCH (128), STEPS (30; resnet uses STEPS/3).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BUILD_DIR:-build}/bin
THREADS=${THREADS:-2}
BATCH=${BATCH:-128}
STEPS=${STEPS:-30}

if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  echo "bench_train_vs_torch: installing python3-torch (Debian) for the reference"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    python3-torch >/dev/null
fi
[ -x "$BIN/bench_train_step" ] || { echo "build first: scripts/build.sh" >&2; exit 2; }

archs=("$@")
[ ${#archs[@]} -eq 0 ] && archs=(lenet5 resnet20)

printf "%-10s %-9s %6s %7s %12s %12s %10s\n" arch config batch threads "cpd ms/step" \
  "torch ms/st" ratio
for arch in "${archs[@]}"; do
  steps=$STEPS
  [[ $arch == resnet* ]] && steps=$(( STEPS / 3 > 5 ? STEPS / 3 : 5 ))
  torch_ms=$(/usr/bin/python3 benchmarks/torch_step.py --arch "$arch" --batch "$BATCH" \
    --threads "$THREADS" --steps "$steps" | awk '{print $5}')
  fp32_ms=""
  while read -r _ a config b t ms; do
    if [ "$config" = fp32 ]; then
      fp32_ms=$ms
      printf "%-10s %-9s %6s %7s %12.2f %12.2f %10s\n" "$a" "$config" "$b" "$t" "$ms" \
        "$torch_ms" "$(awk -v x="$ms" -v y="$torch_ms" 'BEGIN{printf "%.3f x torch", x/y}')"
    else
      printf "%-10s %-9s %6s %7s %12.2f %12s %10s\n" "$a" "$config" "$b" "$t" "$ms" "-" \
        "$(awk -v x="$ms" -v y="$fp32_ms" 'BEGIN{printf "%.3f x fp32", x/y}')"
    fi
  done < <("$BIN/bench_train_step" --arch "$arch" --batch "$BATCH" --threads "$THREADS" \
             --steps "$steps")
done
