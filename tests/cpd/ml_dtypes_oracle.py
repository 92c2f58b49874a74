#!/usr/bin/env python3
"""Second, independent oracle for CPD's element formats: Google's ml_dtypes.

Feeds float32 inputs through the built `cpd-quant quantize` and through ml_dtypes casts, and
compares the results bit for bit (NaN by NaN-ness). Inputs: every representable value of the
format, every midpoint between neighbours and the floats on either side of it, and 10^6
random values across the format's range.

    ml_dtypes_oracle.py CPD_QUANT PYDEPS_DIR

ml_dtypes (a reference tool only) is installed from PyPI into PYDEPS_DIR on first use. Exits 77
(ctest: skipped) when neither it nor pip is available.
"""
import importlib
import subprocess
import sys

SKIP = 77
ML_DTYPES = "ml_dtypes==0.5.1"  # the last line that works with numpy 1.x (Debian's python3-numpy)


def import_deps(pydeps):
    sys.path.insert(0, pydeps)
    try:
        import numpy  # noqa: F401
        import ml_dtypes  # noqa: F401
        return True
    except ImportError:
        return False


def ensure_deps(pydeps):
    if import_deps(pydeps):
        return
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--target", pydeps, ML_DTYPES]
    try:
        import numpy  # noqa: F401  (use the system numpy when there is one)
        cmd.insert(-1, "--no-deps")
    except ImportError:
        cmd.append("numpy<2")
    res = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()  # the finder cached PYDEPS_DIR while it was empty
    if res.returncode != 0 or not import_deps(pydeps):
        print(f"SKIP: could not install {ML_DTYPES}: {res.stderr.strip()[-300:]}")
        sys.exit(SKIP)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    cpd_quant, pydeps = sys.argv[1], sys.argv[2]
    ensure_deps(pydeps)
    import numpy as np
    import ml_dtypes

    def cpd(spec, x):
        res = subprocess.run([cpd_quant, "quantize", "--format", spec],
                             input=x.astype("<f4").tobytes(), capture_output=True)
        if res.returncode != 0:
            sys.exit(f"cpd-quant failed for {spec}: {res.stderr.decode().strip()}")
        return np.frombuffer(res.stdout, dtype="<f4")

    def probes(dtype, max_finite, rng):
        # Every finite value of the type, midpoints between neighbours and their float32
        # neighbours, plus random values in [-1.5 max, 1.5 max] on a log scale.
        bits = np.dtype(dtype).itemsize * 8
        if bits <= 16:
            codes = np.arange(2 ** bits, dtype=np.uint16 if bits == 16 else np.uint8)
            vals = codes.view(dtype).astype(np.float32)
        else:
            vals = np.array([], dtype=np.float32)
        vals = np.unique(vals[np.isfinite(vals)])
        mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
        up = np.nextafter(mids, np.float32(np.inf))
        down = np.nextafter(mids, np.float32(-np.inf))
        mag = np.exp(rng.uniform(np.log(1e-12), np.log(max_finite * 1.5), 10 ** 6))
        rand = (mag * rng.choice([-1.0, 1.0], mag.size)).astype(np.float32)
        return np.concatenate([vals, mids, up, down, rand]).astype(np.float32)

    rng = np.random.default_rng(20261122)
    # (cpd spec, ml_dtypes type, compare out-of-range inputs too)
    cases = [
        ("bf16:inf", ml_dtypes.bfloat16, True),
        ("fp16:inf", np.float16, True),
        ("e5m2:inf", ml_dtypes.float8_e5m2, True),
        ("e4m3:inf", ml_dtypes.float8_e4m3fn, True),
        # ml_dtypes' handling of values beyond max differs by type and version for formats
        # with no Inf/NaN; CPD follows CUDA there (tested in cuda_oracle_test). In range only.
        ("e3m2", ml_dtypes.float6_e3m2fn, False),
        ("e2m3", ml_dtypes.float6_e2m3fn, False),
        ("e2m1", ml_dtypes.float4_e2m1fn, False),
    ]
    failures = 0
    np.seterr(over="ignore")  # overflow to Inf in the casts is part of what is compared
    for spec, dtype, full_range in cases:
        max_finite = float(ml_dtypes.finfo(dtype).max)
        x = probes(dtype, max_finite, rng)
        if not full_range:
            x = x[np.abs(x) <= max_finite]
        want = x.astype(dtype).astype(np.float32)
        got = cpd(spec, x)
        both_nan = np.isnan(want) & np.isnan(got)
        same = (want.view(np.uint32) == got.view(np.uint32)) | both_nan
        bad = np.flatnonzero(~same)
        status = "ok" if bad.size == 0 else "FAIL"
        print(f"{spec:10s} vs ml_dtypes.{np.dtype(dtype).name:14s} {x.size:8d} inputs: "
              f"{bad.size} mismatches  {status}")
        for i in bad[:5]:
            print(f"    x={x[i]!r} ({x[i:i+1].view(np.uint32)[0]:#010x}) "
                  f"cpd={got[i]!r} ml_dtypes={want[i]!r}")
        failures += bad.size > 0
    print(f"{len(cases) - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
