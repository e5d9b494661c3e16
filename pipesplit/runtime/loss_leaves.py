"""Tensors a loss function trains that the model does not hold (a learnable temperature, a
margin, a second head defined beside the model).

Plain PyTorch's ``loss.backward()`` fills their ``.grad``; a stage's backward names what it
differentiates (its parameters and its input leaves), so without this they would silently get
nothing. :func:`loss_leaves` finds them by walking the loss's autograd graph down to the stage's
outputs: only the loss function's own few ops are visited, not the stage's graph.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def loss_leaves(loss: torch.Tensor, outputs: Iterable[Any], own: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves requiring grad that ``loss`` reaches other than through ``outputs`` (the stage's
    outputs, where the walk stops), and other than ``own`` (the stage's parameters and input
    leaves), in a fixed order."""
    stop = {t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    skip = {id(t) for t in own}
    found: list[torch.Tensor] = []
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen or fn in stop:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf
        if var is not None:
            if id(var) not in skip:
                skip.add(id(var))
                found.append(var)
            continue
        todo.extend(f for f, _ in reversed(fn.next_functions))
    return found
