"""The sizes a call gives the stage graphs' symbols: the batch's, and each dynamic length's or image size's.

A graph captured with dynamic dimensions names each by a symbol (``s0``, ``s1``); a boundary's
shape is an expression of them (``(s0, s1, 64)``, ``s0 * s1``). Every rank knows a step's
microbatches, so each derives the shapes it receives from their sizes (nothing about shapes
travels): :func:`input_symbols` says where each symbol is read, :func:`sizes_of` reads them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence, cast

import torch
import torch.fx as fx

from pipesplit.capture import static_dim


def input_symbols(gm: fx.GraphModule) -> list[tuple[int, int, Any]]:
    """(flat input position, dimension, symbol) of each dynamic input dimension, the first place each symbol is read."""
    out, seen = [], set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            expr = None if static_dim(size) is not None else cast(torch.SymInt, size).node.expr
            if expr is not None and getattr(expr, "is_Symbol", False) and expr not in seen:
                seen.add(expr)
                out.append((i, d, expr))
    return out


def sizes_of(flat: Sequence[Any], symbols: Sequence[tuple[int, int, Any]], skip: Any = ()) -> dict[Any, int]:
    """The value of each symbol (but those in ``skip``) in a call's (or a microbatch's) flat inputs."""
    return {sym: int(flat[i].shape[d]) for i, d, sym in symbols
            if sym not in skip and isinstance(flat[i], torch.Tensor) and flat[i].dim() > d}


def size_key(batch: int, sizes: Mapping[Any, int]) -> int | tuple[int, ...]:
    """What tells one microbatch shape from another: the batch, with every other size where there are any."""
    return (batch, *(sizes[s] for s in sorted(sizes, key=str))) if sizes else batch


def substitute(expr: Any, env: Mapping[Any, int]) -> Any:
    """``expr`` with its symbols replaced by their sizes in ``env``."""
    return expr.subs({sym: env[sym] for sym in expr.free_symbols})
