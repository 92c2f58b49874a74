#!/usr/bin/env python3
"""The summary plots of docs/studies/recipes.md: final validation bits per byte of every GPT
recipe (mean and each seed), the accumulation widths, and ResNet-20's test accuracy, read from the
runs.csv files that `cpd-study report` writes.

  scripts/recipes_plot.py OUT_DIR STUDIES_DIR...
  scripts/recipes_plot.py docs/studies/recipes docs/studies/recipes docs/studies/lm

Each STUDIES_DIR holds one folder per study (rec-presets, rec-mxfp4, ..., each with runs.csv, as
docs/studies/recipes/ and docs/studies/lm/ keep them); the first that has a study is read. The
fp32 baselines are lm-cpt-gpt-fp32 (GPT) and rec-resnet20-fp32 (ResNet-20). Writes
OUT_DIR/gpt_recipes.png,
OUT_DIR/accumulation.png and OUT_DIR/resnet20_recipes.png (the last only when its studies exist).
"""
import csv
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def runs(studies, name, column, where=None):
    """The `column` values of study `name`'s finished runs (in the first of the `studies`
    folders that has it), keyed by setting (the run name without its seed), optionally only rows
    whose columns match `where`."""
    paths = [os.path.join(d, name, "runs.csv") for d in studies]
    paths = [p for p in paths if os.path.exists(p)]
    if not paths:
        return None
    path = paths[0]
    out = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["state"] != "done" or not row.get(column):
                continue
            if where and any(row.get(k) != v for k, v in where.items()):
                continue
            setting = row["run"].rsplit(".seed_", 1)[0]
            out.setdefault(setting, []).append(float(row[column]))
    return out


def one(values):
    """The one setting's values of a single-setting study."""
    if not values:
        return None
    if len(values) != 1:
        sys.exit(f"recipes_plot: expected one setting, got {sorted(values)}")
    return next(iter(values.values()))


def dots(ax, labels, series, xlabel, reference=None):
    """Horizontal mean ± sample std bars with each seed as a dot, first label at the top."""
    y = list(range(len(labels)))[::-1]
    for yi, vals in zip(y, series):
        mean = statistics.mean(vals)
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        ax.errorbar(mean, yi, xerr=std, fmt="o", color="C0", capsize=3)
        ax.scatter(vals, [yi] * len(vals), s=12, color="C1", zorder=3)
    if reference is not None:
        ax.axvline(statistics.mean(reference), color="grey", lw=0.8, ls="--")
    ax.set_yticks(y)
    ax.set_yticklabels(labels)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)


def gpt(studies, out):
    bpb = "final_test_bits_per_byte"
    fp32 = one(runs(studies, "lm-cpt-gpt-fp32", bpb))
    presets = runs(studies, "rec-presets", bpb)
    mxfp4 = runs(studies, "rec-mxfp4", bpb)
    rows = [
        ("fp32", fp32),
        ("per-tensor E4M3", one(runs(studies, "rec-fp8-tensor", bpb))),
        ("DeepSeek-V3 FP8", presets["preset_deepseek-fp8"]),
        ("MXFP8", one(runs(studies, "rec-mxfp8", bpb))),
        ("NVFP4", presets["preset_nvfp4"]),
        ("NVFP4 - RHT", one(runs(studies, "rec-nvfp4-norht", bpb))),
        ("NVFP4 - SR", one(runs(studies, "rec-nvfp4-nosr", bpb))),
        ("NVFP4 - 2D W", one(runs(studies, "rec-nvfp4-no2d", bpb))),
        ("MXFP4, random Hadamard", mxfp4["wgrad-transform_rht32"]),
        ("MXFP4, fixed Hadamard", mxfp4["wgrad-transform_had32"]),
    ]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    dots(ax, [r[0] for r in rows], [r[1] for r in rows],
         "final validation bits per byte (mean ± std, dots: seeds)", fp32)
    ax.set_title("Recipes on the default GPT, 3 seeds (dashed: fp32)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gpt_recipes.png"), dpi=120)


def accumulation(studies, out):
    bpb = "final_test_bits_per_byte"
    acc = runs(studies, "rec-accumulate", bpb)
    bits = runs(studies, "rec-accumulate-bits", bpb) or {}
    acc.update(bits)
    order = [("accumulate_none", "float32 GEMM"),
             ("accumulate_e8m13-every-128", "14 bits, promoted / 128"),
             ("accumulate_e8m13", "14 bits, never promoted"),
             ("accumulate_e8m13-round-toward-zero", "14 bits truncated, never promoted"),
             ("accumulate_e8m10-every-128", "11 bits, promoted / 128"),
             ("accumulate_e8m10", "11 bits, never promoted"),
             ("accumulate_e8m7-every-128", "8 bits, promoted / 128"),
             ("accumulate_e8m7", "8 bits, never promoted")]
    rows = [(label, acc[key]) for key, label in order if key in acc]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    dots(ax, [r[0] for r in rows], [r[1] for r in rows],
         "final validation bits per byte (mean ± std, dots: seeds)", acc["accumulate_none"])
    ax.set_title("GPT, DeepSeek-V3 FP8: accumulation width and promotion")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "accumulation.png"), dpi=120)


def resnet(studies, out):
    acc = "final_test_accuracy"
    fp32 = one(runs(studies, "rec-resnet20-fp32", acc))
    presets = runs(studies, "rec-resnet20-presets", acc)
    if fp32 is None or presets is None:
        return
    rows = [("fp32", fp32), ("DeepSeek-V3 FP8", presets["preset_deepseek-fp8"]),
            ("NVFP4", presets["preset_nvfp4"])]
    tensor = one(runs(studies, "rec-resnet20-tensor", acc))
    if tensor is not None:
        rows.insert(1, ("per-tensor E4M3", tensor))
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.2))
    dots(ax, [r[0] for r in rows], [[100 * v for v in r[1]] for r in rows],
         "final test accuracy, % (mean ± std, dots: seeds)", [100 * v for v in fp32])
    ax.set_title("Recipes on ResNet-20 / Fashion-MNIST, 1 epoch, 3 seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "resnet20_recipes.png"), dpi=120)


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: recipes_plot.py OUT_DIR STUDIES_DIR...")
    out, studies = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    gpt(studies, out)
    accumulation(studies, out)
    resnet(studies, out)


if __name__ == "__main__":
    main()
