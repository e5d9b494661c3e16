"""The planner benchmark's results: a row per (model, stages, method), the verdicts with their
confidence intervals, the tables, the summary and the plots (``bench_planner.py`` measures; this
prints, also from a run saved with ``--json``: ``bench_planner.py --from-json run.json``)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from common import emit, markdown_table
from planner_zoo import MODEL_BY_NAME

HERE = os.path.dirname(os.path.abspath(__file__))
PIPESPLIT_COSTS = ("profile+refine", "profile", "hybrid")


@dataclass
class Row:
    model: str
    stages: int
    method: str
    split: str
    bottleneck_ms: float
    stage_ms: list[float]
    step_1f1b_ms: float
    step_zbh1_ms: float
    peak_mem_mb: float
    planned_1f1b_ms: float | None = None  # pipesplit's own prediction before any measurement
    noise: float = 0.0  # bottleneck stage: interquartile range over rounds / median
    stage_nodes: list[list[str]] = field(default_factory=list)  # the graph nodes of each stage
    round_ms: list[float] = field(default_factory=list)  # per round: the largest stage F+B measured in it


def median_ci(x: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median of ``x`` and a distribution-free confidence interval for it (order statistics)."""
    xs = sorted(x)
    n = len(xs)
    # the largest j with P(Binomial(n, 1/2) < j) <= (1 - level) / 2: [x_(j), x_(n+1-j)] covers the median
    tail, j = 0.0, 0
    while j < n and tail + math.comb(n, j) / 2**n <= (1 - level) / 2:
        tail += math.comb(n, j) / 2**n
        j += 1
    lo, hi = (xs[j - 1], xs[n - j]) if j >= 1 else (xs[0], xs[-1])
    return float(np.median(xs)), lo, hi


def paired(mine: Row, ref: Row) -> tuple[float, float, float]:
    """Per round, the reference's bottleneck over pipesplit's (both timed seconds apart): median and 95% CI."""
    return median_ci([r / m for r, m in zip(ref.round_ms, mine.round_ms)])


def verdicts(rows: list[Row], primary: str) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for key in sorted({(r.model, r.stages) for r in rows}, key=lambda x: (x[0], x[1])):
        group = [r for r in rows if (r.model, r.stages) == key]
        mine = next(r for r in group if r.method == primary)
        refs = [r for r in group if not r.method.startswith("pipesplit")]
        ratio = {r.method: paired(mine, r) for r in refs}
        best = min(refs, key=lambda r: ratio[r.method][0])  # the reference closest to pipesplit, round by round
        # No split of this model into k stages can have a bottleneck below an even share of
        # its work: the smallest measured total over the methods' splits, divided by k.
        bound = min(sum(r.stage_ms) for r in group) / key[1]
        # Nor below the one operation that pipesplit's bottleneck stage may consist of
        # (every split has a stage holding it): then pipesplit's split is optimal.
        hot = set(mine.stage_nodes[int(np.argmax(mine.stage_ms))])
        single = [n for n in hot if not n.startswith(("getitem", "sym_size"))]
        atomic = single[0] if len(single) == 1 else None
        if atomic is not None:
            bound = max(bound, mine.bottleneck_ms)
        # A reference with a stage that holds all of pipesplit's bottleneck stage does at
        # least that work in it: no worse whatever the measurement noise.
        contains = {r.method: any(hot <= set(st) for st in r.stage_nodes) for r in refs}
        out[key] = {
            "mine": mine, "best": best, "bound": bound, "atomic": atomic, "ratio": ratio[best.method],
            "gain": ratio[best.method][0] - 1.0,
            # the most any split could gain on the best reference
            "headroom": best.bottleneck_ms / bound - 1.0,
            "no_worse": all(ratio[r.method][0] >= 1.0 for r in refs),
            "no_worse_by_containment": all(ratio[r.method][0] >= 1.0 or contains[r.method] for r in refs),
            # the interval of the paired median reaches 1: the data cannot tell the two apart
            "within_noise": all(ratio[r.method][2] >= 1.0 or contains[r.method] for r in refs),
            "no_worse_steps": all(mine.step_1f1b_ms <= r.step_1f1b_ms and mine.step_zbh1_ms <= r.step_zbh1_ms
                                  for r in refs),
            "steps_within_noise": all(
                max(mine.step_1f1b_ms / r.step_1f1b_ms, mine.step_zbh1_ms / r.step_zbh1_ms) <= 1 + max(mine.noise, r.noise)
                for r in refs),
            "no_worse_mem": all(mine.peak_mem_mb <= r.peak_mem_mb for r in refs),
            # memory against the reference whose bottleneck comes closest (the fastest one)
            "fastest": min(refs, key=lambda r: r.bottleneck_ms),
        }
    return out


def tables(rows: list[Row], primary: str) -> str:
    out = []
    ver = verdicts(rows, primary)
    for model in dict.fromkeys(r.model for r in rows):
        out.append(f"#### {model}: {MODEL_BY_NAME[model].description}\n")
        body = []
        for r in (r for r in rows if r.model == model):
            mine = ver[(r.model, r.stages)]["mine"]
            rel = paired(mine, r)[0]
            body.append([
                r.stages, r.method if r.method != primary else f"**{r.method}**", r.split,
                f"{r.bottleneck_ms:.1f}", f"{r.noise * 100:.0f}%", f"{rel:.2f}", f"{r.step_1f1b_ms:.0f}",
                f"{r.step_zbh1_ms:.0f}", f"{r.peak_mem_mb:.0f}",
            ])
        out.append(markdown_table(
            ["stages", "method", "stages start at", "bottleneck F+B ms", "noise", f"÷ {primary}, paired", "1F1B step ms",
             "ZB-H1 step ms", "peak stage MiB"], body, "rllrrrrrr"))
        out.append("")
    return "\n".join(out)


def summary(rows: list[Row], primary: str) -> str:
    ver = verdicts(rows, primary)
    body = []
    for (model, k), v in ver.items():
        hetero = MODEL_BY_NAME[model].heterogeneous
        if not hetero:
            ten = "-"
        elif v["gain"] >= 0.10:
            ten = "yes"
        elif v["atomic"] is not None:
            ten = f"out of reach: the bottleneck is one operation (`{v['atomic']}`)"
        elif v["headroom"] < 0.10:
            ten = f"out of reach: best reference {v['headroom'] * 100:+.1f}% over the bound"
        else:
            ten = "**no**"
        body.append([
            model, "yes" if hetero else "no", k,
            f"{v['mine'].bottleneck_ms:.1f}", f"{v['best'].bottleneck_ms:.1f} ({v['best'].method})",
            f"{v['bound']:.1f}", f"{v['gain'] * 100:+.1f}% [{(v['ratio'][1] - 1) * 100:+.0f}, {(v['ratio'][2] - 1) * 100:+.0f}]",
            f"{v['mine'].noise * 100:.0f}% / {v['best'].noise * 100:.0f}%",
            "yes" if v["no_worse"] else (
                "yes: its stage is inside theirs" if v["no_worse_by_containment"]
                else "within noise" if v["within_noise"] else "**no**"), ten,
            "yes" if v["no_worse_steps"] else "within noise" if v["steps_within_noise"] else "**no**",
            f"{v['mine'].peak_mem_mb:.0f} / {v['fastest'].peak_mem_mb:.0f} ({v['fastest'].method})",
            "yes" if v["no_worse_mem"] else "no",
        ])
    return markdown_table(
        ["model", "heterogeneous", "stages", f"{primary} bottleneck ms", "best reference ms", "bound ms",
         "reference / pipesplit - 1, paired by round [95% CI]", "noise (pipesplit / best ref.)", "bottleneck no worse than every reference",
         ">= 10% better (heterogeneous)", "1F1B and ZB-H1 steps no worse",
         "peak stage MiB: pipesplit / fastest reference", "peak memory no larger than every reference"],
        body, "llrrlrrrlllrl")


def predicted_vs_measured(rows: list[Row]) -> str:
    body = []
    for r in rows:
        if r.planned_1f1b_ms:
            body.append([r.model, r.stages, r.method, f"{r.planned_1f1b_ms:.0f}", f"{r.step_1f1b_ms:.0f}",
                         f"{r.step_1f1b_ms / r.planned_1f1b_ms:.2f}"])
    return markdown_table(["model", "stages", "method", "planner's 1F1B step ms", "from measured stages ms",
                           "measured / planned"], body, "lrlrrr")


def plot(rows: list[Row], path_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(path_dir, exist_ok=True)
    paths = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        ks = sorted({r.stages for r in mine})
        methods = list(dict.fromkeys(r.method for r in mine))
        fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=90)
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            ys = [next(r.bottleneck_ms for r in mine if r.stages == k and r.method == m) for k in ks]
            ax.bar(np.arange(len(ks)) + (j - (len(methods) - 1) / 2) * width, ys, width, label=m,
                   edgecolor="black" if m.startswith("pipesplit") else None, linewidth=0.8)
        ax.set_xticks(np.arange(len(ks)), [f"{k} stages" for k in ks])
        ax.set_ylabel("bottleneck stage F+B (ms)")
        ax.set_title(f"{model}: measured bottleneck per method (lower is better)", fontsize=10)
        ax.legend(fontsize=7, ncol=4, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.1))
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = os.path.join(path_dir, f"planner_{model}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def render(path: str, plots: str) -> int:
    """The summary, per-model tables and plots of a saved run, without measuring anything."""
    with open(path) as f:
        rows = [Row(**d) for d in json.load(f)]
    methods = {r.method for r in rows}
    primary = next((f"pipesplit ({c})" for c in PIPESPLIT_COSTS if f"pipesplit ({c})" in methods), rows[0].method)
    emit_tables(rows, primary)
    emit_plots(rows, plots)
    return 0


def emit_tables(rows: list[Row], primary: str) -> None:
    emit("#### Summary\n")
    emit(summary(rows, primary))
    emit()
    emit(tables(rows, primary))
    emit("#### pipesplit's own prediction against the measured stages\n")
    emit(predicted_vs_measured(rows))


def emit_plots(rows: list[Row], plots: str) -> None:
    paths = plot(rows, plots)
    emit("\nPlots: " + ", ".join(f"`{os.path.relpath(p, os.path.dirname(HERE))}`" for p in paths))
