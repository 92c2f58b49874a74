#!/usr/bin/env python3
"""Plots of a cpd-study report, drawn from the CSVs `cpd-study report` wrote in DIR:

  accuracy_vs_batch.png  final test accuracy (mean over seeds, sample-std error bars) against the
                         global batch (or the first axis), one line per setting of the other axes
                         (e.g. all-reduce format x APS)
  loss_curves.png        training loss per epoch, one line per run
  layer_flushed.png      per-layer mean flushed fraction of the gradient all-reduce, one line per
                         setting (mean over seeds)

Each PNG is written under a temporary name and renamed when whole. Needs python3-matplotlib.
"""
import argparse
import csv
import math
import os
from collections import OrderedDict, defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def number(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return math.nan


def save(fig, path):
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def summary_axes(path):
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    return header[: header.index("n_seeds")]


def accuracy_vs_batch(d, axes, out):
    rows = read_csv(os.path.join(d, "summary.csv"))
    x_axis = "global-batch" if "global-batch" in axes else axes[0]
    others = [a for a in axes if a != x_axis]
    series = OrderedDict()
    for r in rows:
        key = " ".join(f"{a}={r[a]}" for a in others) or "all"
        series.setdefault(key, []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    numeric = all(not math.isnan(number(r[x_axis])) for r in rows)
    categories = list(OrderedDict.fromkeys(r[x_axis] for r in rows))
    for key, rs in series.items():
        xs = [number(r[x_axis]) if numeric else categories.index(r[x_axis]) for r in rs]
        ys = [100 * number(r["final_test_accuracy_mean"]) for r in rs]
        es = [100 * number(r["final_test_accuracy_std"]) for r in rs]
        es = [0 if math.isnan(e) else e for e in es]
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        ax.errorbar([xs[i] for i in order], [ys[i] for i in order], yerr=[es[i] for i in order],
                    marker="o", capsize=3, label=key)
    if numeric and len(categories) > 1:
        ax.set_xscale("log", base=2)
    elif not numeric:
        ax.set_xticks(range(len(categories)))
        ax.set_xticklabels(categories)
    ax.set_xlabel(x_axis)
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("accuracy vs " + x_axis + " (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    if len(series) <= 16:
        ax.legend(fontsize=7)
    save(fig, os.path.join(out, "accuracy_vs_batch.png"))


def loss_curves(d, out):
    rows = read_csv(os.path.join(d, "curves.csv"))
    runs = OrderedDict()
    for r in rows:
        runs.setdefault(r["run"], []).append((number(r["epoch"]), number(r["loss"])))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in runs.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1, label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_title("loss curves")
    ax.grid(alpha=0.3)
    if not runs:
        ax.text(0.5, 0.5, "no epochs yet", ha="center", transform=ax.transAxes)
    elif len(runs) <= 12:
        ax.legend(fontsize=6)
    save(fig, os.path.join(out, "loss_curves.png"))


def layer_flushed(d, axes, out):
    rows = read_csv(os.path.join(d, "layers.csv"))
    groups = OrderedDict()
    names = {}
    for r in rows:
        key = " ".join(f"{a}={r[a]}" for a in axes)
        idx = int(r["layer_index"])
        names[idx] = r["layer"]
        groups.setdefault(key, defaultdict(list))[idx].append(number(r["mean_flushed"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, per_layer in groups.items():
        xs = sorted(per_layer)
        ax.plot(xs, [sum(per_layer[i]) / len(per_layer[i]) for i in xs], marker="o", label=key)
    if names:
        ax.set_xticks(sorted(names))
        ax.set_xticklabels([names[i] for i in sorted(names)], rotation=45, ha="right", fontsize=7)
    else:
        ax.text(0.5, 0.5, "no all-reduce statistics (runs with one worker)", ha="center",
                transform=ax.transAxes)
    ax.set_ylabel("flushed fraction of the all-reduce")
    ax.set_title("per-layer flushed fraction (mean over steps and seeds)")
    ax.grid(alpha=0.3)
    if groups and len(groups) <= 16:
        ax.legend(fontsize=6)
    save(fig, os.path.join(out, "layer_flushed.png"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the report directory (its CSVs; PNGs go there)")
    a = p.parse_args()
    axes = summary_axes(os.path.join(a.dir, "summary.csv"))
    accuracy_vs_batch(a.dir, axes, a.dir)
    loss_curves(a.dir, a.dir)
    layer_flushed(a.dir, axes, a.dir)


if __name__ == "__main__":
    main()
