"""Pipeline actions: one compute or communication step of one stage on one microbatch."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from pipesplit.errors import ScheduleError


class ActionKind(str, Enum):
    """What an action does; the value is its text code (``2F0`` is stage 2, F, microbatch 0)."""

    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"
    """Gradient with respect to the stage's inputs only (zero-bubble schedules)."""
    BACKWARD_WEIGHT = "W"
    """Gradient with respect to the stage's parameters only; runs after ``I``."""
    SEND_F = "SEND_F"
    """Send the forward activations of stage s to stage s+1."""
    RECV_F = "RECV_F"
    """Receive the forward activations of stage s from stage s-1."""
    SEND_B = "SEND_B"
    """Send the input gradient of stage s to stage s-1."""
    RECV_B = "RECV_B"
    """Receive the output gradient of stage s from stage s+1."""

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_backward(self) -> bool:
        """True for the actions that produce an input gradient: ``B`` and ``I``."""
        return self in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT)


_COMPUTE = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.FULL_BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    }
)
# Longest codes first so that "SEND_F" is not read as a stage followed by "S...".
_CODES = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_CODES})(\d+)")
# Direction of the peer stage for each communication kind (stages form a chain).
_PEER_STEP = {
    ActionKind.SEND_F: +1,
    ActionKind.RECV_F: -1,
    ActionKind.SEND_B: -1,
    ActionKind.RECV_B: +1,
}
_MATCH = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.RECV_B: ActionKind.SEND_B,
}


@dataclass(frozen=True, order=True)
class Action:
    """One step of a schedule: ``kind`` applied to ``microbatch`` on ``stage``.

    The text form is ``{stage}{kind}{microbatch}``; it parses back with :meth:`parse`.

    >>> a = Action(2, ActionKind.FORWARD, 0)
    >>> str(a)
    '2F0'
    >>> Action.parse("1SEND_B4").peer_stage
    0
    """

    stage: int
    """Index of the pipeline stage (stages form a chain 0..num_stages-1)."""
    kind: ActionKind
    """What the action does."""
    microbatch: int
    """Index of the microbatch."""

    def __post_init__(self) -> None:
        for field, value in (("stage", self.stage), ("microbatch", self.microbatch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(
                    f"Action {field} must be an int >= 0, got {value!r}. "
                    "Build actions as Action(stage, ActionKind.X, microbatch)."
                )
        if not isinstance(self.kind, ActionKind):
            raise ScheduleError(
                f"Action kind must be an ActionKind, got {self.kind!r}. "
                f"Use one of {[k.name for k in ActionKind]}."
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the text form of an action, e.g. ``"2F0"`` or ``"3RECV_F0"``.

        >>> Action.parse("0W2")
        Action(stage=0, kind=<ActionKind.BACKWARD_WEIGHT: 'W'>, microbatch=2)
        """
        if not isinstance(text, str):
            raise ScheduleError(f"Cannot parse an action from {text!r}: expected a string like '2F0'.")
        found = _ACTION_RE.fullmatch(text.strip())
        if found is None:
            raise ScheduleError(
                f"Cannot parse action {text!r}: expected <stage><kind><microbatch> with kind one "
                f"of {', '.join(k.value for k in ActionKind)}, e.g. '2F0', '0I2', '1SEND_B4'."
            )
        stage, code, microbatch = found.groups()
        return cls(int(stage), ActionKind(code), int(microbatch))

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @property
    def is_comm(self) -> bool:
        return self.kind.is_comm

    @property
    def peer_stage(self) -> int | None:
        """The stage a communication action talks to; ``None`` for compute actions.

        SEND_F of stage s goes to s+1, RECV_F comes from s-1, SEND_B goes to s-1 and
        RECV_B comes from s+1.
        """
        step = _PEER_STEP.get(self.kind)
        return None if step is None else self.stage + step

    def matching(self) -> Action:
        """The other half of a send/recv pair, e.g. ``1SEND_F3`` ↔ ``2RECV_F3``."""
        peer = self.peer_stage
        if peer is None or peer < 0:
            raise ScheduleError(
                f"{self} has no matching communication action: only SEND_*/RECV_* actions with "
                "a peer stage >= 0 are paired."
            )
        return Action(peer, _MATCH[self.kind], self.microbatch)


def as_action(item: Action | str) -> Action:
    """Return ``item`` as an :class:`Action`, parsing text such as ``"2F0"``."""
    return item if isinstance(item, Action) else Action.parse(item)
