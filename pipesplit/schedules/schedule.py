"""The Schedule value: per-rank ordered action lists, and communication insertion."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action, ActionKind, as_action
from pipesplit.deprecation import num_keywords, renamed_attribute


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as pure data: what each rank runs, in order.

    Construct it directly or with :meth:`from_lists`; check it with
    :func:`pipesplit.schedules.validate`.

    >>> s = Schedule.from_lists("tiny", [["0F0", "0B0"]])
    >>> s.num_stages, s.num_ranks, s.num_microbatches
    (1, 1, 1)
    """

    name: str
    """Name of the schedule (the registry name for built-ins)."""
    num_stages: int
    """Number of pipeline stages; they form a chain 0..num_stages-1."""
    num_ranks: int
    """Number of ranks (devices or processes)."""
    num_microbatches: int
    """Number of microbatches per step."""
    stage_to_rank: tuple[int, ...]
    """``stage_to_rank[s]`` is the rank that owns stage ``s``."""
    actions: tuple[tuple[Action, ...], ...]
    """``actions[r]`` is what rank ``r`` executes, in order."""
    overlap: tuple[tuple[Action, Action], ...] = ()
    """Pairs ``(forward, backward)`` meant to run overlapped, as DualPipe's F&B chunks: a
    forward and the B or I pass of another microbatch, next to each other on one rank,
    forward first. Executors that cannot overlap run the pair in list order (always valid);
    ``simulate(..., overlap=x)`` prices it as overlapped. Sorted; ``()`` for most schedules."""

    n_stages = renamed_attribute("n_stages", "num_stages")
    n_ranks = renamed_attribute("n_ranks", "num_ranks")
    n_microbatches = renamed_attribute("n_microbatches", "num_microbatches")

    def __post_init__(self) -> None:
        for field in ("num_stages", "num_ranks", "num_microbatches"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"Schedule {self.name!r}: {field} must be an int >= 1, got {value!r}.")
        # Normalise lists to tuples so the value stays hashable and immutable.
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(as_action(a) for a in rank) for rank in self.actions))
        object.__setattr__(self, "overlap", _normalise_pairs(self.name, self.overlap))
        if len(self.stage_to_rank) != self.num_stages:
            raise ScheduleError(
                f"Schedule {self.name!r}: stage_to_rank has {len(self.stage_to_rank)} entries but "
                f"num_stages is {self.num_stages}; give one rank per stage."
            )
        bad = [(s, r) for s, r in enumerate(self.stage_to_rank) if not (isinstance(r, int) and 0 <= r < self.num_ranks)]
        if bad:
            stage, rank = bad[0]
            raise ScheduleError(
                f"Schedule {self.name!r}: stage {stage} is mapped to rank {rank!r}, outside 0..{self.num_ranks - 1} "
                f"(num_ranks={self.num_ranks}); fix stage_to_rank or num_ranks."
            )
        if len(self.actions) != self.num_ranks:
            raise ScheduleError(
                f"Schedule {self.name!r}: {len(self.actions)} action lists for num_ranks={self.num_ranks}; "
                "give exactly one (possibly empty) list per rank."
            )

    @classmethod
    @num_keywords
    def from_lists(
        cls,
        name: str,
        per_rank: Sequence[Sequence[Action | str]],
        *,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        stage_to_rank: Sequence[int] | None = None,
        overlap: Sequence[tuple[Action | str, Action | str]] = (),
    ) -> Schedule:
        """Build a schedule from per-rank lists, inferring what is not given.

        ``num_stages`` and ``num_microbatches`` default to one more than the largest index
        used; ``stage_to_rank`` defaults to the rank each stage's actions appear on;
        ``overlap`` lists ``(forward, backward)`` pairs (see :attr:`overlap`).

        >>> Schedule.from_lists("x", [["0F0", "0B0"], ["1F0", "1B0"]]).stage_to_rank
        (0, 1)
        """
        lists = [[as_action(a) for a in rank] for rank in per_rank]
        flat = [a for rank in lists for a in rank]
        if num_stages is None:
            num_stages = max((a.stage for a in flat), default=-1) + 1
            if stage_to_rank is not None:
                num_stages = max(num_stages, len(stage_to_rank))
        if num_microbatches is None:
            num_microbatches = max((a.microbatch for a in flat), default=-1) + 1
        if stage_to_rank is None:
            stage_to_rank = _infer_stage_to_rank(name, lists, num_stages)
        return cls(
            name, num_stages, len(lists), num_microbatches, tuple(stage_to_rank), tuple(map(tuple, lists)),
            tuple((as_action(f), as_action(b)) for f, b in overlap),
        )

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        """The stages owned by ``rank``, ascending.

        >>> Schedule.from_lists("x", [["0F0", "3F0"], ["1F0"], ["2F0"]]).rank_stages(0)
        (0, 3)
        """
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(f"Schedule {self.name!r}: rank {rank} is outside 0..{self.num_ranks - 1}.")
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    @cached_property
    def has_communication(self) -> bool:
        """Whether any SEND/RECV action is present."""
        return any(a.is_comm for rank in self.actions for a in rank)

    @cached_property
    def overlap_partner(self) -> dict[Action, Action]:
        """The backward each overlapped forward is paired with (see :attr:`overlap`)."""
        return dict(self.overlap)

    def compute_only(self) -> Schedule:
        """This schedule with every SEND/RECV action removed."""
        stripped = tuple(tuple(a for a in rank if a.is_compute) for rank in self.actions)
        return dataclasses.replace(self, actions=stripped)

    def peer_rank(self, action: Action) -> int | None:
        """The rank a SEND/RECV action talks to (``None`` for compute actions).

        >>> s = Schedule.from_lists("x", [["0F0", "0B0"], ["1F0", "1B0"]])
        >>> s.peer_rank(Action.parse("0SEND_F0"))
        1
        """
        peer = action.peer_stage
        if peer is None:
            return None
        if not 0 <= peer < self.num_stages:
            raise ScheduleError(
                f"Schedule {self.name!r}: {action} talks to stage {peer}, outside 0..{self.num_stages - 1}."
            )
        return self.stage_to_rank[peer]

    def crosses_ranks(self, stage: int, other: int) -> bool:
        """Whether a hand-off between ``stage`` and ``other`` leaves the rank."""
        return self.stage_to_rank[stage] != self.stage_to_rank[other]


def _normalise_pairs(name: str, pairs: object) -> tuple[tuple[Action, Action], ...]:
    try:
        items = [(as_action(f), as_action(b)) for f, b in pairs]  # type: ignore[attr-defined]
    except (TypeError, ValueError) as err:
        raise ScheduleError(
            f"Schedule {name!r}: overlap must be a sequence of (forward, backward) pairs such as "
            f"(Action.parse('0F3'), Action.parse('3B1')), got {pairs!r}."
        ) from err
    return tuple(sorted(items))


Schedule.__init__ = num_keywords(Schedule.__init__)  # type: ignore[method-assign]  # Schedule(n_stages=...) until 0.3


def _infer_stage_to_rank(name: str, lists: list[list[Action]], num_stages: int) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for rank, actions in enumerate(lists):
        for pos, action in enumerate(actions):
            seen = owner.setdefault(action.stage, rank)
            if seen != rank:
                raise ScheduleError(
                    f"Schedule {name!r}: stage {action.stage} appears on rank {seen} and on rank {rank} "
                    f"({action} at position {pos}); a stage must live on one rank. Pass stage_to_rank "
                    "explicitly or move the action."
                )
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise ScheduleError(
            f"Schedule {name!r}: cannot infer the rank of stage(s) {missing}: they have no actions. "
            "Pass stage_to_rank explicitly."
        )
    return tuple(owner[s] for s in range(num_stages))


def with_communication(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV actions for every hand-off between stages on different ranks.

    A send goes right after the compute action that produces the tensor (``F`` sends
    activations forward, ``B``/``I`` send the input gradient backward); the matching
    recv goes right before the compute action that consumes it. Hand-offs between
    stages on the same rank stay local (no action). An overlapped pair (see
    :attr:`Schedule.overlap`) is one unit: both recvs before it, both sends after it.

    Assumption: sends are non-blocking (buffered ``isend``) and recvs block until the
    matching send has run. Then a recv waits exactly on what its consumer would wait on
    in the compute-only schedule, so the result deadlocks if and only if the
    compute-only schedule does (which :func:`validate` rules out). Existing SEND/RECV
    actions are dropped and re-inserted, so the function is idempotent.

    >>> s = Schedule.from_lists("x", [["0F0", "0B0"], ["1F0", "1B0"]])
    >>> [str(a) for a in with_communication(s).actions[0]]
    ['0F0', '0SEND_F0', '0RECV_B0', '0B0']
    """
    per_rank: list[tuple[Action, ...]] = []
    for rank_actions in schedule.actions:
        compute = [a for a in rank_actions if a.is_compute]
        out: list[Action] = []
        i = 0
        while i < len(compute):
            partner = schedule.overlap_partner.get(compute[i])
            paired = i + 1 < len(compute) and compute[i + 1] == partner
            unit = compute[i : i + 2] if paired else compute[i : i + 1]
            hand_offs = [_hand_offs(schedule, a) for a in unit]
            out += [recv for recv, _ in hand_offs if recv is not None]
            out += unit
            out += [send for _, send in hand_offs if send is not None]
            i += len(unit)
        per_rank.append(tuple(out))
    return dataclasses.replace(schedule, actions=tuple(per_rank))


def _hand_offs(schedule: Schedule, action: Action) -> tuple[Action | None, Action | None]:
    """The RECV a compute action needs first and the SEND it makes after (None: local or none)."""
    s, m, last = action.stage, action.microbatch, schedule.num_stages - 1
    if s > last:
        raise ScheduleError(
            f"Schedule {schedule.name!r}: {action} names stage {s} but num_stages is "
            f"{schedule.num_stages}; run validate() to find every such action."
        )
    recv = send = None
    if action.kind is ActionKind.FORWARD:
        if s > 0 and schedule.crosses_ranks(s, s - 1):
            recv = Action(s, ActionKind.RECV_F, m)
        if s < last and schedule.crosses_ranks(s, s + 1):
            send = Action(s, ActionKind.SEND_F, m)
    elif action.kind.is_backward:
        if s < last and schedule.crosses_ranks(s, s + 1):
            recv = Action(s, ActionKind.RECV_B, m)
        if s > 0 and schedule.crosses_ranks(s, s - 1):
            send = Action(s, ActionKind.SEND_B, m)
    return recv, send
