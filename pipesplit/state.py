"""Where a program's parameters and buffers live: per-stage copies and tied replicas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn


@dataclass
class Tied:
    """A tensor held by stages on several devices: one owner, replicas kept in sync.

    Replica gradients are added into the owner's gradient as soon as they are
    accumulated, so the tensor has a single gradient; replicas are refreshed from
    the owner whenever it changed (e.g. after an optimizer step).
    """

    owner: torch.Tensor
    replicas: list[torch.Tensor]
    version: int = -1
    handles: list[Any] = field(default_factory=list)
    deferred: bool = False  # while True, replica gradients wait for flush() (multi-threaded runtimes)
    earlier: torch.Tensor | None = None  # the owner's gradient from earlier steps, during a step

    def hook(self) -> None:
        if not isinstance(self.owner, nn.Parameter) or not self.owner.requires_grad:
            return

        def move_grad(p: torch.Tensor) -> None:
            if not self.deferred:
                self._move(p)

        self.handles = [r.register_post_accumulate_grad_hook(move_grad) for r in self.replicas]

    def _move(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        g = p.grad.to(self.owner.device)
        self.owner.grad = g if self.owner.grad is None else sum_grads(self.owner.grad, g)
        p.grad = None

    def flush(self) -> None:
        for r in self.replicas:
            self._move(r)

    def begin_step(self) -> None:
        """Defer replica gradients and set aside what earlier steps accumulated."""
        self.deferred = True
        (self.earlier,) = set_aside_grads([self.owner])

    def end_step(self) -> None:
        """This step's gradient in stage order, then the earlier steps' added: the same sums in the
        same order as the distributed executor's (whose ranks hold the stages) under any schedule."""
        self.deferred = False
        self.flush()
        add_back_grads([self.owner], [self.earlier])
        self.earlier = None

    def unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def sync(self) -> None:
        trainable = isinstance(self.owner, nn.Parameter) and self.owner.requires_grad
        if any(r.requires_grad != trainable for r in self.replicas):  # frozen or unfrozen since: follow the owner
            for r in self.replicas:
                r.requires_grad_(trainable)
            self.unhook()
            self.hook()
        if self.owner._version != self.version:
            with torch.no_grad():
                for r in self.replicas:
                    if not _same_storage(r, self.owner):  # an alias on the owner's storage is always current
                        r.copy_(self.owner)
            self.version = self.owner._version


def set_aside_grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Take the gradients earlier steps accumulated off ``params`` (a step then sums only its own)."""
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    return earlier


def add_back_grads(params: list[torch.Tensor], earlier: list[torch.Tensor | None]) -> None:
    """Add what :func:`set_aside_grads` took back onto this step's gradients."""
    for p, g in zip(params, earlier):
        if g is not None:
            p.grad = g if p.grad is None else sum_grads(p.grad, g)


def sum_grads(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` as autograd's AccumulateGrad sums a parameter's gradients: sparse + sparse stays sparse,
    and a sparse one (a sparse embedding's) meeting a dense one (the head tied to it) gives a dense sum."""
    if a.is_sparse and not b.is_sparse:
        return b + a  # torch adds a sparse tensor into a dense one, not the other way round
    return a + b


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Placement:
    """The tensors stages hold for each state entry: one copy per device, and for a parameter
    that several stages use, a leaf of its own per extra stage (an alias of that device's copy:
    no extra memory but a gradient of its own).

    Separate gradients make a tied weight's gradient the same sum in the same order under
    every schedule: two stages accumulating into one ``.grad`` from two threads would add
    in whatever order the threads reach it.
    """

    def __init__(self, num_entries: int):
        self.copies: list[dict[torch.device, torch.Tensor]] = [{} for _ in range(num_entries)]
        self.holders: list[list[torch.Tensor]] = [[] for _ in range(num_entries)]  # per entry, in stage order

    def take(self, idx: int, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The tensor a stage on ``device`` holds for entry ``idx``."""
        first = device not in self.copies[idx]
        base = self.copies[idx].setdefault(device, place(tensor, device))
        held = base
        if not first and isinstance(base, nn.Parameter) and base.requires_grad:
            held = nn.Parameter(base.detach(), requires_grad=True)  # shares base's storage and version
        self.holders[idx].append(held)
        return held

    def owner(self, idx: int) -> torch.Tensor | None:
        return self.holders[idx][0] if self.holders[idx] else None

    def ties(self) -> list[tuple[int, torch.Tensor, list[torch.Tensor]]]:
        """(entry, owner, the other distinct tensors holding it) for every entry held more than once."""
        out = []
        for idx, held in enumerate(self.holders):
            distinct = list({id(t): t for t in held}.values())
            if len(distinct) > 1:
                out.append((idx, distinct[0], distinct[1:]))
        return out


def attach(module: nn.Module, target: str, obj: Any, persistent: bool = True) -> None:
    *prefix, leaf = target.split(".")
    for part in prefix:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(obj, nn.Parameter):
        module.register_parameter(leaf, obj)
    elif isinstance(obj, torch.Tensor):
        module.register_buffer(leaf, obj, persistent=persistent)
    else:
        module.add_module(leaf, obj)


def place(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if t.is_meta:  # materializing: storage of the right shape, values to come (init or a checkpoint)
        moved = torch.empty(t.shape, dtype=t.dtype, device=device)
    else:
        moved = t.detach().to(device, copy=True)  # a replica never aliases the owner
    return nn.Parameter(moved, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else moved


def zero_grads(params: Iterable[torch.Tensor], set_to_none: bool = True) -> None:
    for p in params:
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
