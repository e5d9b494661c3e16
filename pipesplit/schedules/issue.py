"""What each rank really issues: its plan's batches posted ahead, and waited on only when needed.

:func:`~pipesplit.schedules.rendezvous.comm_plan` says which ops travel together and in
which order. Running it step by step (post a batch, wait for all of it, compute) makes a
sender wait for its receiver and posts every receive only when its consumer starts.
:func:`issue` turns the plan into what a rank does instead, as a list of :class:`Turn`\\ s:

* a receive is posted ``lookahead`` actions before its consumer, in a batch of its own,
  so the message can land while the rank computes;
* a send is posted right after the action that made it, and nobody waits for it until the
  step ends (the runtime drops it earlier, as soon as it is seen complete);
* before an action, the rank waits for the batch holding that action's receives, and no other.

Sends to one peer keep the plan's order, and so do receives from one peer, so the messages
between two ranks still pair without tags. Where a step's receives cannot go ahead of its
sends, the two stay one batch, as in the plan.

:func:`check_issued` proves a program under the semantics NCCL gives, taken strictly: a
rank's batches run one after another on one communication stream (a batch starts once the
one before it has completed), a batch completes once every op in it has met its partner,
and an op meets its partner only while both batches are running. A rank's compute waits
only where its turns say. The runtime executes the program that was proven.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.releases import with_releases
from pipesplit.schedules.rendezvous import Op, Plan, Step, check_pairs, sender_stage
from pipesplit.schedules.schedule import Schedule

LOOKAHEAD = 1
"""How many actions ahead of its consumer the runtime posts a receive (when the order allows)."""


@dataclass(frozen=True)
class Turn:
    """Post the batches ``post`` (in order), wait for the batches ``wait``, then run ``action`` (if any).

    ``wait`` holds indices into the rank's batches in the order they were posted, counted over
    all its turns; the last turn waits for every batch not waited for yet. ``release``: batches of
    sends known complete once the waits are done, let go of there
    (:mod:`pipesplit.schedules.releases`).
    """

    post: tuple[tuple[Op, ...], ...]
    wait: tuple[int, ...]
    action: Action | None
    release: tuple[int, ...] = ()


Program = tuple[tuple[Turn, ...], ...]
"""Per rank, the turns it runs in order."""


def _producers(steps: Sequence[Step]) -> dict[tuple[int, int, str], int]:
    """(stage, microbatch, "F" or "B") -> the index of the step whose action makes that message."""
    made = {}
    for k, step in enumerate(steps):
        a = step.action
        if a is not None and (a.kind is ActionKind.FORWARD or a.kind.is_backward):
            made[(a.stage, a.microbatch, "F" if a.kind is ActionKind.FORWARD else "B")] = k
    return made


def issue(plan: Plan, lookahead: int | Sequence[int] = LOOKAHEAD,
          early_sends: bool | Sequence[bool] = True) -> Program:
    """Each rank's turns for ``plan``: receives posted ``lookahead`` actions early, sends once made.

    ``lookahead`` and ``early_sends`` are one value for every rank or one per rank. With
    ``lookahead=0`` a receive goes out with the sends of its step; without ``early_sends``
    a send goes out at its step of the plan. Either way nothing waits for a send.

    >>> from pipesplit.schedules import get_schedule
    >>> from pipesplit.schedules.rendezvous import comm_plan
    >>> turns = issue(comm_plan(get_schedule("1f1b", num_stages=2, num_microbatches=2)))[1]
    >>> [(len(t.post), t.wait, str(t.action)) for t in turns]
    [(1, (0,), '1F0'), (1, (), '1B0'), (1, (1,), '1F1'), (0, (), '1B1'), (1, (), 'None'), (0, (2, 3), 'None')]
    """
    n = len(plan)
    ahead = [lookahead] * n if isinstance(lookahead, int) else list(lookahead)
    early = [early_sends] * n if isinstance(early_sends, bool) else list(early_sends)
    if len(ahead) != n or len(early) != n or min(ahead, default=0) < 0:
        raise ValueError(f"lookahead >= 0 and early_sends: one value or one per rank ({n}); got {lookahead}, "
                         f"{early_sends}")
    return with_releases(tuple(_issue_rank(steps, k, e) for steps, k, e in zip(plan, ahead, early)))


def _issue_rank(steps: Sequence[Step], lookahead: int, early_sends: bool) -> tuple[Turn, ...]:
    made = _producers(steps)
    at: list[list[tuple[int, int, tuple[Op, ...], int | None]]] = [[] for _ in steps]  # position -> batches
    last_recv = last_send = 0
    for k, step in enumerate(steps):
        recvs = tuple(op for op in step.ops if not op.send)
        sends = tuple(op for op in step.ops if op.send)
        r = max(last_recv, k - lookahead) if recvs else None
        s = None
        if sends:
            ready = k if not early_sends else max(  # a plan made by hand may not say who made it: then at its step
                made.get((sender_stage(op.message), op.message.microbatch, op.message.direction), k - 1) + 1
                for op in sends)
            s = max(last_send, ready)
        if r is not None and s is not None and r >= s:  # cannot go ahead of the sends: one batch, as planned
            s = r = max(last_recv, s)
            at[s].append((k, 0, recvs + sends, k))
        else:
            if r is not None:
                at[r].append((k, 0, recvs, k))
            if s is not None:
                at[s].append((k, 1, sends, None))
        last_recv, last_send = (r if r is not None else last_recv), (s if s is not None else last_send)
    turns, index, holds = [], 0, {}  # holds: step -> the batch holding its receives
    for k, step in enumerate(steps):
        post = []
        for _, _, ops, consumer in sorted(at[k], key=lambda x: (x[0], x[1])):
            post.append(ops)
            if consumer is not None:
                holds[consumer] = index
            index += 1
        turns.append(Turn(tuple(post), (holds[k],) if k in holds else (), step.action))
    waited = {t.wait[0] for t in turns if t.wait}
    rest = tuple(i for i in range(index) if i not in waited)
    if rest:
        turns.append(Turn((), rest, None))
    return tuple(turns)


def proven(schedule: Schedule, plan: Plan, lookahead: int = LOOKAHEAD) -> Program:
    """The program the runtime runs for ``plan``, proven by :func:`check_issued`.

    On NCCL a batch posted early holds up the rank's later batches until it completes: a
    receive posted ahead, or a send posted before the plan's meeting point, can deadlock
    two neighbours that each wait for the other (1F1B's steady state, ZB-V's turn). So the
    start is the plan's own batches at the plan's own points (``lookahead=0``, no early
    sends), and then, rank by rank, early sends and receives ``lookahead`` actions ahead are
    kept wherever the whole program stays proven. Raises if even the start can deadlock or
    mismatch.

    >>> from pipesplit.schedules import get_schedule
    >>> from pipesplit.schedules.rendezvous import comm_plan
    >>> one_f_one_b = get_schedule("1f1b", num_stages=2, num_microbatches=4)
    >>> [max((len(t.post) for t in turns)) for turns in proven(one_f_one_b, comm_plan(one_f_one_b))]
    [2, 1]
    """
    n = len(plan)
    ahead, early = [0] * n, [False] * n
    best = issue(plan, ahead, early)
    check_issued(schedule, best)
    options = [(r, "early") for r in range(n)] + ([(r, "ahead") for r in range(n)] if lookahead else [])
    for rank, option in options:
        trial_ahead, trial_early = list(ahead), list(early)
        if option == "early":
            trial_early[rank] = True
        else:
            trial_ahead[rank] = lookahead
        program = issue(plan, trial_ahead, trial_early)
        try:
            check_issued(schedule, program)
        except ScheduleError:
            continue
        best, ahead, early = program, trial_ahead, trial_early
    return best


def check_rendezvous(schedule: Schedule, plan: Plan, lookahead: int = LOOKAHEAD) -> None:
    """Prove ``plan`` as the runtime issues it (:func:`proven`); raise ScheduleError if it can deadlock or mismatch."""
    proven(schedule, plan, lookahead)


def check_issued(schedule: Schedule, program: Program) -> None:
    """Prove that ``program`` runs to the end under NCCL's semantics (see the module); raise ScheduleError if not.

    First, for every ordered pair of ranks, the k-th message sent must be the k-th one
    received (no tags). Then the ranks run: a batch starts once it is posted and the rank's
    batch before it completed; it completes once every op's partner batch has started; a
    rank moves past a turn once the batches it waits for completed. If some rank never
    finishes, the cycle of who waits on whom is reported.
    """
    batches = [[b for t in turns for b in t.post] for turns in program]
    check_pairs(schedule.name, [[(ops, (r, i)) for i, ops in enumerate(bs)] for r, bs in enumerate(batches)],
                lambda where: _where(program, *where))
    partner: dict[tuple[bool, object], tuple[int, int]] = {}
    for r, bs in enumerate(batches):
        for i, ops in enumerate(bs):
            for op in ops:
                partner[(not op.send, op.message)] = (r, i)  # who waits for this op: keyed by the partner's side
    n = len(program)
    through = [[sum(len(t.post) for t in turns[:k + 1]) for k in range(len(turns))] for turns in program]
    turn, posted, head = [0] * n, [0] * n, [0] * n  # head: the first batch not completed

    def started(q: int, j: int) -> bool:
        return j < head[q] or (j == head[q] and j < posted[q])

    def blocker(r: int) -> tuple[Op, int, int] | None:
        """The op of rank r's running batch whose partner has not started: (op, its rank, its batch)."""
        if head[r] >= posted[r]:
            return None
        for op in batches[r][head[r]]:
            q, j = partner[(op.send, op.message)]
            if not started(q, j):
                return op, q, j
        return None

    moved = True
    while moved:
        moved = False
        for r in range(n):
            while True:
                while head[r] < posted[r] and blocker(r) is None:
                    head[r] += 1
                    moved = True
                if turn[r] == len(program[r]):
                    break
                if posted[r] < through[r][turn[r]]:  # entering the turn: post its batches
                    posted[r] = through[r][turn[r]]
                    moved = True
                    continue
                if any(b >= head[r] for b in program[r][turn[r]].wait):
                    break
                turn[r] += 1
                moved = True
    stuck = [r for r in range(n) if turn[r] < len(program[r])]
    if stuck:
        raise _deadlock(schedule, program, batches, turn, head, posted, stuck[0], blocker)


def _deadlock(schedule: Schedule, program: Program, batches: list[list[tuple[Op, ...]]], turn: list[int],
              head: list[int], posted: list[int], first: int,
              blocker: Callable[[int], tuple[Op, int, int] | None]) -> ScheduleError:
    chain, seen, rank = [], [], first
    while rank not in seen:
        seen.append(rank)
        t = program[rank][turn[rank]]
        block = blocker(rank)
        where = f"rank {rank}, before {t.action or 'the end of the step'}"
        if block is None:  # its communication has nothing running: the batch it waits for is not posted
            chain.append(f"{where}, waits for a batch it has not posted")
            break
        op, peer, j = block
        ops = batches[rank][head[rank]]
        batch = f" (in a batch with: {'; '.join(map(str, ops))})" if len(ops) > 1 else ""
        why = (f"which rank {peer} has not reached" if j >= posted[peer]
               else f"which rank {peer} posted behind batches of its own that have not completed")
        chain.append(f"{where}, waits for its communication, which cannot {op}{batch} until rank {peer} posts "
                     f"the matching {'receive' if op.send else 'send'}, {why}")
        rank = peer
    return ScheduleError(
        f"Schedule {schedule.name!r} deadlocks when a send completes only once its receive is posted and each "
        f"rank's batches run one after another (NCCL's semantics): {'; '.join(chain)}; which closes the cycle "
        f"back to rank {rank}. Post the sends and receives that ranks exchange at the same time in one batch on "
        "both sides (comm_plan(schedule) does), or reorder so that no send waits for a receive its own rank "
        "holds up."
    )


def _where(program: Program, rank: int, i: int) -> str:
    """``its batch 3 of 9, posted before 0F1``."""
    count, total = 0, sum(len(t.post) for t in program[rank])
    for t in program[rank]:
        if count + len(t.post) > i:
            return f"its batch {i + 1} of {total}, posted before {t.action or 'the end of the step'}"
        count += len(t.post)
    return f"its batch {i + 1}"
