#!/usr/bin/env python3
"""Plots a cpd-format-search result (PREFIX.json) as PNG: the network's gradient angle of every
candidate, grouped by bit width (one panel each, candidates in rank order), the best of each width
marked and named, one series per site set (A, E, A+E) with the spread over the batches as error
bars. Run by cpd-format-search; usable alone:
    format_search_plot.py --in PREFIX.json --out PREFIX.png
"""
import argparse
import json
import sys

SITE_STYLE = {"A": ("tab:blue", "o"), "E": ("tab:orange", "s"), "A+E": ("tab:green", "D")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in", dest="inp", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        sys.exit(f"format_search_plot.py: matplotlib is missing ({e}); install python3-matplotlib")
    with open(args.inp) as f:
        doc = json.load(f)
    cands = doc["candidates"]
    if not cands:
        sys.exit("format_search_plot.py: no candidates in " + args.inp)
    sites = [s for s in ("A", "E", "A+E") if s in cands[0]["angles"]]
    rank_site = "A+E" if "A+E" in sites else sites[0]
    widths = sorted({c["bits"] for c in cands}, reverse=True)
    fig, axes = plt.subplots(len(widths), 1, figsize=(11, 3.4 * len(widths)), squeeze=False)
    for ax, bits in zip(axes[:, 0], widths):
        group = sorted((c for c in cands if c["bits"] == bits),
                       key=lambda c: c["angles"][rank_site]["mean_deg"])
        xs = list(range(len(group)))
        for s in sites:
            color, marker = SITE_STYLE[s]
            ax.errorbar(xs, [c["angles"][s]["mean_deg"] for c in group],
                        yerr=[c["angles"][s]["std_deg"] for c in group], fmt=marker, ms=3,
                        color=color, ecolor=color, elinewidth=0.6, capsize=0, label=s)
        best = group[0]
        y = best["angles"][rank_site]["mean_deg"]
        ax.plot([0], [y], marker="*", ms=14, color="gold", markeredgecolor="black", zorder=5)
        name = best["spec"] if len(best["spec"]) <= 40 else best["spec"][:37] + "..."
        ax.annotate(f"best {bits}-bit ({rank_site}): {name}, {y:.2f} deg", (0, y),
                    xytext=(8, 8), textcoords="offset points", fontsize=8)
        # Named formats (those that are not enumerated binade lists) are labelled where they rank.
        for x, c in zip(xs, group):
            if not c["spec"].startswith("binades:"):
                ax.annotate(c["spec"], (x, c["angles"][rank_site]["mean_deg"]), xytext=(0, -12),
                            textcoords="offset points", fontsize=7, ha="center")
        ax.set_title(f"{bits}-bit candidates ({len(group)}), ranked by the {rank_site} angle")
        ax.set_xlabel("candidate (rank within the width)")
        ax.set_ylabel("gradient angle (deg)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    settings = doc.get("settings", {})
    fig.suptitle(f"cpd-format-search: {settings.get('arch', '?')} on {settings.get('dataset', '?')}, "
                 f"{settings.get('batches', '?')} batches of {settings.get('batch_size', '?')}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
