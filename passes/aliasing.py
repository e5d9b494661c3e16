"""Analysis: which graph values share storage, and which nodes write into it in place.

Read off the op schemas: an argument annotated ``Tensor(a!)`` is written, one annotated
``Tensor(a)`` is aliased by the output (a view), and an in-place op's output aliases the
tensor it wrote. ``getitem`` of a view-returning op (``split``, ``unbind``) is a view too.
"""

from __future__ import annotations

import operator
from typing import Iterator

import torch
import torch.fx as fx

BATCH_NORM_OPS = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm"}


def written_args(node: fx.Node) -> list[fx.Node]:
    """The graph values ``node`` writes in place (BatchNorm's running stats in training included).

    The training-IR ``batch_norm(training=True)`` carries no write annotation in its schema,
    so that family is matched by name.
    """
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    schema = node.target._schema
    idx = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if schema.name.split("::")[-1] in BATCH_NORM_OPS:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        if training:
            idx += [3, 4]
    out = []
    for i in idx:
        arg = node.args[i] if i < len(node.args) else node.kwargs.get(schema.arguments[i].name)
        if isinstance(arg, fx.Node):
            out.append(arg)
    return out


def aliased_args(node: fx.Node) -> list[fx.Node]:
    """The graph values whose storage ``node``'s output shares (views, in-place results)."""
    if node.op != "call_function":
        return []
    if node.target is operator.getitem:
        src = node.args[0]
        return [src] if isinstance(src, fx.Node) and aliased_args(src) else []
    if not isinstance(node.target, torch._ops.OpOverload):
        return []
    schema = node.target._schema
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None:
            continue
        arg = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        if isinstance(arg, fx.Node):
            out.append(arg)
    return out


def aliases_of(value: fx.Node) -> Iterator[fx.Node]:
    """``value`` and every later value sharing its storage (views of it, in-place results on it)."""
    seen = {value}
    todo = [value]
    while todo:
        v = todo.pop()
        yield v
        for user in v.users:
            if user not in seen and v in aliased_args(user):
                seen.add(user)
                todo.append(user)


def mutated_in_place(value: fx.Node) -> bool:
    """Whether any node writes into ``value``'s storage (directly or through a view of it)."""
    members = set(aliases_of(value))
    return any(w in members for m in members for user in m.users for w in written_args(user))


def inplace_inputs(graph: fx.Graph) -> set[str]:
    """Names of the placeholders whose storage the graph writes in place."""
    return {n.name for n in graph.nodes if n.op == "placeholder" and mutated_in_place(n)}
