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


_PASS_THROUGH = {"view", "reshape", "_unsafe_view", "unsqueeze", "expand", "clone", "contiguous", "alias",
                 "_to_copy", "to", "slice", "squeeze", "lift_fresh_copy", "detach"}


def position_limits(gm: fx.GraphModule, inputs: list[fx.Node]) -> dict[tuple[int, int], tuple[int, str]]:
    """Dynamic input dimensions a table caps: (input position, dimension) -> (the largest size, why).

    A learned position table of N rows looked up by ``arange(T)`` (``pos(torch.arange(t))``, Hugging
    Face's ``wpe(position_ids)``) takes sequences of at most N: torch.export records no bound for
    that (an index out of range is a value, not a shape), so a longer one would fail inside a
    stage. Found here from the graph: an embedding whose indices are an ``arange`` (through views
    and an added offset) ending at a size of an input.
    """
    aten = torch.ops.aten
    where: dict[Any, list[tuple[int, int]]] = {}
    for i, node in enumerate(inputs):
        val = node.meta.get("val")
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and getattr(size.node.expr, "is_Symbol", False):
                where.setdefault(size.node.expr, []).append((i, d))
    out: dict[tuple[int, int], tuple[int, str]] = {}
    for node in gm.graph.nodes:
        if node.target is not aten.embedding.default or not isinstance(node.args[0], fx.Node):
            continue
        table = node.args[0].meta.get("val")
        found = _arange_end(node.args[1])
        if not isinstance(table, torch.Tensor) or found is None:
            continue
        end, offset = found
        expr = end.node.expr
        symbols: set[Any] = set(getattr(expr, "free_symbols", set()))
        if len(symbols) != 1:
            continue
        (sym,) = symbols
        shift = expr - sym
        if not getattr(shift, "is_Integer", False):
            continue
        rows = int(table.shape[0])
        most = rows - offset - int(shift)  # arange's last index, end - 1 + offset, within the table's rows
        name = node.args[0].target if node.args[0].op == "get_attr" else node.args[0].name
        for key in where.get(sym, []):
            if key not in out or most < out[key][0]:
                out[key] = (most, f"{name!r} is a table of {rows} rows looked up by position, so a longer input has "
                                  "no row for its last positions (give the model a larger table for more)")
    return out


def _arange_end(node: Any) -> tuple[Any, int] | None:
    """Where ``node`` is ``arange(..., end)`` (through views and an added constant): end (a SymInt) and the constant."""
    aten, offset = torch.ops.aten, 0
    while isinstance(node, fx.Node) and node.op == "call_function":
        name = getattr(node.target, "_opname", None)
        if node.target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            step = node.args[2] if len(node.args) > 2 else 1
            end = node.args[0] if node.target is aten.arange.default else node.args[1]
            val = end.meta.get("val") if isinstance(end, fx.Node) else None
            return (val, offset) if isinstance(val, torch.SymInt) and step == 1 else None
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(tensors) != 1 or node.args[0] is not tensors[0]:
            return None
        if name == "add" and len(node.args) > 1 and isinstance(node.args[1], int) and not node.kwargs.get("alpha"):
            offset += node.args[1]
        elif name not in _PASS_THROUGH:
            return None
        node = tensors[0]
    return None
