#!/usr/bin/env bash
# The main job: set up, build, and train LeNet-5 on Fashion-MNIST (Debian's
# dataset-fashion-mnist) with CPT cyclic precision (3-8 bit forward, 8-bit backward), printing
# one line per epoch (loss, train/test accuracy, bits, images/s, relative training cost).
#   scripts/run_main.sh [cpd-train flags...]     e.g. --preset lee2022, --epochs 3, --arch mlp
# Multi-rank training (mpirun / srun) arrives with the comm layer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
BIN=${BUILD_DIR:-build}/bin
# Embedded defaults, each dropped when the same flag is given.
defaults=()
[[ " $* " == *" --preset "* || " $* " == *" --cyclic-bits "* ]] || defaults+=(--preset cpt)
[[ " $* " == *" --epochs "* ]] || defaults+=(--epochs 10)
[[ " $* " == *" --arch "* ]] || defaults+=(--arch lenet5)
[[ " $* " == *" --dataset "* ]] || defaults+=(--dataset fashion-mnist)
exec "$BIN/cpd-train" "${defaults[@]}" "$@"
