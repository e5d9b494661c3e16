"""The split program's state: the parameters and buffers each stage holds, under the original
model's names, tied tensors kept one, and the original model's state_dict in and out.

:class:`ProgramState` is a base of :class:`pipesplit.passes.split.program.SplitProgram`, which sets the
attributes it reads when it places the state on the stages' devices.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, NamedTuple

import torch
from torch import nn

from pipesplit.capture import StateEntry
from pipesplit.errors import InputError
from pipesplit.materialize import check_initialised
from pipesplit.state import Tied, zero_grads
from pipesplit.deprecation import renamed_attribute


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` did not match, as ``nn.Module.load_state_dict`` returns it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class ProgramState:
    """Where each state tensor lives in a split program, and the state API over it."""

    _state: list[StateEntry]  # every distinct tensor of the model's state (a tied one is one entry)
    _state_keys: dict[str, int]  # the model's state_dict keys -> index into _state
    _owner: list[torch.Tensor | None]  # per entry: the tensor this process holds and updates (None: not here)
    _tied: list[Tied]
    _mutated_entries: set[int]  # entries some op writes in place
    stage_entries: list[dict[int, torch.Tensor]]  # per stage: state index -> its tensor
    uninitialised: set[int]  # entries given storage by materialize() and no values yet

    def rebuild_holders(self, stages: set[int]) -> None:
        """Owners and ties from what ``stages`` hold now (after dropping stages or materializing)."""
        kept: dict[int, list[torch.Tensor]] = {}
        for s in sorted(stages):
            for idx, t in self.stage_entries[s].items():
                if all(t is not u for u in kept.setdefault(idx, [])):
                    kept[idx].append(t)
        self._owner = [kept[idx][0] if idx in kept else None for idx in range(len(self._owner))]
        for tied in self._tied:
            tied.unhook()
        self._tie([(idx, held[0], held[1:]) for idx, held in kept.items() if len(held) > 1])

    def _tie(self, ties: list[tuple[int, torch.Tensor, list[torch.Tensor]]]) -> None:
        """Keep each tensor held by several stages one tensor: replica gradients go to its owner."""
        self._tied = []
        for _idx, owner, replicas in ties:
            tied = Tied(owner, replicas)
            tied.hook()
            self._tied.append(tied)

    def state_entry(self, idx: int) -> Any:
        """The original-model description (names, kind) of state tensor ``idx``."""
        return self._state[idx]

    def defer_tied_gradients(self, defer: bool) -> None:
        """While deferred, replica gradients of tied tensors stay put until flush (thread safety)."""
        for tied in self._tied:
            if defer:
                tied.begin_step()
            else:
                tied.end_step()

    def sync_tied(self) -> None:
        """Copy each tied tensor's owner into its replicas if the owner changed."""
        for tied in self._tied:
            tied.sync()

    def held_items(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(state index, tensor) for everything this process holds (its owner here)."""
        for idx, owner in enumerate(self._owner):
            if owner is not None:
                yield idx, owner

    def held_requires_grad(self) -> tuple[bool, ...]:
        """``requires_grad`` of everything this process holds, in ``held_items`` order (once a step: cheap)."""
        return tuple([owner.requires_grad for owner in self._owner if owner is not None])

    def shared_mutated_state(self) -> dict[str, list[int]]:
        """Buffers written in place that several stages use: name -> those stages."""
        out = {}
        for idx in sorted(self._mutated_entries):
            stages = [s for s, entries in enumerate(self.stage_entries) if idx in entries]
            if len(stages) > 1:
                out[self._state[idx].name] = stages
        return out

    n_state_entries = renamed_attribute("n_state_entries", "num_state_entries")

    @property
    def num_state_entries(self) -> int:
        return len(self._state)

    def held_state(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """(state entry, the tensor this process holds for it) for every entry with a holder here."""
        for idx, owner in self.held_items():
            if self._state[idx].aliases:  # not a constant export lifted
                yield self._state[idx], owner

    def held_tensor(self, idx: int) -> torch.Tensor:
        """The tensor this process holds for state entry ``idx`` (its owner here)."""
        owner = self._owner[idx]
        assert owner is not None, f"state entry {idx} is not held by this process"
        return owner

    def held_params(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(state index, parameter) for every parameter this process holds, once."""
        for idx, owner in self.held_items():
            if self._state[idx].is_param:
                yield idx, owner

    def refresh_tied(self) -> None:
        """Copy owners into their replicas after they were written outside autograd (a load)."""
        for tied in self._tied:
            tied.version = -1
            tied.sync()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every parameter once (a tied weight once), under the original model's name."""
        for idx, owner in self.held_items():
            if self._state[idx].is_param:
                yield self._state[idx].name, owner  # type: ignore[misc]

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for idx, owner in self.held_items():
            entry = self._state[idx]
            if not entry.is_param and entry.aliases:
                yield entry.name, owner

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict keys (aliases of tied tensors included), for what this process
        holds: every key in one process; under torchrun a rank's own stages' (as ``named_parameters``),
        since the other ranks train the rest. ``pipe.save(path)`` writes the whole model from every rank."""
        check_initialised(self, " (state_dict would hand back uninitialised memory)")  # type: ignore[arg-type]
        for tied in self._tied:
            tied.sync()
        return {key: owner.detach() for key, idx in self._state_keys.items() if (owner := self._owner[idx]) is not None}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> IncompatibleKeys:
        """Copy an original-model state_dict into every stage (and every replica); returns the keys
        it lacked and the ones the model does not have (``strict=False``; ``strict`` refuses both)."""
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_keys]
        if strict and (missing or unexpected):
            raise InputError(
                f"state_dict does not match the model: {len(missing)} missing key(s) {missing[:5]}, "
                f"{len(unexpected)} unexpected key(s) {unexpected[:5]}. Pass strict=False to load a subset."
            )
        wrong = [
            f"{k}: {tuple(state_dict[k].shape)} for {tuple(self._state[i].tensor.shape)}"
            for k, i in self._state_keys.items()
            if k in state_dict and tuple(state_dict[k].shape) != tuple(self._state[i].tensor.shape)
        ]
        if wrong:  # copy_ would broadcast a (1, d) tensor into (n, d) without a word
            raise InputError(
                f"state_dict has {len(wrong)} tensor(s) of the wrong shape (given for expected): {wrong[:5]}. "
                "Load a state_dict of the model this program was compiled from."
            )
        with torch.no_grad():
            for key, idx in self._state_keys.items():
                if key in state_dict and self._owner[idx] is not None:
                    self._owner[idx].copy_(state_dict[key])  # type: ignore[union-attr]
                    self.uninitialised.discard(idx)
        self.refresh_tied()
        return IncompatibleKeys(missing, unexpected)

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self.parameters(), set_to_none)
