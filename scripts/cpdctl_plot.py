#!/usr/bin/env python3
"""Plots a CPD job's history for `cpdctl plot` (which runs it; it can also be run by hand).

Input (--in): one JSON document {"job": JobStatusResponse, "schedules": [PrecisionSchedule],
"reports": [StatsReport]} with the field names of proto/cpd/v1/coordinator.proto, as cpdctl
writes it. Output (--out): a PNG with four panels over steps: forward bits and schedule version,
loss (and test accuracy, or a language model's validation perplexity), the per-layer APS shift of the gradient all-reduce (SITE_COMM rows), and
the per-layer flushed (underflow) fraction.

Needs Debian's python3-matplotlib; MPLBACKEND=Agg is set by cpdctl. On failure it prints one line
on stderr and exits non-zero (3: matplotlib missing, 2: bad input).
"""
import argparse
import json
import sys

MAX_LINES = 12  # lines per per-layer panel (the layers with the largest values)


def fail(msg, code=2):
    print(f"cpdctl_plot: {msg}", file=sys.stderr)
    sys.exit(code)


def series(reports, key):
    xs, ys = [], []
    for r in reports:
        xs.append(r.get("step", 0))
        ys.append(r.get(key, 0))
    return xs, ys


def measured(reports, key):
    """(step, value) of the reports that measured `key` (a validation perplexity: > 0; a
    negative value or 0 is none, and NaN, which JSON writes as null, is left out)."""
    points = [(r.get("step", 0), r.get(key, -1)) for r in reports]
    return [(x, v) for x, v in points if isinstance(v, (int, float)) and v > 0]


def per_layer(reports, site, key):
    """{label: (steps, values)} for the rows of `site` ("SITE_COMM", or None: every site)."""
    out = {}
    for r in reports:
        for l in r.get("layers", []):
            if site is not None and l.get("site") != site:
                continue
            label = l.get("layer", "?")
            if site is None:
                label += "." + str(l.get("site", "?")).replace("SITE_", "")
            xs, ys = out.setdefault(label, ([], []))
            xs.append(r.get("step", 0))
            ys.append(l.get(key, 0))
    return out


def draw_lines(ax, lines, scale=1.0, drop_zero=False):
    """Draws the MAX_LINES lines with the largest peaks; returns (lines left out, lines)."""
    items = list(lines.items())
    if drop_zero:
        items = [(k, v) for k, v in items if any(y != 0 for y in v[1])]
    items.sort(key=lambda kv: -max(abs(y) for y in kv[1][1]) if kv[1][1] else 0)
    shown = items[:MAX_LINES]
    for label, (xs, ys) in shown:
        ax.plot(xs, [y * scale for y in ys], marker=".", markersize=3, linewidth=1, label=label)
    if shown:
        ax.legend(fontsize=6, ncol=2, loc="best")
    return len(items) - len(shown), len(items)


def note(ax, text):
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in", dest="inp", required=True, help="JSON written by cpdctl")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args()

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        fail(f"matplotlib is not available to {sys.executable} ({e}); install python3-matplotlib "
             "(scripts/install_deps.sh)", 3)

    try:
        with open(args.inp, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"cannot read {args.inp}: {e}")
    if not isinstance(doc, dict) or not isinstance(doc.get("reports"), list):
        fail(f"{args.inp}: expected an object with a 'reports' list")

    reports = sorted(doc["reports"], key=lambda r: r.get("step", 0))
    job = doc.get("job", {}).get("job", {})
    title = f"{job.get('job_name', '?')} (id {job.get('job_id', '?')})"
    if job.get("arch"):
        title += f": {job.get('arch')} on {job.get('dataset', '?')}"

    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    fig.suptitle(f"{title}, {len(reports)} reports")

    # 1. Forward bits (CPT) and the schedule version in force.
    ax = axes[0]
    xs, bits = series(reports, "bits")
    _, versions = series(reports, "schedule_version")
    if any(b > 0 for b in bits):
        ax.step(xs, bits, where="post", color="C0", label="forward bits")
    else:
        note(ax, "no CPT: forward bits follow the formats")
    ax.set_ylabel("forward bits")
    ax2 = ax.twinx()
    if xs:
        ax2.step(xs, versions, where="post", color="C3", linestyle="--", label="schedule version")
    ax2.set_ylabel("schedule version", color="C3")
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    for s in doc.get("schedules", []):
        if s.get("version", 1) > 1:
            ax.axvline(s.get("effective_from_step", 0), color="C3", linestyle=":", linewidth=0.8)
    ax.set_title("precision schedule", fontsize=10)

    # 2. Loss and test accuracy (a language model: its validation perplexity instead).
    ax = axes[1]
    xs, loss = series(reports, "loss")
    if xs:
        ax.plot(xs, loss, color="C0", linewidth=1, label="loss")
    ax.set_ylabel("loss")
    acc = [(r.get("step", 0), r.get("test_accuracy", -1)) for r in reports]
    acc = [(x, 100 * a) for x, a in acc if isinstance(a, (int, float)) and a >= 0]
    ppl = measured(reports, "test_perplexity")
    if ppl:
        ax2 = ax.twinx()
        ax2.plot([x for x, _ in ppl], [p for _, p in ppl], "o-", color="C2", markersize=3)
        ax2.set_ylabel("validation perplexity", color="C2")
    elif acc:
        ax2 = ax.twinx()
        ax2.plot([x for x, _ in acc], [a for _, a in acc], "o-", color="C2", markersize=3)
        ax2.set_ylabel("test accuracy %", color="C2")
    ax.set_title("loss", fontsize=10)

    # 3. APS shift per layer (the all-reduce's SITE_COMM rows).
    ax = axes[2]
    left, total = draw_lines(ax, per_layer(reports, "SITE_COMM", "aps_shift"))
    if total == 0:
        note(ax, "no all-reduce statistics (SITE_COMM rows)")
    ax.set_ylabel("APS shift (log2)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("per-layer APS shift" + (f" ({left} more layers not shown)" if left else ""),
                 fontsize=10)

    # 4. Flushed (underflow) fraction per layer and site.
    ax = axes[3]
    left, total = draw_lines(ax, per_layer(reports, None, "flushed"), scale=100, drop_zero=True)
    if total == 0:
        note(ax, "no underflow recorded")
    ax.set_ylabel("flushed %")
    ax.set_xlabel("step")
    ax.set_title("per-layer flushed (underflow) fraction" +
                 (f" ({left} more not shown)" if left else ""), fontsize=10)

    fig.tight_layout()
    try:
        fig.savefig(args.out, format="png", dpi=100)
    except OSError as e:
        fail(f"cannot write {args.out}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
