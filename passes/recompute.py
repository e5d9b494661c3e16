"""Which values are cheaper to recompute in a consumer stage than to send there.

A value qualifies when it derives only from program inputs, buffers that are never
written, and constants — attention masks, rotary tables, position biases: no
parameter that trains, no random op, no in-place write anywhere in its history.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from pipesplit.meta import node_cost
from pipesplit.passes.chain import COMPUTE_OPS


def _impure(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return True
        return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
    return node.op != "call_function"


def recomputable(gm: fx.GraphModule, mutated_targets: set[str] = frozenset()) -> dict[str, int]:  # type: ignore[assignment]
    """Nodes whose value may be recomputed anywhere -> FLOPs of recomputing their whole history."""
    pure: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            pure[node] = 0
        elif node.op == "get_attr":
            c = node_cost(node)
            if not c.trainable and str(node.target) not in mutated_targets:
                pure[node] = 0
        elif node.op in COMPUTE_OPS and not _impure(node) and not node_cost(node).requires_grad:
            inputs = node.all_input_nodes
            if all(a in pure for a in inputs):
                history = {node}
                stack = list(inputs)
                while stack:  # FLOPs of the whole pure history, each node once
                    a = stack.pop()
                    if a not in history and a.op in COMPUTE_OPS:
                        history.add(a)
                        stack.extend(a.all_input_nodes)
                pure[node] = sum(node_cost(h).fwd_flops for h in history)
    return {n.name: flops for n, flops in pure.items() if n.op in COMPUTE_OPS}
