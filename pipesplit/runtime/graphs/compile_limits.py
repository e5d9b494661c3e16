"""What compiled stages cannot take, and why, in words for a warning: each reason a silent wrong
result or a raw error the differential fuzzer found in compiled code, or a feature the explicit
F/I/W graphs (:mod:`pipesplit.runtime.graphs.stage_graphs`) do not model."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from pipesplit.rng import seeded


def failure(error: Exception) -> str:
    """A compiled call's error for a warning: its type and torch's first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:160] if text else ''}"


def compile_blocker(module: torch.nn.Module, live: Sequence[int] | None = None) -> str | None:
    """Why ``compile=`` runs this stage eager at all (None: it may compile). Each reason is a silent
    wrong result the differential fuzzer found in compiled stages: a write in place (``relu_`` on a
    value read again, a BatchNorm's or an EMA's buffer update, also inside a ``no_grad`` block),
    and a parameter the outputs do not reach (plain PyTorch leaves its ``.grad`` None, so an
    optimizer skips it; compiled code gave it zeros, which AdamW's weight decay then applied).
    ``live``: the outputs a gradient comes back for (None: all); a parameter that reaches only the
    others (a cut that carries no gradient) counts as unreached."""
    if not isinstance(module, fx.GraphModule):
        return "the stage is not a graph"
    for gm in (m for m in module.modules() if isinstance(m, fx.GraphModule)):  # higher-order ops' bodies too
        for node in gm.graph.nodes:
            schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
            if schema is not None and schema.is_mutable:
                return f"it writes in place ({node.target})"
            why = noncontiguous_batchnorm(node)
            if why is not None:
                return why
    results = list(next(n for n in module.graph.nodes if n.op == "output").args[0])
    # a gradient does not flow back through a detach: what only a detached value reads gets none
    reached = ancestors([r for i, r in enumerate(results) if live is None or i in live], stop=DETACH_OPS)
    params = {name for name, _ in module.named_parameters()}
    dead = [str(n.target) for n in module.graph.nodes if n.op == "get_attr" and str(n.target) in params
            and n not in reached]
    if dead:
        return (f"its parameter {dead[0]!r} does not reach its outputs{'' if live is None else ' that get a gradient'} "
                "(plain PyTorch leaves that gradient None; compiled code gives zeros)")
    return None


def unsupported(module: torch.nn.Module, params: Sequence[torch.Tensor], checkpointing: bool) -> str | None:
    """Why this stage cannot run as explicit compiled F/I/W graphs (None: it can)."""
    if checkpointing:
        return "activation checkpointing replays the stage"
    if any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda")):
        return "autocast is on"
    blocked = compile_blocker(module)
    if blocked is not None:
        return blocked
    assert isinstance(module, fx.GraphModule)
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is seeded:
            return "it has random ops (pipesplit's per-microbatch streams)"
        if "embedding" in str(node.target) and len(node.args) > 4 and node.args[4]:
            return "it has a sparse embedding"
    for p in params:
        if type(p) not in (torch.Tensor, torch.nn.Parameter) or p.layout != torch.strided:
            return "a parameter is a tensor subclass or not dense"
    return None


DETACH_OPS = frozenset({torch.ops.aten.detach.default})


def ancestors(roots: Sequence[Any], stop: frozenset[Any] = frozenset()) -> set[fx.Node]:
    """The nodes ``roots`` are computed from (``roots`` included), not looking past a node whose
    target is in ``stop``."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if not (n.op == "call_function" and n.target in stop):
                stack.extend(n.all_input_nodes)
    return seen


def noncontiguous_batchnorm(node: fx.Node) -> str | None:
    """AOT autograd's BatchNorm decomposition views its input, which raises a raw "view size is not
    compatible" on a non-contiguous one (a transposed activation): in the compiled backward in training
    (the fuzzer, seed 2323, with or without running statistics), in the forward in eval mode (seed 1616)."""
    if node.op != "call_function" or "batch_norm" not in str(node.target) or not node.args:
        return None
    x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if isinstance(x, torch.Tensor) and not x.is_contiguous():
        return f"a BatchNorm reads a non-contiguous input of shape {tuple(x.shape)} ({node.target})"
    return None
