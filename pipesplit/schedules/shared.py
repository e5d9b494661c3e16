"""Simulating ranks that share one host's cores: while ``n`` of them compute, each runs slower.

The local executor runs a pipeline's ranks as threads of one process. On a CPU they share
the cores, so an action's time depends on how many ranks compute beside it: in the fill
and drain of a pipeline one rank runs alone at full speed, in its steady state all of them
run at once. One slowdown for the whole step (the all-busy one) over-predicted 4 ranks on
2 cores by up to 1.75x (benchmarks/RESULTS.md, whole-step predictions).
:func:`simulate_shared` prices the sharing as it happens (processor sharing): time moves
from event to event, and between two events every computing rank of the shared set
progresses at ``1 / slowdown(n)`` of its alone speed, ``n`` being how many of them compute.

>>> from pipesplit.schedules import get_schedule, simulate
>>> s = get_schedule("gpipe", num_ranks=2, num_microbatches=2)
>>> simulate_shared(s, 1.0, slowdown=lambda n: 1.0).step_time == simulate(s, 1.0).step_time
True
>>> simulate_shared(s, 1.0, slowdown=lambda n: float(n)).step_time  # two ranks, one core: 9 alone
12.0
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.execute import backward_index, requirements
from pipesplit.schedules.schedule import Schedule
from pipesplit.schedules.simulate import CostLike, cut_costs, stage_costs_of, transfers
from pipesplit.schedules.timeline import Timeline, TimedAction
from pipesplit.schedules.validate import validate

_EPS = 1e-12


def simulate_shared(
    schedule: Schedule,
    stage_costs: CostLike | Sequence[CostLike],
    comm_cost: float | Sequence[float] = 0.0,
    *,
    slowdown: Callable[[int], float] | None = None,
    shared: Collection[int] | None = None,
    groups: Sequence[tuple[Collection[int], Callable[[int], float]]] | None = None,
) -> Timeline:
    """:func:`~pipesplit.schedules.simulate`, with the ranks in ``shared`` (default: all)
    sharing one host's cores.

    ``stage_costs`` are each action's seconds alone. While ``n`` ranks of ``shared`` compute,
    each of them progresses ``slowdown(n)`` (>= 1) times slower; ranks outside ``shared``
    always run at full speed. Transfers and RECV waits take no cores.
    Overlapped pairs run as two actions, as pipesplit's executors run them.

    ``groups``, instead of ``shared`` and ``slowdown``: several shared resources at once, each
    a set of ranks with its own slowdown (the CPU ranks sharing the host's cores, the ranks of
    each GPU sharing that GPU). A rank belongs to one group at most.
    """
    validate(schedule)
    costs = stage_costs_of(schedule, stage_costs)
    if groups is None:
        if slowdown is None:
            raise ScheduleError("simulate_shared: give slowdown= (with shared=) or groups=.")
        groups = [(set(range(schedule.num_ranks)) if shared is None else set(shared), slowdown)]
    group_of: dict[int, int] = {}
    for g, (ranks, _) in enumerate(groups):
        outside = sorted(r for r in ranks if not (isinstance(r, int) and 0 <= r < schedule.num_ranks))
        if outside:
            raise ScheduleError(f"simulate_shared: shared ranks {outside} are not ranks of {schedule.name!r} "
                                f"(0..{schedule.num_ranks - 1}).")
        twice = sorted(r for r in ranks if r in group_of)
        if twice:
            raise ScheduleError(f"simulate_shared: ranks {twice} are in two sharing groups; a rank shares one "
                                "resource at most.")
        group_of.update((r, g) for r in ranks)
    backward_of = backward_index(schedule)
    num_ranks = schedule.num_ranks

    transfer = transfers(schedule, cut_costs(schedule, comm_cost))
    end: dict[Action, float] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(num_ranks)]
    pointer = [0] * num_ranks
    work: list[float | None] = [None] * num_ranks  # seconds-alone left of the running compute action
    start = [0.0] * num_ranks
    free = [0.0] * num_ranks  # when each rank's last action ended: a RECV holds its rank from then
    until: list[float | None] = [None] * num_ranks  # a RECV held to, or a head's inputs arriving at, this time
    now = 0.0

    def finish(rank: int) -> None:
        action = schedule.actions[rank][pointer[rank]]
        timed[rank].append(TimedAction(action, start[rank], now))
        end[action] = free[rank] = now
        pointer[rank] += 1
        work[rank] = until[rank] = None

    while True:
        started = True
        while started:  # start every head that can start now; zero-cost ones end at once
            started = False
            for rank in range(num_ranks):
                if work[rank] is not None or until[rank] is not None or pointer[rank] >= len(schedule.actions[rank]):
                    continue
                action = schedule.actions[rank][pointer[rank]]
                needs = requirements(action, schedule, backward_of)
                if any(n not in end for n in needs):
                    continue
                ready = max((end[n] + transfer(n, action) for n in needs), default=0.0)
                if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                    start[rank] = free[rank]  # held from when the rank reached it until the data is in
                    if ready > now + _EPS:
                        until[rank] = ready
                        continue
                elif ready > now + _EPS:
                    until[rank] = ready  # its inputs are on their way: it starts when they are in
                    continue
                else:
                    start[rank], cost = now, costs[action.stage].of(action.kind)
                    if cost > _EPS:
                        work[rank] = cost
                        continue
                finish(rank)
                started = True
        factors = []
        for ranks, slow in groups:
            busy = sum(1 for r in ranks if work[r] is not None)
            factors.append(max(1.0, slow(busy)) if busy else 1.0)
        rate = [1.0 / factors[group_of[r]] if r in group_of else 1.0 for r in range(num_ranks)]
        events = [now + w / rate[r] for r, w in enumerate(work) if w is not None]
        events += [u for u in until if u is not None]
        if not events:
            break
        later = min(events)
        for r, w in enumerate(work):
            if w is not None:
                work[r] = max(0.0, w - (later - now) * rate[r])
        now = later
        for r in range(num_ranks):
            left, held = work[r], until[r]
            if left is not None and left <= _EPS * max(1.0, now):
                finish(r)
            elif held is not None and held <= now + _EPS:
                if schedule.actions[r][pointer[r]].kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                    finish(r)
                else:
                    until[r] = None  # its inputs are in: it starts in the next round
    stuck = [r for r in range(num_ranks) if pointer[r] < len(schedule.actions[r])]
    if stuck:  # validate() rules this out; kept as a guard against a simulator bug
        raise ScheduleError(f"simulate_shared: ranks {stuck} could not finish {schedule.name!r}.")
    return Timeline(schedule, tuple(tuple(rank) for rank in timed))

