"""Benchmark pictures (matplotlib's Agg canvas, no pyplot): Gantt pairs, stage balance, step times."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Sequence

from pipesplit.errors import PipesplitError

if TYPE_CHECKING:
    from pipesplit.bench.result import BenchRow
    from pipesplit.schedules import Timeline

_PRED, _MEAS = "#9ecae1", "#e6550d"


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike[str]) -> str:
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    return os.fspath(path)


def _need_rows(rows: Sequence[Any]) -> None:
    if not rows:
        raise PipesplitError("nothing to plot: the benchmark has no rows.")


def plot_timelines(predicted: "Timeline", measured: "Timeline", path: str | os.PathLike[str], label: str = "",
                   *, measured_title: str = "", summary: str = "") -> str:
    """The predicted (top) and measured (bottom) Gantt charts of one configuration, in milliseconds."""
    return _save(timelines_figure(predicted, measured, label, measured_title=measured_title, summary=summary), path)


def timelines_figure(predicted: "Timeline", measured: "Timeline", label: str = "",
                     *, measured_title: str = "", summary: str = "") -> Any:
    """The figure of :func:`plot_timelines`: both charts on one time axis. ``measured_title`` (which
    step is drawn) and ``summary`` (the figure title) replace the ones read off the two charts."""
    from pipesplit.schedules import Timeline

    def in_ms(t: Timeline) -> Timeline:
        events = tuple(tuple(e._replace(start=e.start * 1e3, end=e.end * 1e3) for e in rank) for rank in t.events)
        return Timeline(t.schedule, events, unit="ms")

    def title(t: Timeline, what: str) -> str:
        return f"{what} step {t.step_time * 1e3:.3g} ms, bubble {100 * t.bubble_fraction:.0f}%"

    n = predicted.schedule.num_ranks
    longest = max(map(len, predicted.events), default=0)
    fig = _figure(max(7.0, 0.12 * longest), 2 * (0.55 * n + 1.3) + 0.3)
    top, bottom = fig.subplots(2, 1, sharex=True)  # one time scale: a slow measurement must look slow
    prefix = label + ": " if label else ""
    in_ms(predicted).draw(top, title=prefix + title(predicted, "predicted"))
    in_ms(measured).draw(bottom, title=measured_title or prefix + title(measured, "measured"))
    top.set_xlim(0, max(predicted.step_time, measured.step_time) * 1e3 or 1.0)  # draw() fitted each to its own
    top.tick_params(labelbottom=True)
    ratio = f"{measured.step_time / predicted.step_time:.2f}x" if predicted.step_time > 0 else "n/a"
    fig.suptitle(summary or f"measured / predicted step time: {ratio}", fontsize=10)
    return fig


def plot_balance(rows: Sequence["BenchRow"], path: str | os.PathLike[str], max_panels: int = 24) -> str:
    """Per configuration, each stage's predicted and measured F + B time over the stage mean."""
    _need_rows(rows)
    rows = list(rows)[:max_panels]
    cols = min(4, len(rows))
    lines = math.ceil(len(rows) / cols)
    fig = _figure(3.2 * cols, 2.4 * lines + 0.4)
    axes = fig.subplots(lines, cols, squeeze=False)
    for ax, r in zip(axes.flat, rows):
        stages = range(r.num_stages)
        for offset, values, colour, what in ((-0.2, r.predicted_stage_s, _PRED, "predicted"),
                                             (0.2, r.measured_stage_s, _MEAS, "measured")):
            mean = sum(values) / len(values) if values else 0.0
            rel = [v / mean if mean > 0 else 0.0 for v in values]
            ax.bar([s + offset for s in stages], rel, width=0.4, color=colour, label=what)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(list(stages), [str(s) for s in stages])
        ax.set_title(f"{r.label}\ntime balance {r.predicted_balance:.2f} pred, {r.balance:.2f} meas", fontsize=8)
        ax.set_xlabel("stage", fontsize=8)
        ax.set_ylabel("time / mean", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(rows):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    return _save(fig, path)


def plot_overview(rows: Sequence["BenchRow"], path: str | os.PathLike[str]) -> str:
    """Per configuration: predicted and measured step time (with the repeats' spread) and bubble."""
    _need_rows(rows)
    n = len(rows)
    fig = _figure(11.0, 0.32 * n + 1.6)
    left, right = fig.subplots(1, 2, sharey=True)
    ys = list(range(n))
    left.barh([y - 0.2 for y in ys], [r.predicted_step_s * 1e3 for r in rows], height=0.4, color=_PRED,
              label="predicted")
    left.barh([y + 0.2 for y in ys], [r.measured_step_s * 1e3 for r in rows], height=0.4, color=_MEAS,
              xerr=[r.measured_step_spread_s * 1e3 for r in rows], label="measured (median, ± half range)")
    left.set_xlabel("step time (ms)")
    left.set_yticks(ys, [r.label for r in rows], fontsize=7)
    left.invert_yaxis()
    left.legend(fontsize=7)
    right.barh([y - 0.2 for y in ys], [100 * r.predicted_bubble for r in rows], height=0.4, color=_PRED,
               label="predicted")
    right.barh([y + 0.2 for y in ys], [100 * r.measured_bubble for r in rows], height=0.4, color=_MEAS,
               label="measured")
    right.set_xlabel("bubble (% of rank time idle)")
    right.set_xlim(0, 100)
    right.legend(fontsize=7)
    return _save(fig, path)
