"""The result of a simulation: timed actions per rank, bubble, peak activations, charts."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.costs import StageCost
from pipesplit.schedules.schedule import Schedule
from pipesplit.units import human_seconds

TEXT_LEGEND = "F forward, B backward, I input grad, W weight grad, . idle; lower case: odd microbatches (1, 3, ...)"
"""What the letters of :meth:`Timeline.to_text` mean."""

_RELEASES = (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_WEIGHT)
_COLOURS = {
    ActionKind.FORWARD: "#4c72b0",
    ActionKind.FULL_BACKWARD: "#dd8452",
    ActionKind.BACKWARD_INPUT: "#c44e52",
    ActionKind.BACKWARD_WEIGHT: "#55a868",
}


class TimedAction(NamedTuple):
    """One action as simulated: it occupied its rank from ``start`` to ``end``."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Simulated execution of a schedule (see :func:`pipesplit.schedules.simulate`)."""

    schedule: Schedule
    """The schedule that was simulated."""
    events: tuple[tuple[TimedAction, ...], ...]
    """Per rank, every action (compute and communication) with its start and end, in order."""
    unit: str = ""
    """What the times are in: ``"s"`` (a trace, a prediction), ``"ms"``, or ``""``: the unit of the
    stage costs :func:`~pipesplit.schedules.simulate` was given (printed as "time units")."""

    @cached_property
    def step_time(self) -> float:
        """Time from the first action's start (0) to the last action's end."""
        return max((e.end for rank in self.events for e in rank), default=0.0)

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Per rank, time spent computing (SEND/RECV waiting counts as idle)."""
        return tuple(sum(e.end - e.start for e in rank if e.action.is_compute) for rank in self.events)

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank, step_time minus busy time."""
        return tuple(self.step_time - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all rank-time: 1 - sum(busy) / (num_ranks x step_time)."""
        total = self.schedule.num_ranks * self.step_time
        return 0.0 if total == 0 else 1.0 - sum(self.busy) / total

    def stage_costs(self) -> list[StageCost]:
        """Per stage, the mean span of its F, I and W actions in this timeline: what an action
        took as simulated (or as traced, for a :meth:`~pipesplit.runtime.engine.trace.Trace.timeline`).
        Means, so that a stage's microbatches times its F + B is the time it computed."""
        spans = ((e.action, e.end - e.start) for rank in self.events for e in rank if e.action.is_compute)
        return StageCost.of_spans(self.schedule.num_stages, spans, statistics.fmean)

    @cached_property
    def peak_activations(self) -> tuple[int, ...]:
        """Per rank, the most (stage, microbatch) activations alive at once.

        An activation is held from the start of its forward until its stage's full
        backward B ends or, for split backwards, until the weight-gradient W ends (W
        still needs the stage inputs). A rank runs one action at a time, so this only
        depends on the rank's order, not on costs. With v stages per rank each unit is
        about 1/v of a one-stage-per-rank activation.
        """
        peaks = []
        for rank in self.events:
            alive = peak = 0
            for event in rank:
                if event.action.kind is ActionKind.FORWARD:
                    alive += 1
                    peak = max(peak, alive)
                elif event.action.kind in _RELEASES:
                    alive -= 1
            peaks.append(peak)
        return tuple(peaks)

    def of(self, action: Action | str) -> TimedAction:
        """The timed entry of ``action`` (an Action or text such as ``"1F0"``)."""
        wanted = action if isinstance(action, Action) else Action.parse(action)
        for rank in self.events:
            for event in rank:
                if event.action == wanted:
                    return event
        raise ScheduleError(f"{wanted} is not in schedule {self.schedule.name!r}.")

    def format_time(self, t: float) -> str:
        """``t`` with its unit: ``217 ms`` for seconds, ``27 time units`` for a simulation's own unit."""
        if self.unit == "s":
            return human_seconds(t)
        return f"{t:.4g} {self.unit or 'time units'}"

    def to_text(self, width: int = 80) -> str:
        """ASCII Gantt chart, one line per rank, at most ``width`` columns spanning the step.

        When every action starts and ends on a multiple of the shortest one (a simulation with
        whole-number costs), each such quantum gets the same whole number of columns, so equal
        actions are drawn equally wide; otherwise the ``width`` columns split the step evenly.

        Letters are the action kinds (F, B, I, W), upper case for even and lower case for
        odd microbatches so neighbours stay distinguishable; ``.`` is idle.

        >>> from pipesplit.schedules import get_schedule, simulate
        >>> print(simulate(get_schedule("gpipe", num_ranks=2, num_microbatches=2), 1.0).to_text(width=9))
        ... # doctest: +NORMALIZE_WHITESPACE
        gpipe: 2 ranks, 2 stages, 2 microbatches; step 9 time units, bubble 33.3%
        rank 0 |Ff...BBbb|
        rank 1 |.FfBBbb..|
        """
        if not isinstance(width, int) or width < 1:
            raise ScheduleError(f"to_text: width must be an int >= 1, got {width!r}.")
        s = self.schedule
        lines = [
            f"{s.name}: {s.num_ranks} ranks, {s.num_stages} stages, {s.num_microbatches} microbatches; "
            f"step {self.format_time(self.step_time)}, bubble {100 * self.bubble_fraction:.1f}%"
        ]
        width = self._grid_width(width)
        label = len(str(s.num_ranks - 1))
        for rank, events in enumerate(self.events):
            lines.append(f"rank {rank:>{label}} |{self._row(events, width)}|")
        return "\n".join(lines)

    def _grid_width(self, width: int) -> int:
        """``width``, or fewer columns that give each quantum (the shortest action) the same whole number."""
        spans = [e.end - e.start for rank in self.events for e in rank if e.action.is_compute and e.end > e.start]
        if not spans or self.step_time <= 0:
            return width
        quantum = min(spans)
        times = [t for rank in self.events for e in rank if e.action.is_compute for t in (e.start, e.end)]
        units = self.step_time / quantum
        if any(abs(t / quantum - round(t / quantum)) > 1e-6 for t in times + [self.step_time]) or units > width:
            return width
        return int(width // round(units)) * round(units)

    def _row(self, events: tuple[TimedAction, ...], width: int) -> str:
        if self.step_time <= 0:
            return "." * width
        column = self.step_time / width
        best = [(0.0, ".")] * width
        for event in events:
            if not event.action.is_compute or event.end <= event.start:
                continue
            letter = event.action.kind.value
            if event.action.microbatch % 2:
                letter = letter.lower()
            first = min(width - 1, int(event.start / column))
            last = min(width - 1, int(event.end / column))
            for c in range(first, last + 1):
                overlap = min(event.end, (c + 1) * column) - max(event.start, c * column)
                if overlap > best[c][0]:
                    best[c] = (overlap, letter)
        return "".join(letter if overlap >= column / 2 else "." for overlap, letter in best)

    def __str__(self) -> str:
        return self.to_text()

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Save a Gantt chart of the timeline as a PNG at ``path`` and return the path.

        Uses matplotlib's Agg canvas directly (no pyplot, no global backend change).

        >>> from pipesplit.schedules import get_schedule, simulate
        >>> import tempfile, os
        >>> t = simulate(get_schedule("1f1b", num_ranks=2, num_microbatches=4), 1.0)
        >>> t.plot(os.path.join(tempfile.mkdtemp(), "1f1b.png")).suffix
        '.png'
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        longest = max(map(len, self.events), default=0)
        fig = Figure(figsize=(max(6.0, 0.12 * longest), 0.6 * self.schedule.num_ranks + 1.4))
        FigureCanvasAgg(fig)
        self.draw(fig.add_subplot(), title=title)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, format="png", dpi=120)
        return out

    def draw(self, ax: Any, *, title: str | None = None, xlabel: str | None = None) -> None:
        """Draw the Gantt chart onto a matplotlib ``Axes`` (one row per rank); the time axis says its unit."""
        from matplotlib.patches import Patch

        s = self.schedule
        for rank, events in enumerate(self.events):
            for event in events:
                if not event.action.is_compute:
                    continue
                duration = event.end - event.start
                ax.broken_barh(
                    [(event.start, duration)], (rank - 0.4, 0.8),
                    facecolors=_COLOURS[event.action.kind], edgecolor="white", linewidth=0.5,
                )
                if self.step_time and duration / self.step_time > 0.012:
                    ax.text(event.start + duration / 2, rank, str(event.action.microbatch),
                            ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(s.num_ranks), [f"rank {r}" for r in range(s.num_ranks)])
        ax.set_ylim(s.num_ranks - 0.5, -0.5)
        ax.set_xlim(0, self.step_time or 1.0)
        ax.set_xlabel(xlabel or f"time ({self.unit or 'time units'})")
        ax.set_title(title or f"{s.name}: p={s.num_ranks}, m={s.num_microbatches}, "
                     f"step {self.format_time(self.step_time)}, bubble {100 * self.bubble_fraction:.1f}%")
        used = {e.action.kind for rank in self.events for e in rank if e.action.is_compute}
        ax.legend(handles=[Patch(color=c, label=k.name.lower()) for k, c in _COLOURS.items() if k in used],
                  loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=7, frameon=False)
