"""Placing a split program's state on its stages: which stage holds each parameter and buffer, on
which device, the state no op reads, replicas of a tensor several stages hold (tied), and the module
that holds what a stage's graph reads.

:class:`StatePlacing` is a base of :class:`pipesplit.passes.split.program.SplitProgram`, which calls
it while it builds the stages, and sets the attributes it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from pipesplit.capture import Captured
from pipesplit.errors import PlanError
from pipesplit.passes.split import StagePiece
from pipesplit.passes.split.program_state import ProgramState
from pipesplit.state import Placement, attach

if TYPE_CHECKING:
    from pipesplit.passes.split.program import Stage


class StatePlacing(ProgramState):
    """Gives each stage the state tensors its graph reads, on its device (see :class:`ProgramState`
    for the state API over what they hold)."""

    stages: list[Stage]
    target_to_entry: dict[str, int]  # get_attr target -> index into _state

    def _taker(self, captured: Captured, placement: Placement, device: torch.device) -> Callable[[int], Any]:
        """A new stage's ``take(idx)``: state entry ``idx`` as the stage holds it, placed on ``device``
        the first time the stage asks (a tensor held by several stages becomes a tied replica)."""
        entries: dict[int, torch.Tensor] = {}
        self.stage_entries.append(entries)

        def take(idx: int, device: torch.device = device, entries: dict[int, torch.Tensor] = entries) -> Any:
            if idx not in entries:  # a model built on "meta" stays there until materialize()
                t = captured.state[idx].tensor
                entries[idx] = placement.take(idx, t, t.device if t.is_meta else device)
            return entries[idx]

        return take

    def _hold_the_rest(self, captured: Captured, placement: Placement) -> None:
        """Once every stage took what its graph reads: the state no op reads, the owner of each entry,
        the refusal of a buffer written in place on several devices, and the ties between replicas."""
        for idx, state in enumerate(captured.state):  # state no op reads (an unused head): stage 0 keeps it, so
            # state_dict and checkpoints have it; on meta it stays unheld (nothing could give it values)
            if state.aliases and placement.owner(idx) is None and self.stages and not state.tensor.is_meta:
                self.stage_entries[0][idx] = placement.take(idx, state.tensor, self.stages[0].device)
        self._owner: list[torch.Tensor | None] = [placement.owner(idx) for idx in range(len(captured.state))]
        self.uninitialised: set[int] = set()  # state entries given storage by materialize() and no values yet
        for idx, copies in enumerate(placement.copies):
            if len(copies) > 1 and captured.state[idx].name in captured.mutated_names:
                raise PlanError(
                    f"buffer {captured.state[idx].name!r} is updated in place by stages on different devices "
                    f"({', '.join(map(str, copies))}); put those stages on one device."
                )
        self._tie(placement.ties())

    def _holder(self, piece: StagePiece, take: Callable[[int], torch.Tensor]) -> nn.Module:
        """A module holding what stage ``piece``'s graph reads: state tensors (``take(idx)``) under
        their targets, and submodules (the bodies of higher-order ops)."""
        holder = nn.Module()
        for target, obj in piece.attrs.items():
            idx = self.target_to_entry.get(target)
            if idx is None:  # a submodule, e.g. the body of a higher-order op
                attach(holder, target, obj)
            else:
                attach(holder, target, take(idx), self._state[idx].persistent)
        if piece.index == 0:
            used = set(self.target_to_entry.values())
            for idx, entry in enumerate(self._state):
                if idx not in used and entry.aliases:  # unused state stays with stage 0
                    attach(holder, entry.name, take(idx), entry.persistent)
        return holder
