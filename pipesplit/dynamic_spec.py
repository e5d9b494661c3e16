"""The dynamic shapes capture asks torch.export for, and the sizes export assumed for them.

The batch dimension of every tensor input is ``Dim.AUTO`` (dynamic wherever the model allows),
with the dimensions ``dynamic_dims=`` names (:mod:`pipesplit.dims`); the arguments named
``unbatched`` stay static. What export made of each dynamic dimension comes back as the range
of sizes it assumed (:func:`ranges`).
"""

from __future__ import annotations

import inspect
from typing import Any, Collection, cast

import torch
from torch import nn
from torch.export import Dim

from pipesplit.compat import is_concrete_int, pytree
from pipesplit.dims import DimSpec, dims_for


def dynamic_shapes(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int, unbatched: Collection[str] = (),
    dims: DimSpec | None = None,
) -> dict[str, Any]:
    """Mark the batch dim of every tensor input ``Dim.AUTO`` (dynamic wherever the model allows),
    and the dimensions ``dims`` names (:mod:`pipesplit.dims`), except in the arguments named in
    ``unbatched``, which stay static."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(name: str, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > batch_dim:
            more = dims_for(dims or {}, name, x.dim(), batch_dim)
            return {batch_dim: Dim.AUTO, **{d: Dim.AUTO if r is None else Dim.AUTO(min=r[0], max=r[1]) for d, r in more.items()}}
        return None

    return {
        name: pytree.tree_map(lambda x: None, value) if name in unbatched
        else pytree.tree_map(lambda x, name=name: spec(name, x), value)
        for name, value in bound.arguments.items()
    }


def argument_of_each_leaf(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """For each flat input (in ``tree_flatten((args, kwargs))`` order), the forward() argument it belongs to."""
    params = list(inspect.signature(model.forward).parameters.values())
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    out = []
    for path, _leaf in leaves:
        where, key = cast(Any, path[0]).idx, cast(Any, path[1])  # (args, kwargs)[where], then a position or a name
        if where == 0:
            i = key.idx
            p = params[min(i, len(params) - 1)]
            out.append(p.name if p.kind is not inspect.Parameter.VAR_POSITIONAL else f"{p.name}[{i}]")
        else:
            out.append(str(key.key))
    return out


def ranges(ep: Any, val: torch.Tensor) -> dict[int, tuple[int, int | None]]:
    """The sizes export assumed for each dynamic dimension of an input (from its range constraints)."""
    out: dict[int, tuple[int, int | None]] = {}
    for dim, size in enumerate(val.shape):
        if is_concrete_int(size):
            continue
        vr = ep.range_constraints.get(cast(torch.SymInt, size).node.expr)
        if vr is None:
            continue
        out[dim] = (_finite(vr.lower) or 0, _finite(vr.upper))
    return out


def _finite(bound: Any) -> int | None:
    """A range bound as an int, None for torch's and sympy's infinities."""
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
