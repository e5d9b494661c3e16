"""Reads of a buffer written in place get a copy of it: what a microbatch read stays as it read it."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from pipesplit.passes.aliasing import storage_classes


def snapshot_state_reads(graph: fx.Graph, is_buffer: Callable[[str], bool]) -> int:
    """Give every read of a buffer that the graph writes in place (``self.ema.mul_(0.9).add_(...)``; ``h + self.ema``)
    a copy of the buffer made where the read happens; return how many copies were added.

    Gradient accumulation runs microbatch ``k``'s forward and backward before ``k + 1``'s forward. A pipeline
    does not: a value saved for ``k``'s backward, or sent to another stage (by reference between threads, or
    still in flight), would otherwise be the buffer itself, which ``k + 1``'s forward then writes. A copy taken
    at the read holds the value accumulation reads, and the writes still reach the buffer in microbatch order.
    Reads are the users of the buffer's storage class that neither write it nor alias it (those pass it on to
    their own users), and the graph's output. Parameters are left alone: a parameter written in place needs its
    gradient (see :mod:`pipesplit.runtime.state.state_writes`). Graphs without such buffers are not changed.
    """
    classes = storage_classes(graph)
    roots = {classes.root(n) for n in graph.nodes
             if n.op == "get_attr" and is_buffer(str(n.target)) and classes.is_written(n)}
    if not roots:
        return 0
    added = 0
    for node in list(graph.nodes):
        if node.op in ("output", "placeholder") or classes.root(node) not in roots:
            continue
        for user in list(node.users):
            if user.op != "output" and (classes.root(user) in roots or node in classes.writes.get(user, ())):
                continue
            with graph.inserting_before(user):
                copy = graph.call_function(torch.ops.aten.clone.default, (node,))
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                copy.meta["val"] = val
            user.replace_input_with(node, copy)
            added += 1
    return added
