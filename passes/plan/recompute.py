"""Which values are cheaper to recompute in a consumer stage than to send there.

A value qualifies when it is a pure function of the program inputs, of buffers that
nothing writes, and of constants — attention masks, rotary tables, position biases: no
parameter that trains, no random op, no op with a side effect, and no in-place write to
the storage of anything in its history or of the value itself, whether before or after
it is computed (see :mod:`pipesplit.passes.aliasing`). Rebuilding a value that a later op
writes in place (a state buffer ``torch.zeros(...)`` that every layer fills, as in HF
RWKV) would hand its consumers a fresh, unwritten copy.
"""

from __future__ import annotations

import torch.fx as fx

from pipesplit.meta import COMPUTE_OPS, node_cost
from pipesplit.passes.aliasing import pure_op, storage_classes


def recomputable(gm: fx.GraphModule, mutated_targets: set[str] = frozenset()) -> dict[str, int]:  # type: ignore[assignment]
    """Nodes whose value may be recomputed anywhere -> FLOPs of recomputing their whole history.

    ``mutated_targets`` names state written in place that the graph does not show (the
    graph's own writes, through views included, are found here).
    """
    classes = storage_classes(gm.graph)
    pure: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if classes.is_written(node):
            continue
        if node.op == "placeholder":
            pure[node] = 0
        elif node.op == "get_attr":
            c = node_cost(node)
            if not c.trainable and str(node.target) not in mutated_targets:
                pure[node] = 0
        elif node.op in COMPUTE_OPS and pure_op(node, classes) and not node_cost(node).requires_grad:
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
