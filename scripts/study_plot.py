#!/usr/bin/env python3
"""One plot of a cpd-study report (--plot), drawn from the CSVs `cpd-study report` wrote in DIR:

  accuracy  final test accuracy (mean over seeds, sample-std error bars) against --x-axis (the
            global batch when it is an axis, else the first axis: cpd-study names the file
            accuracy_vs_<axis>.png), one line per setting of the other axes
  perplexity  (a study of language models, in place of `accuracy`) validation bits per byte per
            epoch (byte-level text; the right axis reads them as perplexity 2^bpb), else the
            validation perplexity on a log scale, one line per setting (mean over seeds)
  loss      training loss per epoch, one line per setting (mean over seeds), on a log scale so
            that a run that diverged (loss 1e10) does not flatten the others; a setting with a
            diverged seed is drawn with an x at its last point and says so in its label
  layers    per-layer mean flushed fraction of the gradient all-reduce, one line per setting
            (mean over seeds); a note instead when no run has all-reduce statistics

When two or more axes vary besides the x axis, each plot is split into panels, one per value of
"workers" (else of the first axis), so that every panel's lines stay few enough to label. Missing
statistics (empty cells, empty tables) leave a note in the panel, never an error.

cpd-study runs this once per plot, so that a plot that fails is one line naming it and the rest
of the report stands. The PNG is written under a temporary name and renamed when whole. Needs
python3-matplotlib.
"""
import argparse
import csv
import math
import os
import sys
from collections import OrderedDict, defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


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
    if not values:  # an empty table (no run has these statistics yet): one panel with a note
        values, axis = [None], None
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


def accuracy(d, axes, out, x_axis):
    rows = read_csv(os.path.join(d, "summary.csv"))
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
        if not any(not math.isnan(number(r["final_test_accuracy_mean"])) for r in rows):
            ax.text(0.5, 0.5, "no test accuracy yet", ha="center", transform=ax.transAxes)
    subplots[0].set_ylabel("final test accuracy (%)")
    finish(fig, subplots, split, values, "accuracy vs " + x_axis + " (mean ± std over seeds)")
    save(fig, out)


def perplexity_curves(d, axes, out):
    """A language model's validation per epoch, the mean over the seeds of each setting: bits per
    byte when every run with a perplexity logged them (byte-level text), with the perplexity
    2^bpb on a right-hand axis; otherwise the perplexity, on a log scale."""
    rows = read_csv(os.path.join(d, "curves.csv"))
    measured = [r for r in rows if number(r.get("test_perplexity")) > 0]
    bpb = bool(measured) and all(number(r.get("test_bits_per_byte")) > 0 for r in measured)
    key = "test_bits_per_byte" if bpb else "test_perplexity"
    split = panel_axis(axes)
    lines = [a for a in axes if a != split]
    values, fig, subplots = panels(rows, split)
    drawn = False
    for ax, v in zip(subplots, values):
        curves = OrderedDict()
        for r in rows:
            if split is None or r[split] == v:
                per_epoch = curves.setdefault(label(r, lines), defaultdict(list))
                y = number(r.get(key))
                if math.isfinite(y) and y > 0:
                    per_epoch[number(r["epoch"])].append(y)
        for i, (name, per_epoch) in enumerate(curves.items()):
            xs = sorted(per_epoch)
            if xs:
                ys = [sum(per_epoch[x]) / len(per_epoch[x]) for x in xs]
                ax.plot(xs, ys, marker="o", linewidth=1, label=name, **style(i))
                drawn = True
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not drawn:
        subplots[0].text(0.5, 0.5, "no validation perplexity yet", ha="center",
                         transform=subplots[0].transAxes)
    elif bpb:
        right = subplots[-1].secondary_yaxis(
            "right", functions=(lambda b: np.power(2.0, b), lambda p: np.log2(np.maximum(p, 1e-300))))
        right.set_ylabel("perplexity (2^bpb)")
    else:
        for ax in subplots:
            ax.set_yscale("log")
    subplots[0].set_ylabel("validation bits per byte (mean over seeds)" if bpb else
                           "validation perplexity (mean over seeds, log scale)")
    finish(fig, subplots, split, values,
           "validation " + ("bits per byte" if bpb else "perplexity") + " per epoch")
    save(fig, out)


def loss_curves(d, axes, out):
    """Training loss per epoch, the mean over the seeds of each setting, on a log scale (a
    diverged run's 1e10 would flatten every other line on a linear one). Losses that are not
    finite and positive cannot be drawn on it and are left out."""
    rows = read_csv(os.path.join(d, "curves.csv"))
    split = panel_axis(axes)
    lines = [a for a in axes if a != split]
    values, fig, subplots = panels(rows, split)
    drawn = False
    for ax, v in zip(subplots, values):
        curves = OrderedDict()
        diverged = defaultdict(set)
        for r in rows:
            if split is None or r[split] == v:
                key = label(r, lines)
                per_epoch = curves.setdefault(key, defaultdict(list))
                loss = number(r["loss"])
                if math.isfinite(loss) and loss > 0:
                    per_epoch[number(r["epoch"])].append(loss)
                if r.get("diverged") == "1":
                    diverged[key].add(r["run"])
        for i, (key, per_epoch) in enumerate(curves.items()):
            xs = sorted(per_epoch)
            if not xs:
                continue
            ys = [sum(per_epoch[x]) / len(per_epoch[x]) for x in xs]
            name = key
            if diverged[key]:
                name += f" ({len(diverged[key])} diverged)"
            ax.plot(xs, ys, marker=".", linewidth=1, label=name, **style(i))
            if diverged[key]:
                ax.plot(xs[-1:], ys[-1:], marker="x", markersize=10, mew=2, linestyle="none",
                        color=style(i)["color"])
            drawn = True
        ax.set_xlabel("epoch")
    if drawn:
        for ax in subplots:
            ax.set_yscale("log")
    else:
        subplots[0].text(0.5, 0.5, "no finite losses yet", ha="center",
                         transform=subplots[0].transAxes)
    subplots[0].set_ylabel("training loss (mean over seeds, log scale)")
    finish(fig, subplots, split, values, "loss curves (x: a setting with a diverged seed)")
    save(fig, out)


def layer_flushed(d, axes, out):
    """The per-layer flushed fraction; a note when no run logged all-reduce statistics (one
    worker per run, or no --stats-every)."""
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
    save(fig, out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the report directory (its CSVs; PNGs go there)")
    p.add_argument("--plot", required=True, choices=["accuracy", "perplexity", "loss", "layers"])
    p.add_argument("--out", required=True, help="the PNG's file name in --dir")
    p.add_argument("--x-axis", help="accuracy: the axis on the x axis (default: the first)")
    a = p.parse_args()
    axes = summary_axes(os.path.join(a.dir, "summary.csv"))
    out = os.path.join(a.dir, a.out)
    if a.plot == "accuracy":
        x_axis = a.x_axis if a.x_axis in axes else axes[0]
        accuracy(a.dir, axes, out, x_axis)
    elif a.plot == "perplexity":
        perplexity_curves(a.dir, axes, out)
    elif a.plot == "loss":
        loss_curves(a.dir, axes, out)
    else:
        layer_flushed(a.dir, axes, out)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001 -- one line for cpd-study's warning, not a traceback
        msg = " ".join(str(e).split())[:300]
        print(f"study_plot.py: {type(e).__name__}: {msg}", file=sys.stderr)
        sys.exit(1)
