"""Recording when each pipeline action ran: measured timelines and Chrome traces.

``with pipe.trace() as tr: pipe.step(...)`` makes every stage worker note, per action,
when its rank picked it up (``start``), when its inputs had arrived (``ready``: the
receives before the compute are done) and when it finished (``end``), all from
``time.perf_counter``. On a CUDA stage the worker synchronises its stream before
reading the end time, so device work is counted where it ran; that sync only happens
while tracing. Without a trace the workers do nothing extra.

>>> import torch, pipesplit
>>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
>>> prog = pipesplit.compile(model, torch.randn(4, 8), num_stages=2)
>>> pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=lambda o, y: o.square().mean())
>>> with pipe.trace() as tr:
...     _ = pipe.step(torch.randn(4, 8))
>>> tr.num_steps, len(tr.records)
(1, 8)
>>> [str(e.action) for e in tr.timeline().events[1]]
['1F0', '1B0', '1F1', '1B1']
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from dataclasses import dataclass
from typing import Any

from pipesplit.errors import PipesplitError
from pipesplit.schedules import Action, ActionKind, Schedule, StageCost, TimedAction, Timeline
from pipesplit.deprecation import renamed_attribute


@dataclass(frozen=True)
class ActionRecord:
    """One action as it ran; times are ``time.perf_counter`` seconds."""

    step: int
    """Index of the traced step (0 for the first step inside the ``trace()`` block)."""
    rank: int
    action: Action
    start: float
    """The rank picked the action up."""
    ready: float
    """Its received inputs had arrived; the compute ran from here to ``end``."""
    end: float

    @property
    def wait(self) -> float:
        """Seconds blocked on receives before the compute could start."""
        return self.ready - self.start

    @property
    def compute(self) -> float:
        """Seconds of compute (from ``ready`` to ``end``)."""
        return self.end - self.ready


class Trace:
    """Action timings of the steps a :class:`~pipesplit.Pipeline` ran inside ``pipe.trace()``."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.records: list[ActionRecord] = []
        self.steps: list[tuple[float, float]] = []  # (begin, end) of each traced step, perf_counter seconds
        self._lock = threading.Lock()  # worker threads of the local executor record concurrently

    # ------------------------------------------------------------- recording
    def begin_step(self, now: float) -> None:
        self.steps.append((now, now))

    def end_step(self, now: float) -> None:
        if self.steps:
            self.steps[-1] = (self.steps[-1][0], now)

    def record(self, rank: int, action: Action, start: float, ready: float, end: float) -> None:
        rec = ActionRecord(max(len(self.steps) - 1, 0), rank, action, start, max(start, min(ready, end)), end)
        with self._lock:
            self.records.append(rec)

    # --------------------------------------------------------------- reading
    n_steps = renamed_attribute("n_steps", "num_steps")

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def step_time(self, step: int = -1) -> float:
        """Wall seconds of a traced step, from the call into the runtime to its return."""
        begin, end = self.steps[self._step(step)]
        return end - begin

    def _step(self, step: int) -> int:
        if not self.steps:
            raise PipesplitError("the trace holds no steps: run pipe.step(...) inside `with pipe.trace() as tr:`.")
        if not -len(self.steps) <= step < len(self.steps):
            raise PipesplitError(f"step {step} is out of range: the trace holds {len(self.steps)} step(s).")
        return step % len(self.steps)

    def timeline(self, step: int = -1) -> Timeline:
        """The measured :class:`~pipesplit.schedules.Timeline` of one step (compute spans, from ``ready``).

        Times count from the step's start, so ``to_text``, ``plot``, ``step_time`` and
        ``bubble_fraction`` read like the simulator's prediction of the same schedule.
        """
        index = self._step(step)
        begin = self.steps[index][0]
        ranks: list[list[TimedAction]] = [[] for _ in range(self.schedule.num_ranks)]
        for r in self.records:
            if r.step == index and r.rank < len(ranks):
                ranks[r.rank].append(TimedAction(r.action, r.ready - begin, r.end - begin))
        events = tuple(tuple(sorted(rank, key=lambda e: e.start)) for rank in ranks)
        return Timeline(self.schedule, events, unit="s")

    def durations(self, stage: int, kind: ActionKind | str) -> list[float]:
        """Compute seconds of every traced action of ``kind`` (``"F"``, ``"B"``, ...) on ``stage``."""
        kind = ActionKind(kind)
        return [r.compute for r in self.records if r.action.stage == stage and r.action.kind is kind]

    def median(self, stage: int, kind: ActionKind | str) -> float | None:
        """Median compute seconds of ``kind`` actions on ``stage``; None if none ran."""
        found = self.durations(stage, kind)
        return statistics.median(found) if found else None

    def stage_costs(self) -> list[StageCost]:
        """Per stage, the median seconds of its traced F, I and W: the stage costs as the pipeline
        ran them (:func:`~pipesplit.runtime.engine.measure.measure_stage_costs` times them in isolation).

        Over every traced step; a fused backward (``B``) counts as ``backward_input``
        (:meth:`~pipesplit.schedules.StageCost.of_spans`).
        """
        return StageCost.of_spans(self.schedule.num_stages, ((r.action, r.compute) for r in self.records))

    def to_chrome(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The trace in Chrome's trace-event format (chrome://tracing, https://ui.perfetto.dev).

        One process per rank and one thread per stage; each action is a complete
        (``"ph": "X"``) event named like ``2F0``, preceded by a ``wait`` event while it
        blocked on receives. Written as JSON to ``path`` when given.
        """
        if not self.records:
            raise PipesplitError("the trace holds no actions: run pipe.step(...) inside `with pipe.trace() as tr:`.")
        origin = self.steps[0][0] if self.steps else min(r.start for r in self.records)

        def us(t: float) -> float:
            return round((t - origin) * 1e6, 3)

        events: list[dict[str, Any]] = []
        rank_of = self.schedule.stage_to_rank
        for rank in range(self.schedule.num_ranks):
            events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            for stage in (s for s in range(self.schedule.num_stages) if rank_of[s] == rank):
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": stage,
                               "args": {"name": f"stage {stage}"}})
        steps_pid = self.schedule.num_ranks
        events.append({"ph": "M", "name": "process_name", "pid": steps_pid, "args": {"name": "steps"}})
        for i, (begin, end) in enumerate(self.steps):
            events.append({"ph": "X", "name": f"step {i}", "cat": "step", "pid": steps_pid, "tid": 0,
                           "ts": us(begin), "dur": round((end - begin) * 1e6, 3)})
        for r in sorted(self.records, key=lambda r: r.start):
            common = {"pid": r.rank, "tid": r.action.stage}
            if r.wait > 0:
                events.append({**common, "ph": "X", "name": "wait", "cat": "wait", "ts": us(r.start),
                               "dur": round(r.wait * 1e6, 3)})
            events.append({**common, "ph": "X", "name": str(r.action), "cat": r.action.kind.name.lower(),
                           "ts": us(r.ready), "dur": round(r.compute * 1e6, 3),
                           "args": {"step": r.step, "microbatch": r.action.microbatch}})
        trace = {"traceEvents": events, "displayTimeUnit": "ms",
                 "otherData": {"schedule": self.schedule.name, "num_microbatches": self.schedule.num_microbatches}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace
