#!/usr/bin/env bash
# The main job: set up, build, and train LeNet-5 on Fashion-MNIST (Debian's
# dataset-fashion-mnist) data-parallel on RANKS MPI ranks (default 2) with CPT cyclic precision
# (3-8 bit forward, 8-bit backward) and gradients summed as packed 8-bit e4m3 codes with
# auto-precision scaling; rank 0 prints one line per epoch (loss, train/test accuracy, bits,
# images/s, relative training cost).
#   scripts/run_main.sh [cpd-train flags...]     e.g. --preset lee2022, --epochs 3, --arch mlp
#   scripts/run_main.sh --arch gpt               a GPT on Debian's fortunes (docs/language-models.md)
#   scripts/run_main.sh --arch lstm              an LSTM language model on the same text
#   RANKS=4 scripts/run_main.sh                  more ranks (oversubscribed beyond the cores)
#   RANKS=1 scripts/run_main.sh                  one process, no mpirun
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage says what it does and how long it took (QUIET=1: the stage lines only).
bash scripts/build.sh
BIN=${BUILD_DIR:-build}/bin
RANKS=${RANKS:-2}
[[ "$RANKS" =~ ^[1-9][0-9]*$ ]] || { echo "run_main.sh: RANKS must be a positive integer" >&2; exit 2; }
# Embedded defaults, each dropped when the same flag is given.
has() { local flag=$1; shift; [[ " $* " == *" $flag "* ]]; }
defaults=()
if has "--arch gpt" "$@" || has "--arch lstm" "$@"; then
  # A language model: the default GPT (about 0.84 M parameters) on Debian's fortunes, byte-level,
  # in float32 (add --preset cpt for cyclic precision), with AdamW at nanoGPT's settings (beta2
  # 0.95, weight decay 0.1, gradients clipped to norm 1; plain SGD stays on the unigram plateau
  # for hundreds of steps); 4 epochs of 2^19 tokens take a few minutes on two cores.
  # Each epoch prints the validation loss, perplexity and bits per byte, the header the unigram
  # baseline.
  has --dataset "$@" || defaults+=(--dataset text)
  has --epochs "$@" || defaults+=(--epochs 4)
  has --tokens-per-epoch "$@" || defaults+=(--tokens-per-epoch 524288)
  has --global-batch "$@" || has --batch-size "$@" || defaults+=(--global-batch 32)
  if ! has --optimizer "$@"; then
    defaults+=(--optimizer adamw)
    lr=1e-3
    has "--arch lstm" "$@" && lr=1e-2
    has --lr "$@" || defaults+=(--lr $lr)
    has --beta2 "$@" || defaults+=(--beta2 0.95)
    has --weight-decay "$@" || defaults+=(--weight-decay 0.1)
    has --clip-grad-norm "$@" || defaults+=(--clip-grad-norm 1)
  fi
  has --warmup-steps "$@" || has --warmup-epochs "$@" || defaults+=(--warmup-steps 20)
  if has "--arch lstm" "$@"; then
    # Two layers of 256 over windows of 64 bytes, at AdamW lr 1e-2 (above). At lr 2e-3 this
    # LSTM was still at the unigram baseline (4.80 bits per byte) after 128 steps of 32
    # windows; at 1e-2 it reached 3.75 (docs/language-models.md).
    has --n-layer "$@" || defaults+=(--n-layer 2)
    has --n-embd "$@" || defaults+=(--n-embd 256)
    has --block-size "$@" || defaults+=(--block-size 64)
  fi
else
  has --preset "$@" || has --cyclic-bits "$@" || defaults+=(--preset cpt)
  has --epochs "$@" || defaults+=(--epochs 10)
  has --arch "$@" || defaults+=(--arch lenet5)
  has --dataset "$@" || defaults+=(--dataset fashion-mnist)
  has --global-batch "$@" || has --batch-size "$@" || defaults+=(--global-batch 128)
fi
has --allreduce "$@" || defaults+=(--allreduce packed --allreduce-format e4m3 --aps)
cores=$(nproc)
has --threads "$@" || defaults+=(--threads $(( cores / RANKS > 0 ? cores / RANKS : 1 )))
# A mistyped flag is one line here, before mpirun (which adds eight lines of its own about the
# rank that exited).
"$BIN/cpd-train" --check "${defaults[@]}" "$@"
if [ "$RANKS" -eq 1 ]; then
  exec "$BIN/cpd-train" "${defaults[@]}" "$@"
fi
mpi=(-np "$RANKS" --bind-to none)
[ "$RANKS" -le "$cores" ] || mpi+=(--oversubscribe)
[ "$(id -u)" -ne 0 ] || mpi+=(--allow-run-as-root)
exec mpirun "${mpi[@]}" "$BIN/cpd-train" "${defaults[@]}" "$@"
