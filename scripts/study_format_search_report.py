#!/usr/bin/env python3
"""The report of scripts/study_format_search.sh, in Markdown, from its outputs only: the search's
ranking (PREFIX.json), the trainings' metrics files (the last epoch's test accuracy, or for a
language model its validation bits per byte), the search times. Spearman's rank correlation
between each site set's angle and the mean final result, signed so that +1 means "a smaller
angle trains better"."""
import argparse
import json
import math
import os
import statistics


def ranks(values):
    """Average ranks (1-based) with ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    r = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(x, y):
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


class Metric:
    """What a training's result is: LeNet-5's test accuracy (higher is better, chance 10 %: ten
    classes) or a byte-level language model's validation bits per byte (lower is better, chance
    8: a uniform guess over 256 bytes)."""

    def __init__(self, model):
        self.lm = model != "lenet5"
        self.key = "test_bits_per_byte" if self.lm else "test_accuracy"
        self.chance = 8.0 if self.lm else 0.10
        self.sign = -1 if self.lm else 1  # +1 when larger is better
        self.scale = 1 if self.lm else 100
        self.title = "validation bits per byte" if self.lm else "test accuracy %"
        self.model = "the default GPT, fortunes" if self.lm else "LeNet-5, Fashion-MNIST"

    def show(self, v):
        return f"{self.scale * v:.3f}" if self.lm else f"{self.scale * v:.2f}"

    def chance_text(self):
        return "8 bits per byte (a uniform guess)" if self.lm else f"chance, {100 * self.chance:.0f} %"


def final_result(path, metric):
    """The last epoch's metric; a run that diverged (cpd-train's "stop" record, exit 3) counts
    as chance, and its step is returned too."""
    value, stopped = None, None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "epoch":
                value = rec[metric.key]
            elif rec.get("type") == "stop":
                stopped = rec["step"]
    return (metric.chance, stopped) if stopped is not None else (value, None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--seeds", default="1 2 3")
    ap.add_argument("--model", default="lenet5", choices=["lenet5", "gpt"])
    args = ap.parse_args()
    metric = Metric(args.model)
    seeds = args.seeds.split()
    search = json.load(open(os.path.join(args.out, f"search-np{args.ranks}.json")))
    cands = search["candidates"]
    by_spec = {c["spec"]: c for c in cands}
    n = len(cands)

    def angle(c, s):
        return c["angles"][s]["mean_deg"]

    print(f"### The search ({n} candidates: {sum(1 for c in cands if c['spec'].startswith('binades:'))} "
          f"enumerated 8-bit per-binade formats and the named ones), ranked by the A+E angle\n")
    print("| rank | format | family | A (deg) | E (deg) | A+E (deg) |")
    print("|---:|---|---|---:|---:|---:|")
    named = {"fp134", "fp143", "fp152", "e4m3", "e5m2", "int8", "int8:ch", "mxfp8"}
    for c in cands:
        if c["rank"] <= 10 or c["spec"] in named or c["rank"] > n - 3:
            print(f"| {c['rank']} | `{c['spec']}` | {c['family']} | "
                  f"{angle(c, 'A'):.3f} ± {c['angles']['A']['std_deg']:.3f} | "
                  f"{angle(c, 'E'):.3f} ± {c['angles']['E']['std_deg']:.3f} | "
                  f"{angle(c, 'A+E'):.3f} ± {c['angles']['A+E']['std_deg']:.3f} |")
    print()

    times = {}
    for r in ("1", args.ranks):
        p = os.path.join(args.out, f"search-np{r}.seconds")
        if os.path.exists(p):
            times[r] = float(open(p).read())
    if times:
        print("### Search time (wall, including loading)\n")
        print("| ranks | seconds | speed-up |")
        print("|---:|---:|---:|")
        for r, t in sorted(times.items(), key=lambda kv: int(kv[0])):
            sp = times.get("1", t) / t
            print(f"| {r} | {t:.1f} | {sp:.2f}x |")
        print()

    base = [final_result(os.path.join(args.out, "train", f"fp32.seed{s}.jsonl"), metric)[0]
            for s in seeds]
    picks = [l.strip() for l in open(os.path.join(args.out, "picks.txt")) if l.strip()]
    rows = []
    for f in picks:
        safe = f.replace(":", "_").replace(",", "_").replace("=", "_")
        accs, notes = [], []
        for s in seeds:
            p = os.path.join(args.out, "train", f"q-{safe}.seed{s}.jsonl")
            a, stopped = final_result(p, metric) if os.path.exists(p) else (None, None)
            if a is not None:
                accs.append(a)
                notes.append(metric.show(a) if stopped is None else f"diverged at step {stopped}")
        if not accs or f not in by_spec:
            continue
        rows.append((f, by_spec[f], accs, notes))
    print(f"### Trained from scratch with A and E in the format ({metric.model}, "
          f"seeds {', '.join(seeds)})\n")
    print(f"fp32 baseline: {metric.show(statistics.mean(base))} ± "
          f"{metric.show(statistics.pstdev(base))} ({', '.join(metric.show(a) for a in base)})\n")
    print(f"A run that diverged (cpd-train stops it, exit 3) counts as {metric.chance_text()} "
          "in the means and the correlations.\n")
    print(f"| format | rank (of {n}) | A+E (deg) | A (deg) | E (deg) | {metric.title} (mean ± std) "
          "| per seed |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for f, c, accs, notes in sorted(rows, key=lambda r: r[1]["rank"]):
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"| `{f}` | {c['rank']} | {angle(c, 'A+E'):.3f} | {angle(c, 'A'):.3f} | "
              f"{angle(c, 'E'):.3f} | {metric.show(statistics.mean(accs))} ± {metric.show(sd)} | "
              f"{', '.join(notes)} |")
    print()
    if len(rows) >= 3:
        mean_acc = [statistics.mean(r[2]) for r in rows]
        print(f"### Spearman rank correlation, -angle vs the mean final result "
              f"({'its negative: lower bits per byte is better' if metric.lm else 'accuracy'})\n")
        print("| site set | rho | formats |")
        print("|---|---:|---:|")
        for s in ("A", "E", "A+E"):
            rho = spearman([-angle(r[1], s) for r in rows], [metric.sign * a for a in mean_acc])
            print(f"| {s} | {rho:.3f} | {len(rows)} |")
        print()


if __name__ == "__main__":
    main()
