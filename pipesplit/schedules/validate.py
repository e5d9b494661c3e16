"""Prove before anything runs that a schedule runs every action once and cannot deadlock."""

from __future__ import annotations

from collections.abc import Sequence

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.execute import B, F, I, W, backward_index, execute, paired_with, unit_requirements
from pipesplit.schedules.issue import check_rendezvous
from pipesplit.schedules.rendezvous import Edge, comm_plan
from pipesplit.schedules.schedule import Schedule

Where = dict[Action, tuple[int, int]]


SEMANTICS = ("buffered", "rendezvous")


def validate(schedule: Schedule, semantics: str = "buffered", edges: Sequence[Edge] | None = None) -> Schedule:
    """Check ``schedule`` and return it unchanged; raise ScheduleError on the first problem.

    Checks, in order: every action names an existing stage and microbatch and sits on the
    rank owning its stage; every ``F(s,m)`` appears exactly once; every ``(s,m)`` has
    exactly one backward, either ``B`` or ``I`` + ``W`` (never mixed); every overlapped pair
    is a forward directly followed by the ``B``/``I`` of another microbatch on the same
    rank, each action in one pair at most; with SEND/RECV actions present, every
    cross-rank hand-off has exactly one send and one recv and no same-rank hand-off has
    any; finally, running each rank's list in order runs everything, an overlapped pair
    starting only once both its actions' inputs are ready (so running the pair one
    action after the other is safe too).
    While running, ``F(s,m)`` waits on ``F(s-1,m)``; ``B/I(s,m)`` on ``F(s,m)`` and
    ``B/I(s+1,m)``; ``W(s,m)`` on ``I(s,m)``; with SEND/RECV present a cross-rank
    consumer waits on its local RECV, a RECV blocks until its SEND ran, sends never block.
    Positions in messages are 0-based indexes into ``schedule.actions[rank]``.

    ``semantics="rendezvous"`` then also proves the communication the runtime really issues
    for the schedule (:func:`~pipesplit.schedules.rendezvous.comm_plan`) under NCCL's
    semantics: a send completes only once the peer posted the matching receive, messages
    between two ranks match in issue order (no tags), ops of one batch are posted together.
    ``edges`` are the tensors crossing between stages (a Pipeline passes its program's);
    by default one per pair of consecutive stages.

    >>> from pipesplit.schedules import get_schedule
    >>> validate(get_schedule("1f1b", num_stages=4, num_ranks=4, num_microbatches=8), semantics="rendezvous").name
    '1f1b'
    """
    if semantics not in SEMANTICS:
        raise ScheduleError(f"validate: semantics must be one of {list(SEMANTICS)}, got {semantics!r}.")
    where = _check_placement(schedule)
    _check_coverage(schedule, where)
    _check_overlap(schedule, where)
    if schedule.has_communication:
        _check_communication(schedule, where)
    run = execute(schedule, lambda a: 0.0, lambda dep, a: 0.0, lambda f, b: 0.0)
    if not run.complete:
        raise _explain_stuck(schedule, where, run.blocked)
    if semantics == "rendezvous":
        check_rendezvous(schedule, comm_plan(schedule, edges))
    return schedule


def _at(action: Action, where: Where) -> str:
    rank, pos = where[action]
    return f"{action} (rank {rank}, position {pos})"


def _check_placement(schedule: Schedule) -> Where:
    """Range and ownership of every action; duplicates. Returns where each action sits."""
    where: Where = {}
    name = schedule.name
    for rank, actions in enumerate(schedule.actions):
        for pos, action in enumerate(actions):
            here = f"{action} (rank {rank}, position {pos})"
            if action.stage >= schedule.num_stages:
                raise ScheduleError(
                    f"Schedule {name!r}: {here} names stage {action.stage}, but stages are "
                    f"0..{schedule.num_stages - 1} (num_stages={schedule.num_stages})."
                )
            if action.microbatch >= schedule.num_microbatches:
                raise ScheduleError(
                    f"Schedule {name!r}: {here} names microbatch {action.microbatch}, but microbatches "
                    f"are 0..{schedule.num_microbatches - 1} (num_microbatches={schedule.num_microbatches})."
                )
            owner = schedule.stage_to_rank[action.stage]
            if owner != rank:
                raise ScheduleError(
                    f"Schedule {name!r}: {here} is on the wrong rank: stage {action.stage} belongs to "
                    f"rank {owner} (stage_to_rank={list(schedule.stage_to_rank)}). Move it to rank {owner}."
                )
            if action in where:
                raise ScheduleError(
                    f"Schedule {name!r}: duplicate {action}: at rank {where[action][0]}, position {where[action][1]} "
                    f"and at rank {rank}, "
                    f"position {pos}. Every action must appear exactly once; remove one."
                )
            where[action] = (rank, pos)
    return where


def _check_coverage(schedule: Schedule, where: Where) -> None:
    """Every forward once; every backward once, as B or as I + W."""
    name = schedule.name
    for stage in range(schedule.num_stages):
        rank = schedule.stage_to_rank[stage]
        for mb in range(schedule.num_microbatches):
            f, b, i, w = (Action(stage, k, mb) for k in (F, B, I, W))
            if f not in where:
                raise ScheduleError(
                    f"Schedule {name!r}: missing {f}: rank {rank} never runs the forward of "
                    f"microbatch {mb} on stage {stage}. Add {f} to rank {rank}'s list."
                )
            if b in where and (i in where or w in where):
                split = i if i in where else w
                raise ScheduleError(
                    f"Schedule {name!r}: {_at(b, where)} is mixed with {_at(split, where)}: run either one "
                    f"full backward {b} or the split pair {i} + {w}, not both."
                )
            if b in where:
                continue
            if i not in where and w not in where:
                raise ScheduleError(
                    f"Schedule {name!r}: missing {b}: rank {rank} never runs the backward of microbatch "
                    f"{mb} on stage {stage}. Add {b} (or {i} and {w}) to rank {rank}'s list."
                )
            if w not in where:
                raise ScheduleError(
                    f"Schedule {name!r}: missing {w}: {_at(i, where)} computes the input gradient but "
                    f"no {w} computes the weight gradient. Add {w} after it on rank {rank}."
                )
            if i not in where:
                raise ScheduleError(
                    f"Schedule {name!r}: missing {i}: {_at(w, where)} needs the input-gradient pass "
                    f"{i} first. Add {i} before it on rank {rank}."
                )


def _check_overlap(schedule: Schedule, where: Where) -> None:
    """Overlapped pairs: a forward, then right after it the B/I pass of another microbatch."""
    name = schedule.name
    seen: dict[Action, str] = {}
    for f, b in schedule.overlap:
        pair = f"overlapped pair {f}&{b}"
        if f.kind is not F or not b.kind.is_backward:
            raise ScheduleError(
                f"Schedule {name!r}: {pair} must be a forward followed by a B or I pass, got "
                f"{f.kind.name} and {b.kind.name}. Write each pair as (forward, backward)."
            )
        for a in (f, b):
            if a not in where:
                raise ScheduleError(f"Schedule {name!r}: {pair} names {a}, which is not in the schedule. "
                                    "Add it or drop the pair.")
            if a in seen:
                raise ScheduleError(f"Schedule {name!r}: {a} is in two overlapped pairs ({seen[a]} and {pair}); "
                                    "an action overlaps at most one other. Drop one pair.")
            seen[a] = pair
        if f.microbatch == b.microbatch:
            raise ScheduleError(
                f"Schedule {name!r}: {pair} overlaps a forward and a backward of the same microbatch "
                f"{f.microbatch}, which depend on each other. Pair {b} with another microbatch's forward."
            )
        (f_rank, f_pos), (b_rank, b_pos) = where[f], where[b]
        if b_rank != f_rank or b_pos != f_pos + 1:
            raise ScheduleError(
                f"Schedule {name!r}: {pair}: {_at(f, where)} and {_at(b, where)} must be next to each "
                f"other on one rank, forward first (RECVs before the pair, SENDs after it). Move {b} "
                f"right after {f}, or drop the pair."
            )


def _check_communication(schedule: Schedule, where: Where) -> None:
    """SEND/RECV exactly where consecutive stages sit on different ranks."""
    name = schedule.name
    for action in where:
        if not action.is_comm:
            continue
        peer = action.peer_stage
        if peer is None or not 0 <= peer < schedule.num_stages:
            raise ScheduleError(
                f"Schedule {name!r}: {_at(action, where)} talks to stage {peer}, which does not exist "
                f"(stages 0..{schedule.num_stages - 1}). Remove it."
            )
        if not schedule.crosses_ranks(action.stage, peer):
            raise ScheduleError(
                f"Schedule {name!r}: {_at(action, where)} is not needed: stages {action.stage} and {peer} "
                f"are both on rank {schedule.stage_to_rank[peer]}, so the hand-off is local. Remove it."
            )
    for stage in range(schedule.num_stages - 1):
        if not schedule.crosses_ranks(stage, stage + 1):
            continue
        for mb in range(schedule.num_microbatches):
            for needed in (
                Action(stage, ActionKind.SEND_F, mb),
                Action(stage + 1, ActionKind.RECV_F, mb),
                Action(stage + 1, ActionKind.SEND_B, mb),
                Action(stage, ActionKind.RECV_B, mb),
            ):
                if needed not in where:
                    raise ScheduleError(
                        f"Schedule {name!r}: missing {needed}: stages {stage} and {stage + 1} are on ranks "
                        f"{schedule.stage_to_rank[stage]} and {schedule.stage_to_rank[stage + 1]}, and a "
                        "schedule with communication actions needs a SEND and a RECV for every cross-rank "
                        "hand-off. Build it with with_communication(schedule.compute_only())."
                    )


def _explain_stuck(schedule: Schedule, where: Where, blocked: tuple[int | None, ...]) -> ScheduleError:
    """Name the first action that can never run and why."""
    backward_of = backward_index(schedule)
    head = {rank: pos for rank, pos in enumerate(blocked) if pos is not None}
    ran = {
        a
        for rank, actions in enumerate(schedule.actions)
        for a in actions[: len(actions) if blocked[rank] is None else blocked[rank]]
    }

    def unmet(rank: int) -> Action:
        return next(n for n in unit_requirements(schedule, rank, head[rank], backward_of) if n not in ran)

    def stuck_at(rank: int) -> str:
        action = schedule.actions[rank][head[rank]]
        partner = paired_with(schedule, rank, head[rank])
        return _at(action, where) + ("" if partner is None else f" (overlapped with {partner})")

    prefix = f"Schedule {schedule.name!r}"
    # A requirement placed later on the same rank is the clearest root cause: report it first.
    for rank in head:
        dep = unmet(rank)
        if dep in where and where[dep][0] == rank:
            action = schedule.actions[rank][head[rank]]
            return ScheduleError(
                f"{prefix}: {stuck_at(rank)} can never run: it waits on {dep}, which comes later "
                f"on the same rank (position {where[dep][1]}). Move {dep} before {action}."
            )
    rank = next(iter(head))
    dep = unmet(rank)
    if dep not in where:
        return ScheduleError(
            f"{prefix}: {stuck_at(rank)} can never run: it waits on {dep}, which is not in the schedule."
        )
    # Follow who-waits-on-whom across ranks until a rank repeats: that is the deadlock cycle.
    first = dep
    chain = [f"{stuck_at(rank)} waits on {_at(dep, where)}"]
    seen = {rank}
    while where[dep][0] not in seen:
        dep_rank = where[dep][0]
        seen.add(dep_rank)
        dep = unmet(dep_rank)
        chain.append(f"rank {dep_rank} is stuck at {stuck_at(dep_rank)}, which waits on {_at(dep, where)}")
    return ScheduleError(
        f"{prefix}: {stuck_at(rank)} can never run: it waits on {first}, "
        f"which never runs. Deadlock: {'; '.join(chain)}. Reorder the lists so every action's inputs run "
        "earlier (for SEND/RECV, rebuild with with_communication(schedule.compute_only()))."
    )
