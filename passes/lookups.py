"""Analysis: inputs whose batch dimension counts rows a model looks up, not samples."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def indexed_by(table: fx.Node, others: set[fx.Node], batch_dim: int) -> str | None:
    """The input whose values pick rows of ``table`` along ``batch_dim`` (an embedding, ``table[idx]``,
    ``index_select``, ``gather``), if any: then that dimension counts values, not samples."""
    aten = torch.ops.aten
    for user in table.users:
        args: Any = user.args
        index: Any = None
        if user.target is aten.embedding.default and args[0] is table:
            index = args[1]
        elif user.target is aten.index.Tensor and args[0] is table and len(args[1]) > batch_dim:
            index = args[1][batch_dim]
        elif user.target in (aten.index_select.default, aten.gather.default) and args[0] is table \
                and args[1] in (batch_dim, batch_dim - len(table.meta["val"].shape)):
            index = args[2]
        val = index.meta.get("val") if isinstance(index, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype not in (torch.bool, torch.uint8):
            source = _input_under(index, others, table)
            if source is not None:
                return source
    return None


def _input_under(node: fx.Node, inputs: set[fx.Node], avoid: fx.Node) -> str | None:
    """The name of an input among ``inputs`` that ``node`` is computed from without ``avoid``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n is avoid:
            continue
        seen.add(n)
        if n in inputs:
            return n.name
        # values only: a size (sym_size -> arange(B)) says how many rows, not which
        todo.extend(a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))
    return None
