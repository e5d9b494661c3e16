"""Dependency rules between actions and the in-order executor shared by validate and simulate."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.schedule import Schedule

F = ActionKind.FORWARD
B = ActionKind.FULL_BACKWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - the paper's name for the input-gradient pass
W = ActionKind.BACKWARD_WEIGHT

Duration = Callable[[Action], float]
"""Seconds an action occupies its rank."""
Transfer = Callable[[Action, Action], float]
"""Delay between the end of a dependency (first argument) and when the action may use it."""
PairDuration = Callable[[Action, Action], float]
"""Seconds an overlapped ``(forward, backward)`` pair occupies its rank."""


def backward_index(schedule: Schedule) -> dict[tuple[int, int], Action]:
    """Map ``(stage, microbatch)`` to the action producing its input gradient (``B`` or ``I``)."""
    return {
        (a.stage, a.microbatch): a
        for rank in schedule.actions
        for a in rank
        if a.kind.is_backward
    }


def requirements(
    action: Action,
    schedule: Schedule,
    backward_of: Mapping[tuple[int, int], Action],
) -> tuple[Action, ...]:
    """The actions that must have finished before ``action`` may start.

    Without SEND/RECV actions, cross-rank hand-offs are implicit: ``F(s,m)`` waits on
    ``F(s-1,m)`` and ``B/I(s,m)`` on ``B/I(s+1,m)`` wherever they run. With them, a
    cross-rank consumer waits on its local RECV, and the RECV waits on the peer's SEND.
    """
    s, m, kind = action.stage, action.microbatch, action.kind
    comm = schedule.has_communication
    last = schedule.num_stages - 1

    def grad_of(stage: int) -> Action:
        return backward_of.get((stage, m), Action(stage, B, m))

    if kind is F:
        if s == 0:
            return ()
        if comm and schedule.crosses_ranks(s, s - 1):
            return (Action(s, ActionKind.RECV_F, m),)
        return (Action(s - 1, F, m),)
    if kind.is_backward:
        if s == last:
            return (Action(s, F, m),)
        if comm and schedule.crosses_ranks(s, s + 1):
            return (Action(s, F, m), Action(s, ActionKind.RECV_B, m))
        return (Action(s, F, m), grad_of(s + 1))
    if kind is W:
        return (Action(s, I, m),)
    if kind is ActionKind.SEND_F:
        return (Action(s, F, m),)
    if kind is ActionKind.SEND_B:
        return (grad_of(s),)
    # RECV_F / RECV_B wait on the peer's matching send.
    return (action.matching(),)


def paired_with(schedule: Schedule, rank: int, pos: int) -> Action | None:
    """The overlap partner of the action at ``(rank, pos)`` if it comes right after it, else None.

    Such a pair runs as one unit: it starts once the inputs of both actions are ready.
    """
    actions = schedule.actions[rank]
    partner = schedule.overlap_partner.get(actions[pos])
    if partner is not None and pos + 1 < len(actions) and actions[pos + 1] == partner:
        return partner
    return None


def unit_requirements(
    schedule: Schedule, rank: int, pos: int, backward_of: Mapping[tuple[int, int], Action]
) -> tuple[Action, ...]:
    """What the action at ``(rank, pos)`` waits on, with its overlap partner's needs if paired."""
    action = schedule.actions[rank][pos]
    partner = paired_with(schedule, rank, pos)
    unit = (action,) if partner is None else (action, partner)
    return tuple(n for a in unit for n in requirements(a, schedule, backward_of))


@dataclass(frozen=True)
class Execution:
    """Outcome of running every rank's list in order until nothing more can run."""

    timed: tuple[tuple[tuple[Action, float, float], ...], ...]
    """Per rank, the actions that ran as ``(action, start, end)``, in order."""
    blocked: tuple[int | None, ...]
    """Per rank, the position of the first action that could not run (``None``: all ran)."""

    @property
    def complete(self) -> bool:
        return all(pos is None for pos in self.blocked)


def execute(
    schedule: Schedule, duration: Duration, transfer: Transfer, paired: PairDuration | None = None
) -> Execution:
    """Run each rank's actions in list order, each as soon as its rank and inputs are ready.

    Sends never block; a RECV occupies its rank from when the rank reaches it until the
    data arrives. With ``paired`` given, an overlapped pair (:attr:`Schedule.overlap`,
    partners adjacent) starts once both actions' inputs are ready, occupies the rank for
    ``paired(f, b)``, shared in proportion to the durations in ``timed``, and both results
    are available when it ends; without it, pairs run as two actions. The result does not
    depend on the order ranks are visited in: a unit's start only depends on its
    predecessor on the rank and on its requirements. Actions must be unique (``validate``
    checks that first).
    """
    backward_of = backward_index(schedule)
    end: dict[Action, float] = {}
    timed: list[list[tuple[Action, float, float]]] = [[] for _ in schedule.actions]
    pointer = [0] * schedule.num_ranks
    free = [0.0] * schedule.num_ranks
    waiting: dict[Action, list[int]] = {}  # missing requirement -> ranks whose head waits on it
    ready_ranks = deque(range(schedule.num_ranks))
    while ready_ranks:
        rank = ready_ranks.popleft()
        actions = schedule.actions[rank]
        while pointer[rank] < len(actions):
            action = actions[pointer[rank]]
            partner = None if paired is None else paired_with(schedule, rank, pointer[rank])
            unit = (action,) if partner is None else (action, partner)
            needs = [(n, a) for a in unit for n in requirements(a, schedule, backward_of)]
            missing = next((n for n, _ in needs if n not in end), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            ready = max((end[n] + transfer(n, a) for n, a in needs), default=0.0)
            if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                start, finish = free[rank], max(free[rank], ready)
                timed[rank].append((action, start, finish))
            elif partner is None:
                start = max(free[rank], ready)
                finish = start + duration(action)
                timed[rank].append((action, start, finish))
            else:
                assert paired is not None  # a partner is looked up only when pairs are priced
                start = max(free[rank], ready)
                first, second = duration(action), duration(partner)
                span = paired(action, partner)
                finish = start + span
                split = start + (span * first / (first + second) if first + second > 0 else 0.0)
                timed[rank] += [(action, start, split), (partner, split, finish)]
            for a in unit:
                end[a] = finish
                ready_ranks.extend(waiting.pop(a, ()))
            free[rank] = finish
            pointer[rank] += len(unit)
    blocked = tuple(p if p < len(a) else None for p, a in zip(pointer, schedule.actions))
    return Execution(tuple(map(tuple, timed)), blocked)
