"""What one stage's actions cost, per microbatch: the simulator's input, and what a traced or
simulated step reads back per stage."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action, ActionKind


@dataclass(frozen=True)
class StageCost:
    """Compute time of one stage for one microbatch, in seconds (or any consistent unit).

    >>> StageCost(1.0, 1.0, 1.0).backward
    2.0
    """

    forward: float
    """Forward pass F."""
    backward_input: float
    """Input-gradient pass I."""
    backward_weight: float
    """Weight-gradient pass W; a full backward B costs I + W."""

    def __post_init__(self) -> None:
        for field in ("forward", "backward_input", "backward_weight"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ScheduleError(f"StageCost.{field} must be a finite number >= 0, got {value!r}.")

    @property
    def backward(self) -> float:
        """Full backward B = I + W."""
        return self.backward_input + self.backward_weight

    @classmethod
    def from_forward(cls, forward: float) -> StageCost:
        """The usual rule of thumb: backward = 2 x forward, split evenly into I and W."""
        return cls(forward, forward, forward)

    def of(self, kind: ActionKind) -> float:
        """Duration of an action of ``kind`` (communication actions take no compute time)."""
        return {
            ActionKind.FORWARD: self.forward,
            ActionKind.FULL_BACKWARD: self.backward,
            ActionKind.BACKWARD_INPUT: self.backward_input,
            ActionKind.BACKWARD_WEIGHT: self.backward_weight,
        }.get(kind, 0.0)

    @classmethod
    def of_spans(cls, num_stages: int, spans: Iterable[tuple[Action, float]],
                 reduce: Callable[[list[float]], float] = statistics.median) -> list[StageCost]:
        """Per stage, the median (or ``reduce``) seconds of its F, I and W among ``spans``
        (action, seconds), as a traced or simulated step ran them.

        A backward that ran fused (``B``) is reported whole as ``backward_input`` (it cannot be
        parted), so ``.backward`` is right either way; a kind that never ran counts 0.

        >>> F0, B0, F1 = (Action.parse(t) for t in ("0F0", "0B0", "0F1"))
        >>> StageCost.of_spans(1, [(F0, 1.0), (F1, 3.0), (B0, 4.0)])
        [StageCost(forward=2.0, backward_input=4.0, backward_weight=0.0)]
        """
        found: dict[tuple[int, ActionKind], list[float]] = {}
        for action, seconds in spans:
            found.setdefault((action.stage, action.kind), []).append(seconds)

        def median(stage: int, kind: ActionKind) -> float | None:
            values = found.get((stage, kind))
            return reduce(values) if values else None

        out = []
        for s in range(num_stages):
            full = median(s, ActionKind.FULL_BACKWARD)
            i = full if full is not None else median(s, ActionKind.BACKWARD_INPUT) or 0.0
            w = 0.0 if full is not None else median(s, ActionKind.BACKWARD_WEIGHT) or 0.0
            out.append(cls(median(s, ActionKind.FORWARD) or 0.0, i, w))
        return out
