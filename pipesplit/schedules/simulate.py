"""Event-driven simulation of a schedule with per-stage compute and per-cut transfer costs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action
from pipesplit.schedules.costs import StageCost
from pipesplit.schedules.execute import Transfer, execute
from pipesplit.schedules.schedule import Schedule
from pipesplit.schedules.timeline import Timeline, TimedAction
from pipesplit.schedules.validate import validate


CostLike = Union[float, int, StageCost]


def simulate(
    schedule: Schedule,
    stage_costs: CostLike | Sequence[CostLike],
    comm_cost: float | Sequence[float] = 0.0,
    *,
    overlap: float = 0.0,
) -> Timeline:
    """Simulate ``schedule`` and return its :class:`Timeline`.

    ``stage_costs`` gives, per stage, a :class:`StageCost` or a number (the forward time;
    backward = 2 x forward, I = W = forward); a single value applies to every stage.
    ``comm_cost`` is the transfer time across each cut between stages on different ranks:
    one number for every cut or one per boundary (entry s is between stages s and s+1);
    hand-offs within a rank are free. Each rank runs its list in order; an action starts
    when its rank is free and its inputs have arrived. With SEND/RECV actions present a
    send takes no rank time and a recv holds its rank until the data arrives.

    ``overlap`` prices the schedule's overlapped pairs (:attr:`Schedule.overlap`, e.g.
    DualPipeV's F&B chunks): the share of the shorter action of a pair hidden behind the
    longer one: a pair starts once both actions' inputs are ready and takes
    ``max(f, b) + (1 - overlap) * min(f, b)``. 0 (the default) runs them as two separate
    actions, as pipesplit's executors do; 1 runs them fully concurrently, as DualPipe
    assumes when one chunk's communication hides behind the other's compute. Schedules
    without pairs are unaffected.

    >>> from pipesplit.schedules import get_schedule
    >>> t = simulate(get_schedule("1f1b", num_ranks=4, num_microbatches=8), 1.0)
    >>> t.step_time, round(t.bubble_fraction, 4)
    (33.0, 0.2727)
    """
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0.0 <= overlap <= 1.0:
        raise ScheduleError(
            f"simulate: overlap must be a number from 0 (pairs run back to back) to 1 (fully "
            f"overlapped), got {overlap!r}."
        )
    validate(schedule)
    costs = stage_costs_of(schedule, stage_costs)
    cuts = cut_costs(schedule, comm_cost)

    def duration(action: Action) -> float:
        return costs[action.stage].of(action.kind)

    transfer = transfers(schedule, cuts)

    def paired(forward: Action, backward: Action) -> float:
        a, b = duration(forward), duration(backward)
        return max(a, b) + (1.0 - overlap) * min(a, b)

    run = execute(schedule, duration, transfer, paired if overlap > 0 else None)
    events = tuple(tuple(TimedAction(a, s, e) for a, s, e in rank) for rank in run.timed)
    return Timeline(schedule, events)


def transfers(schedule: Schedule, cuts: Sequence[float]) -> Transfer:
    """The delay from a dependency's end to an action's use of it: the cut's cost between
    stages on different ranks, nothing within a rank."""

    def transfer(dep: Action, action: Action) -> float:
        if dep.stage == action.stage or not schedule.crosses_ranks(dep.stage, action.stage):
            return 0.0
        return cuts[min(dep.stage, action.stage)]

    return transfer


def stage_costs_of(schedule: Schedule, stage_costs: CostLike | Sequence[CostLike]) -> tuple[StageCost, ...]:
    items = (
        [stage_costs] * schedule.num_stages
        if isinstance(stage_costs, (int, float, StageCost))
        else list(stage_costs)
    )
    if len(items) != schedule.num_stages:
        raise ScheduleError(
            f"simulate: got {len(items)} stage costs for {schedule.num_stages} stages of {schedule.name!r}; "
            "give one number or StageCost per stage (or a single value for all)."
        )
    out = []
    for stage, item in enumerate(items):
        if isinstance(item, StageCost):
            out.append(item)
        elif isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item) and item >= 0:
            out.append(StageCost.from_forward(float(item)))
        else:
            raise ScheduleError(
                f"simulate: cost of stage {stage} is {item!r}; expected a finite number >= 0 (forward "
                "time) or a StageCost(forward, backward_input, backward_weight)."
            )
    return tuple(out)


def cut_costs(schedule: Schedule, comm_cost: float | Sequence[float]) -> tuple[float, ...]:
    num_cuts = schedule.num_stages - 1
    items = [comm_cost] * num_cuts if isinstance(comm_cost, (int, float)) else list(comm_cost)
    if len(items) != num_cuts:
        raise ScheduleError(
            f"simulate: got {len(items)} comm costs for {num_cuts} stage boundaries of {schedule.name!r}; "
            "give one number, or one per boundary (entry s is between stages s and s+1)."
        )
    for cut, value in enumerate(items):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ScheduleError(
                f"simulate: comm cost of boundary {cut} (stages {cut}->{cut + 1}) is {value!r}; "
                "expected a finite number >= 0."
            )
    return tuple(float(v) for v in items)
