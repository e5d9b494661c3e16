"""Transform: the devices a stage graph names as constants follow the stage to where it runs."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from pipesplit.compat import pytree
from pipesplit.capture import Captured


def capture_device(captured: Captured) -> torch.device:
    """The device the graph's constants name: ``meta`` if any state was captured there, else the
    first state tensor's or tensor input's."""
    tensors = [e.tensor for e in captured.state] + [x for x in captured.example_flat if isinstance(x, torch.Tensor)]
    if any(t.is_meta for t in tensors):
        return torch.device("meta")
    return tensors[0].device if tensors else torch.device("cpu")


def retarget(gm: fx.GraphModule, old: torch.device, new: torch.device) -> int:
    """Rewrite, in place, every constant device ``old`` among ``gm``'s op arguments (and its
    higher-order ops' bodies) to ``new``; returns how many were rewritten.

    Export bakes the device of the tensors it traced into the graph: ``torch.arange(T,
    device=h.device)`` becomes ``arange(T, device=meta)`` for a model built on ``meta``, and
    ``device=cpu`` for one captured on the CPU. Once the stage's tensors live on ``new``, those
    tensors must too. A device the model names other than the capture's is left alone.
    """
    if old == new:
        return 0
    count = 0

    def swap(value: Any) -> Any:
        nonlocal count
        if isinstance(value, torch.device) and value == old:
            count += 1
            return new
        return value

    for node in gm.graph.nodes:
        if node.op == "call_function":
            kwargs = dict(node.kwargs)
            if isinstance(kwargs.get("device"), str):  # export writes torch.device; a hand-made graph may not
                kwargs["device"] = torch.device(kwargs["device"])
            node.args, node.kwargs = pytree.tree_map(swap, (node.args, kwargs))
        elif node.op == "get_attr":
            body = _attr(gm, str(node.target))
            if isinstance(body, fx.GraphModule):
                count += retarget(body, old, new)
    if count:
        gm.recompile()
    return count


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj

