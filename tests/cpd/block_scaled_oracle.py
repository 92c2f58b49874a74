#!/usr/bin/env python3
"""Independent oracle for CPD's block-scaled formats, on numpy float32 arithmetic and Google's
ml_dtypes casts (the element and scale formats):

  * NVFP4 (nvfp4, nvfp4:2d) as NVIDIA documents its quantisation (Transformer Engine's reference
    kernels, the NVFP4 pre-training paper's appendix): the tensor's encode scale
    S_enc = 448 * 6 / amax (1 if amax is 0), each block's E4M3 scale
    s_b = e4m3(amax_b * (S_enc * (1/6))), the element e2m1(x * min(1 / (s_b * (1/S_enc)), FLT_MAX)),
    the value (q * s_b) * (1/S_enc);
  * DeepSeek-V3's FP8 tiles and blocks (e4m3:block=1x128, e4m3:block=128x128): float32 scales
    enc = 448 / amax_b, value = e4m3(x * enc) * (1 / enc);
  * OCP MX as an instance (e2m1:block=32:scale=e8m0): 2^(floor(log2 amax_b) - 2).

Feeds float32 matrices through the built `cpd-quant quantize --columns C` and compares bit for
bit.

    block_scaled_oracle.py CPD_QUANT PYDEPS_DIR

Exits 77 (ctest: skipped) when ml_dtypes can be neither imported nor installed.
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ml_dtypes_oracle import ensure_deps  # noqa: E402  (installs ml_dtypes into PYDEPS_DIR)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    cpd_quant, pydeps = sys.argv[1], sys.argv[2]
    ensure_deps(pydeps)
    import numpy as np
    import ml_dtypes

    f32 = np.float32
    flt_max = np.finfo(np.float32).max

    def cast(x, dtype, max_finite):
        # Round to nearest even, saturating (satfinite): clipping first is the same, since every
        # value beyond max rounds to max when the format has nothing above it.
        return np.clip(x, -max_finite, max_finite).astype(dtype).astype(f32)

    def e2m1(x):
        return cast(x, ml_dtypes.float4_e2m1fn, f32(6))

    def e4m3(x):
        return cast(x, ml_dtypes.float8_e4m3fn, f32(448))

    def blocks_amax(x, br, bc):
        rows, cols = x.shape
        a = np.abs(np.where(np.isfinite(x), x, f32(0)))
        nr, nc = -(-rows // br), -(-cols // bc)
        pad = np.zeros((nr * br, nc * bc), dtype=f32)
        pad[:rows, :cols] = a
        m = pad.reshape(nr, br, nc, bc).max(axis=(1, 3))
        return np.repeat(np.repeat(m, br, axis=0), bc, axis=1)[:rows, :cols]

    def nvfp4(x, br, bc):
        amax_t = f32(np.abs(x[np.isfinite(x)]).max()) if np.isfinite(x).any() else f32(0)
        with np.errstate(divide="ignore", over="ignore"):
            s_enc = f32(1) if amax_t == 0 else min(f32(f32(448) * f32(6)) / amax_t, flt_max)
            s_enc = f32(1) if s_enc == 0 else f32(s_enc)
            s_dec = f32(1) / s_enc
            sb = e4m3(blocks_amax(x, br, bc) * (s_enc * (f32(1) / f32(6))))
            enc = np.minimum(f32(1) / (sb * s_dec), flt_max).astype(f32)
            return (e2m1(x * enc) * sb) * s_dec

    def deepseek(x, br, bc):
        amax = blocks_amax(x, br, bc)
        with np.errstate(divide="ignore"):
            enc = np.where(amax > 0, np.minimum(f32(448) / amax, flt_max), f32(1)).astype(f32)
        dec = np.where(amax > 0, f32(1) / enc, f32(1)).astype(f32)
        return e4m3(x * enc) * dec

    def mx4(x, br, bc):
        amax = blocks_amax(x, br, bc)
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
        e = np.clip(e, -127, 127)
        scale = np.ldexp(np.float64(1), e.astype(np.int64))
        return (e2m1((x / scale).astype(f32)).astype(np.float64) * scale).astype(f32)

    def inputs(rows, cols, rng):
        # Blocks of magnitudes spread over 2^-20..2^20, a zero block, a block whose E4M3 scale
        # underflows under the tensor level, grid points and midpoints of e2m1 times 2^k.
        mag = np.exp2(rng.integers(-20, 21, size=(rows, 1))) * np.exp2(
            rng.integers(-3, 4, size=(rows, cols)))
        x = (rng.uniform(-1, 1, size=(rows, cols)) * mag).astype(f32)
        x[0, :16] = 0
        if rows > 1:
            x[1, :16] = f32(1e-30) * np.arange(1, 17, dtype=f32)
        if rows > 2:
            grid = np.array([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6],
                            dtype=f32)
            x[2, :min(cols, 15)] = grid[:min(cols, 15)] * f32(8)
        return x

    def nvfp4_boundaries(rows, cols, rng):
        # Every element but each block's first (its max, 6 on the element grid) at an e2m1
        # midpoint times the block's decode scale, or a float32 step either side: inputs on
        # which a scale rounded differently from NVIDIA's recipe rounds the other way.
        x = np.zeros((rows, cols), dtype=f32)
        x[:, ::16] = (np.exp2(rng.integers(-10, 11, size=(rows, -(-cols // 16))))
                      * rng.uniform(1, 2, size=(rows, -(-cols // 16)))).astype(f32)
        amax_t = f32(np.abs(x).max())
        s_enc = min(f32(f32(448) * f32(6)) / amax_t, flt_max)
        sb = e4m3(blocks_amax(x, 1, 16) * (s_enc * (f32(1) / f32(6))))
        dec = sb * (f32(1) / s_enc)
        mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=f32)
        m = rng.choice(mids, size=(rows, cols)).astype(f32) * dec
        nudge = rng.integers(-1, 2, size=(rows, cols))
        m = np.where(nudge > 0, np.nextafter(m, f32(np.inf)), m)
        m = np.where(nudge < 0, np.nextafter(m, f32(-np.inf)), m).astype(f32)
        keep = np.zeros((rows, cols), dtype=bool)
        keep[:, ::16] = True
        return np.where(keep, x, m * np.sign(rng.uniform(-1, 1, size=(rows, cols)))).astype(f32)

    def cpd(spec, x):
        res = subprocess.run([cpd_quant, "quantize", "--format", spec, "--columns",
                              str(x.shape[1])], input=x.astype("<f4").tobytes(),
                             capture_output=True)
        if res.returncode != 0:
            sys.exit(f"cpd-quant failed for {spec}: {res.stderr.decode().strip()}")
        return np.frombuffer(res.stdout, dtype="<f4").reshape(x.shape)

    rng = np.random.default_rng(20261128)
    cases = [
        ("nvfp4", nvfp4, 1, 16, (256, 320)),
        ("nvfp4", nvfp4, 1, 16, (97, 40)),       # partial blocks at the right edge
        ("nvfp4:2d", nvfp4, 16, 16, (256, 256)),
        ("nvfp4:2d", nvfp4, 16, 16, (45, 70)),   # partial at both edges
        ("e4m3:block=1x128", deepseek, 1, 128, (300, 512)),
        ("e4m3:block=1x128", deepseek, 1, 128, (64, 200)),
        ("e4m3:block=128x128", deepseek, 128, 128, (384, 256)),
        ("e4m3:block=128x128", deepseek, 128, 128, (130, 300)),
        ("e2m1:block=32:scale=e8m0", mx4, 1, 32, (128, 256)),
        # FP8 with one float32 scale per tensor: the whole matrix is the block.
        ("e4m3:block=tensor", deepseek, 200, 300, (200, 300)),
    ]
    cases.append(("nvfp4", nvfp4, 1, 16, (128, 256), nvfp4_boundaries))
    failures = 0
    for spec, ref, br, bc, shape, *make in cases:
        x = (make[0] if make else inputs)(*shape, rng)
        want = ref(x, br, bc)
        got = cpd(spec, x)
        same = (want.view(np.uint32) == got.view(np.uint32)) | (np.isnan(want) & np.isnan(got))
        bad = np.argwhere(~same)
        status = "ok" if bad.size == 0 else "FAIL"
        print(f"{spec:20s} {shape[0]:4d} x {shape[1]:4d}: {len(bad)} mismatches  {status}")
        for r, c in bad[:5]:
            print(f"    x[{r},{c}]={x[r, c]!r} cpd={got[r, c]!r} reference={want[r, c]!r}")
        failures += len(bad) > 0
    print(f"{len(cases) - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
