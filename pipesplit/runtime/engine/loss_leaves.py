"""Tensors a loss function trains that the model does not hold (a learnable temperature, a
margin, a second head defined beside the model).

Plain PyTorch's ``loss.backward()`` fills their ``.grad``; a stage's backward names what it
differentiates (its parameters and its input leaves), so without this they would silently get
nothing. :func:`loss_leaves` finds them by walking the loss's autograd graph down to the stage's
outputs: only the loss function's own few ops are visited, not the stage's graph. The outputs'
autograd nodes are taken before the loss function runs (:func:`output_nodes`): an in-place op in
the loss (``logits.div_(t)``) makes itself the output's node, and the walk must pass through it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from pipesplit.compat import pytree
from pipesplit.errors import PipesplitError


def checked_loss(value: Any, microbatch: int) -> torch.Tensor:
    """``value`` if it is what a loss function must return, a 0-dim floating-point tensor; else a
    PipesplitError saying what it returned."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
        return value
    if isinstance(value, torch.Tensor):
        what = f"a tensor of shape {tuple(value.shape)}" if value.dim() else f"a {value.dtype} tensor"
    else:
        what = f"a {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
    raise PipesplitError(
        f"loss_fn returned {what} for microbatch {microbatch}; it must return the microbatch's loss as a 0-dim "
        "floating-point tensor that autograd can differentiate (e.g. F.cross_entropy(out, target)): reduce it with "
        "a mean or a sum (Pipeline(loss_reduction=...) says which), and hand metrics out another way (a list the "
        "loss_fn appends to)."
    )


def called_loss(loss_fn: Any, output: Any, target: Any, microbatch: int, stage: int) -> torch.Tensor:
    """``loss_fn(output, target)`` for one microbatch as :func:`checked_loss` takes it; an error the
    user's loss function raises comes back naming the microbatch, the stage and what it was given."""
    def outline(tree: Any) -> str:
        return str(pytree.tree_map(lambda x: f"Tensor{list(x.shape)}" if isinstance(x, torch.Tensor) else x, tree))

    try:
        value = loss_fn(output, target)
    except PipesplitError:
        raise
    except Exception as e:
        hint = (" step() was given no target: pass pipe.step(x, target=y), or a loss_fn that ignores it."
                if target is None else " Each microbatch's target is its slice of step()'s target along "
                "target_batch_dim, as its output is the model's output for its slice of the inputs.")
        raise PipesplitError(
            f"loss_fn raised on microbatch {microbatch} (stage {stage}, the last): {type(e).__name__}: {e}. It was "
            f"called as loss_fn(output, target) with output {outline(output)} and target {outline(target)}.{hint}"
        ) from e
    loss = checked_loss(value, microbatch)
    if torch.is_grad_enabled() and not loss.requires_grad and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves(output)):
        raise PipesplitError(
            f"loss_fn returned a loss that does not require grad for microbatch {microbatch} (stage {stage}), though "
            "the model's output does: it was detached (.detach(), .item(), torch.no_grad() or a new tensor), so no "
            "gradient can flow back. Return the loss computed from the output itself."
        )
    return loss


def output_nodes(outputs: Iterable[Any]) -> set[Any]:
    """The autograd nodes that made ``outputs``, and the outputs that are leaves themselves (a
    parameter returned as it is): where :func:`loss_leaves` stops."""
    tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    return {t.grad_fn for t in tensors if t.grad_fn is not None} | {id(t) for t in tensors if t.grad_fn is None}


def loss_leaves(loss: torch.Tensor, stop: set[Any], params: Iterable[torch.Tensor],
                inputs: Iterable[torch.Tensor] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Leaves requiring grad that ``loss`` reaches other than through the nodes in ``stop`` (the
    stage outputs', :func:`output_nodes`), in a fixed order: (those that are neither the stage's
    ``params`` nor its input leaves; those of ``params`` it reaches directly, by closure)."""
    mine = {id(t) for t in params}
    stop = stop | {id(t) for t in inputs}
    found: list[torch.Tensor] = []
    direct: list[torch.Tensor] = []
    seen: set[Any] = set()
    taken: set[int] = set()
    todo = [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen or fn in stop:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf
        if var is not None:
            if id(var) not in taken and id(var) not in stop:  # a leaf the stage returned is an output
                taken.add(id(var))
                (direct if id(var) in mine else found).append(var)
            continue
        todo.extend(f for f, _ in reversed(fn.next_functions))
    return found, direct
