#!/usr/bin/env python3
"""Plots of a cpd-study report, drawn from the CSVs `cpd-study report` wrote in DIR:

  accuracy_vs_batch.png  final test accuracy (mean over seeds, sample-std error bars) against the
                         global batch (or the first axis), one line per setting of the other axes
                         (e.g. all-reduce format x APS)
  loss_curves.png        training loss per epoch, one line per setting (mean over seeds)
  layer_flushed.png      per-layer mean flushed fraction of the gradient all-reduce, one line per
                         setting (mean over seeds)

When two or more axes vary besides the x axis, each plot is split into panels, one per value of
"workers" (else of the first axis), so that every panel's lines stay few enough to label.

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


def panel_axis(axes):
    """The axis that splits a plot into side-by-side panels: "workers" (else the first axis) when
    two or more axes vary, so that each panel keeps few enough lines to label; None otherwise."""
    if len(axes) < 2:
        return None
    return "workers" if "workers" in axes else axes[0]


def panels(rows, axis):
    """The panel values (ascending when numbers, else in order of first appearance), and a figure
    with one panel per value."""
    values = list(OrderedDict.fromkeys(r[axis] for r in rows)) if axis else [None]
    if axis and all(not math.isnan(number(v)) for v in values):
        values.sort(key=number)
    fig, subplots = plt.subplots(1, len(values), figsize=(4.2 * len(values) + 1.5, 4.5),
                                 sharey=True, squeeze=False)
    return values, fig, list(subplots[0])


def style(i):
    """Line i's colour and dash: 20 distinct colours (tab20), then the same colours dashed."""
    return {"color": plt.cm.tab20(i % 20), "linestyle": ("-", "--", ":")[(i // 20) % 3]}


def label(r, axes):
    return " ".join(f"{a}={r[a]}" for a in axes) or "all"


def finish(fig, subplots, axis, values, title, legend_limit=24):
    for ax, v in zip(subplots, values):
        ax.grid(alpha=0.3)
        if axis:
            ax.set_title(f"{axis}={v}", fontsize=9)
    fig.suptitle(title)
    # Every panel's lines: a panel need not have them all (fp32 runs without APS scalings).
    handles, labels = [], []
    for ax in subplots:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    if 0 < len(handles) <= legend_limit:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(handles)), fontsize=7,
                   bbox_to_anchor=(0.5, -0.02 - 0.035 * math.ceil(len(handles) / 4)))
    fig.tight_layout()


def accuracy_vs_batch(d, axes, out):
    rows = read_csv(os.path.join(d, "summary.csv"))
    x_axis = "global-batch" if "global-batch" in axes else axes[0]
    others = [a for a in axes if a != x_axis]
    split = panel_axis(others)
    lines = [a for a in others if a != split]
    numeric = all(not math.isnan(number(r[x_axis])) for r in rows)
    categories = list(OrderedDict.fromkeys(r[x_axis] for r in rows))
    values, fig, subplots = panels(rows, split)
    for ax, v in zip(subplots, values):
        series = OrderedDict()
        for r in rows:
            if split is None or r[split] == v:
                series.setdefault(label(r, lines), []).append(r)
        for i, (key, rs) in enumerate(series.items()):
            xs = [number(r[x_axis]) if numeric else categories.index(r[x_axis]) for r in rs]
            ys = [100 * number(r["final_test_accuracy_mean"]) for r in rs]
            es = [100 * number(r["final_test_accuracy_std"]) for r in rs]
            es = [0 if math.isnan(e) else e for e in es]
            order = sorted(range(len(xs)), key=lambda i: xs[i])
            ax.errorbar([xs[i] for i in order], [ys[i] for i in order],
                        yerr=[es[i] for i in order], marker="o", capsize=3, label=key,
                        **style(i))
        if numeric and len(categories) > 1:
            ax.set_xscale("log", base=2)
        elif not numeric:
            ax.set_xticks(range(len(categories)))
            ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=7)
        ax.set_xlabel(x_axis)
    subplots[0].set_ylabel("final test accuracy (%)")
    finish(fig, subplots, split, values, "accuracy vs " + x_axis + " (mean ± std over seeds)")
    save(fig, os.path.join(out, "accuracy_vs_batch.png"))


def loss_curves(d, axes, out):
    """Training loss per epoch, the mean over the seeds of each setting."""
    rows = read_csv(os.path.join(d, "curves.csv"))
    split = panel_axis(axes)
    lines = [a for a in axes if a != split]
    values, fig, subplots = panels(rows, split)
    for ax, v in zip(subplots, values):
        curves = OrderedDict()
        for r in rows:
            if split is None or r[split] == v:
                per_epoch = curves.setdefault(label(r, lines), defaultdict(list))
                per_epoch[number(r["epoch"])].append(number(r["loss"]))
        for i, (key, per_epoch) in enumerate(curves.items()):
            xs = sorted(per_epoch)
            ax.plot(xs, [sum(per_epoch[x]) / len(per_epoch[x]) for x in xs], marker=".",
                    linewidth=1, label=key, **style(i))
        ax.set_xlabel("epoch")
        if not rows:
            ax.text(0.5, 0.5, "no epochs yet", ha="center", transform=ax.transAxes)
    subplots[0].set_ylabel("training loss (mean over seeds)")
    finish(fig, subplots, split, values, "loss curves")
    save(fig, os.path.join(out, "loss_curves.png"))


def layer_flushed(d, axes, out):
    rows = read_csv(os.path.join(d, "layers.csv"))
    split = panel_axis(axes)
    lines = [a for a in axes if a != split]
    names = {int(r["layer_index"]): r["layer"] for r in rows}
    values, fig, subplots = panels(rows, split)
    for ax, v in zip(subplots, values):
        groups = OrderedDict()
        for r in rows:
            if split is None or r[split] == v:
                per_layer = groups.setdefault(label(r, lines), defaultdict(list))
                per_layer[int(r["layer_index"])].append(number(r["mean_flushed"]))
        for n, (key, per_layer) in enumerate(groups.items()):
            xs = sorted(per_layer)
            ax.plot(xs, [sum(per_layer[i]) / len(per_layer[i]) for i in xs], marker="o",
                    label=key, **style(n))
        if names:
            ax.set_xticks(sorted(names))
            ax.set_xticklabels([names[i] for i in sorted(names)], rotation=45, ha="right",
                               fontsize=7)
        else:
            ax.text(0.5, 0.5, "no all-reduce statistics (runs with one worker)", ha="center",
                    transform=ax.transAxes)
    subplots[0].set_ylabel("flushed fraction of the all-reduce")
    finish(fig, subplots, split, values, "per-layer flushed fraction (mean over steps and seeds)")
    save(fig, os.path.join(out, "layer_flushed.png"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the report directory (its CSVs; PNGs go there)")
    a = p.parse_args()
    axes = summary_axes(os.path.join(a.dir, "summary.csv"))
    accuracy_vs_batch(a.dir, axes, a.dir)
    loss_curves(a.dir, axes, a.dir)
    layer_flushed(a.dir, axes, a.dir)


if __name__ == "__main__":
    main()
