#!/usr/bin/env bash
# The main job (for now): build, then push real data -- Fashion-MNIST training images, normalised
# as a network's input activations would be -- through CPD's number formats and print what each
# format does to it (range, saturation, underflow, relative error). Later issues replace this
# with multi-rank training.
#   scripts/run_main.sh [FORMAT ...]      default: a tour of the format families
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
BIN=${BUILD_DIR:-build}/bin

DATA=${CPD_DATA:-/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz}
if [ ! -r "$DATA" ]; then
  echo "run_main: cannot read $DATA (install dataset-fashion-mnist, or set CPD_DATA)" >&2
  exit 2
fi

formats=("$@")
if [ ${#formats[@]} -eq 0 ]; then
  formats=(fp16 bf16 e5m2 e4m3 e3m2 e2m1 e3m0 fp134 fp143 log4 int8 uint4:minmax mxfp8 mxfp4 bfp8:16)
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# IDX: 16-byte header, then 60000 x 28 x 28 unsigned bytes. Normalise with the training
# mean/std (0.2860, 0.3530) and write raw little-endian float32.
/usr/bin/python3 - "$DATA" "$tmp/x.f32" <<'PY'
import gzip, struct, sys
import numpy as np
with gzip.open(sys.argv[1], "rb") as f:
    magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
    if magic != 2051:
        sys.exit(f"run_main: {sys.argv[1]}: bad IDX magic {magic:#x}, expected 0x803")
    x = np.frombuffer(f.read(), dtype=np.uint8).astype(np.float32) / 255.0
x = (x - 0.2860) / 0.3530
x.astype("<f4").tofile(sys.argv[2])
print(f"Fashion-MNIST: {n} images {rows}x{cols} = {x.size} values, normalised "
      f"(min {x.min():.3f}, max {x.max():.3f})")
PY

for f in "${formats[@]}"; do
  "$BIN/cpd-quant" quantize --format "$f" --stats <"$tmp/x.f32" 2>&1 >/dev/null
done
