"""The runtime's point-to-point traffic as data: which ops travel together, and in which order.

The runtime does not send and receive one tensor at a time. :func:`comm_plan` turns a
schedule into a list of :class:`Step` values per rank, each a batch of sends and receives
that meet at the same time (posted together with ``dist.batch_isend_irecv``), then a
compute action. :func:`check_pairs` checks that the messages between two ranks pair in
issue order, since NCCL has no tags. How a rank issues its plan (receives posted ahead,
sends not waited for) and the proof of that under NCCL's semantics are in
:mod:`pipesplit.schedules.issue`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.execute import execute
from pipesplit.schedules.schedule import Schedule


@dataclass(frozen=True)
class Message:
    """What one send carries: boundary ``name`` from stage ``src`` to ``dst`` for a microbatch.

    ``direction`` is ``"F"`` for activations (src -> dst) and ``"B"`` for their gradients
    (travelling back from dst to src).
    """

    direction: str
    name: str
    src: int
    dst: int
    microbatch: int

    def describe(self) -> str:
        what = "activation" if self.direction == "F" else "gradient of"
        return f"{what} {self.name!r} (stage {self.src} -> stage {self.dst}, microbatch {self.microbatch})"


@dataclass(frozen=True)
class Edge:
    """One tensor that stage ``src`` hands to stage ``dst``; with ``grad`` its gradient travels back."""

    name: str
    src: int
    dst: int
    grad: bool = True


def chain_edges(num_stages: int) -> tuple[Edge, ...]:
    """One tensor from each stage to the next: the traffic when the program is not known."""
    return tuple(Edge(f"x{s}", s, s + 1) for s in range(num_stages - 1))


@dataclass(frozen=True)
class Op:
    """One point-to-point operation of a rank: send ``message`` to rank ``peer`` or receive it from there."""

    send: bool
    message: Message
    peer: int

    def __str__(self) -> str:
        return f"send the {self.message.describe()} to rank {self.peer}" if self.send else \
            f"receive the {self.message.describe()} from rank {self.peer}"


@dataclass(frozen=True)
class Step:
    """Post ``ops`` as one batch, wait until every one has completed, then run ``action`` (if any)."""

    ops: tuple[Op, ...]
    action: Action | None


Plan = tuple[tuple[Step, ...], ...]
"""Per rank, the steps it runs in order."""


def action_messages(action: Action, edges: Sequence[Edge]) -> tuple[list[Message], list[Message]]:
    """What ``action`` receives before it runs and sends after, over every edge (same-rank ones too).

    Order: a forward receives by source stage then the source's output order (the order of
    ``edges``) and sends by output then consumer; a backward receives its output gradients in
    the forward's send order and sends its input gradients in the forward's receive order.
    """
    s, m, kind = action.stage, action.microbatch, action.kind
    if kind is ActionKind.FORWARD:
        return ([Message("F", e.name, e.src, s, m) for e in edges if e.dst == s],
                [Message("F", e.name, s, e.dst, m) for e in edges if e.src == s])
    if kind.is_backward:
        return ([Message("B", e.name, s, e.dst, m) for e in edges if e.src == s and e.grad],
                [Message("B", e.name, e.src, s, m) for e in edges if e.dst == s and e.grad])
    return [], []


def sender_stage(msg: Message) -> int:
    """The stage that produces ``msg``: the boundary's source for activations, its consumer for gradients."""
    return msg.src if msg.direction == "F" else msg.dst


def receiver_stage(msg: Message) -> int:
    """The stage that consumes ``msg``."""
    return msg.dst if msg.direction == "F" else msg.src


_UNIT = {ActionKind.FORWARD: 1.0, ActionKind.FULL_BACKWARD: 2.0, ActionKind.BACKWARD_INPUT: 1.0,
         ActionKind.BACKWARD_WEIGHT: 1.0}


def comm_plan(schedule: Schedule, edges: Sequence[Edge] | None = None, *, batched: bool = True) -> Plan:
    """The point-to-point operations each rank issues, in order, around its compute actions.

    ``batched`` (what the runtime does): run the schedule with buffered sends and unit
    costs (F = I = W = 1, B = 2); every message then meets at the time its consumer starts.
    Both ends post it in the batch of that time: the receiver right before the consumer,
    the sender after all its actions that started earlier, together with whatever else the
    sender exchanges at that time (in 1F1B's steady state, the two neighbours' crossing
    activation and gradient). Ranks meet in the order of one timeline, so the plan cannot
    deadlock, and both ends of every rank pair order their messages by meeting time, so
    they match without tags. ``batched=False`` is the naive order: each receive alone right
    before its consumer, each send alone right after its producer; under rendezvous
    semantics 1F1B deadlocks with it.

    Hand-offs between stages of one rank are not communication and do not appear. SEND/RECV
    actions in the schedule are ignored: the runtime derives its own. The schedule must be
    valid (:func:`pipesplit.schedules.validate`).

    >>> from pipesplit.schedules import get_schedule
    >>> plan = comm_plan(get_schedule("1f1b", num_stages=2, num_microbatches=2))
    >>> [len(step.ops) for step in plan[0]], str(plan[0][2].action)
    ([0, 1, 2, 1], '0B0')
    """
    edges = chain_edges(schedule.num_stages) if edges is None else tuple(edges)
    rank_of = schedule.stage_to_rank
    compute = schedule.compute_only()
    if not batched:
        return tuple(_naive(actions, rank, edges, rank_of) for rank, actions in enumerate(compute.actions))
    run = execute(compute, lambda a: _UNIT[a.kind], lambda dep, a: 0.0)
    if not run.complete:
        raise ScheduleError(f"Schedule {schedule.name!r} cannot run to the end; validate(schedule) says why.")
    start = {a: t for timed in run.timed for a, t, _ in timed}
    meet: list[dict[float, list[tuple[int, Op]]]] = [{} for _ in compute.actions]  # rank -> time -> ops
    for rank, actions in enumerate(compute.actions):
        for action in actions:
            for k, msg in enumerate(action_messages(action, edges)[0]):
                sender = rank_of[sender_stage(msg)]
                if sender != rank:
                    meet[rank].setdefault(start[action], []).append((k, Op(False, msg, sender)))
                    meet[sender].setdefault(start[action], []).append((k, Op(True, msg, rank)))
    plan = []
    for rank, actions in enumerate(compute.actions):
        batches = sorted(meet[rank].items())
        steps: list[Step] = []

        def ops_at(t: float) -> tuple[Op, ...]:
            return tuple(op for _, op in sorted(meet[rank].pop(t), key=lambda x: (x[1].send, x[1].peer, x[0])))

        for action in actions:
            while batches and batches[0][0] < start[action]:
                steps.append(Step(ops_at(batches.pop(0)[0]), None))
            here = batches.pop(0)[0] if batches and batches[0][0] == start[action] else None
            steps.append(Step(ops_at(here) if here is not None else (), action))
        steps += [Step(ops_at(t), None) for t, _ in batches]
        plan.append(tuple(steps))
    return tuple(plan)


def _naive(actions: Sequence[Action], rank: int, edges: Sequence[Edge], rank_of: Sequence[int]) -> tuple[Step, ...]:
    steps: list[Step] = []
    for action in actions:
        recvs, sends = action_messages(action, edges)
        steps += [Step((Op(False, m, rank_of[sender_stage(m)]),), None) for m in recvs if rank_of[sender_stage(m)] != rank]
        steps.append(Step((), action))
        steps += [Step((Op(True, m, rank_of[receiver_stage(m)]),), None) for m in sends if rank_of[receiver_stage(m)] != rank]
    return tuple(steps)


def check_pairs(name: str, ranks: Sequence[Sequence[tuple[Sequence[Op], Any]]], where: Callable[[Any], str]) -> None:
    """Without tags, the k-th message rank a sends to rank b must be the k-th one b receives from a.

    ``ranks[r]`` lists rank r's batches in issue order, each with a key that ``where`` turns
    into words for the error. Raises ScheduleError on the first mismatch or unmatched op.
    """
    sent: dict[tuple[int, int], list[tuple[Message, Any]]] = {}
    received: dict[tuple[int, int], list[tuple[Message, Any]]] = {}
    for rank, batches in enumerate(ranks):
        for ops, key in batches:
            for op in ops:
                pair = (rank, op.peer) if op.send else (op.peer, rank)
                (sent if op.send else received).setdefault(pair, []).append((op.message, key))
    for src, dst in sorted(set(sent) | set(received)):
        out, into = sent.get((src, dst), []), received.get((src, dst), [])
        for k, ((a, i), (b, j)) in enumerate(zip(out, into)):
            if a != b:
                raise ScheduleError(
                    f"Schedule {name!r}: rank {src}'s message #{k + 1} to rank {dst} is the {a.describe()} "
                    f"({where(i)}), but rank {dst}'s receive #{k + 1} from rank {src} expects the "
                    f"{b.describe()} ({where(j)}). NCCL matches the messages "
                    f"between two ranks by order, not by tag, so this would deliver the wrong tensor. Order rank "
                    f"{dst}'s actions to consume what rank {src} sends in the order it is sent."
                )
        if len(out) != len(into):
            raise ScheduleError(
                f"Schedule {name!r}: rank {src} sends {len(out)} message(s) to rank {dst}, which receives "
                f"{len(into)} from it; every send needs its receive."
            )
