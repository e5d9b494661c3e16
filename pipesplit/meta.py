"""Typed per-node metadata: one key in ``node.meta`` holding a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.fx as fx

from pipesplit.errors import CostError

META_KEY = "pipesplit_cost"
COMPUTE_OPS = ("call_function", "call_module", "call_method")  # the nodes that run an operation


def is_sparse_lookup(node: fx.Node) -> bool:
    """An ``nn.Embedding(sparse=True)`` lookup: its weight gets a sparse gradient."""
    return node.target is torch.ops.aten.embedding.default and len(node.args) > 4 and node.args[4] is True


def node_module_paths(node: fx.Node) -> list[str]:
    """The submodules ``node`` ran inside, outermost first (``["layers", "layers.0", "layers.0.attn"]``),
    from export's ``nn_module_stack``; the root and torch's placeholders left out."""
    return [p for p, _ in (node.meta.get("nn_module_stack") or {}).values()
            if p and not p.startswith("_empty_nn_module_stack")]


@dataclass(frozen=True)
class NodeCost:
    """Costs of one graph node, written by ``pipesplit.passes.annotate.costs.annotate_costs``.

    FLOPs count multiply and add separately (a multiply-add is 2 FLOPs).
    """

    fwd_flops: int = 0  # forward
    igrad_flops: int = 0  # backward, gradient w.r.t. activations (inputs)
    wgrad_flops: int = 0  # backward, gradient w.r.t. parameters
    param_bytes: int = 0  # bytes of the parameter/buffer this node reads (get_attr nodes)
    trainable: bool = False  # a get_attr of a parameter that requires grad
    out_bytes: int = 0  # bytes of the tensors this node produces
    # bytes of new storage it allocates: its out_bytes, or 0 for a view or an in-place write of storage
    # already counted (an earlier node's, a parameter's, an input's); what activation memory adds up
    held_bytes: int = 0
    # elements of a model output this node makes: the loss function reads each (in the last stage),
    # priced like an activation forward and backward (a 32k-vocabulary cross-entropy is not free)
    loss_elements: int = 0
    sendable: bool = True  # its value may cross a stage boundary (tensors, ints, None)
    requires_grad: bool = False  # its value carries a gradient in training
    known: bool = True  # False: no formula for the op; FLOPs estimated from output size
    time_s: float | None = None  # profiled forward time on the stage's device
    bwd_time_s: float | None = None  # profiled backward time (input- and weight-gradient together)

    @property
    def bwd_flops(self) -> int:
        return self.igrad_flops + self.wgrad_flops

    @property
    def total_flops(self) -> int:
        return self.fwd_flops + self.igrad_flops + self.wgrad_flops

    def with_time(self, seconds: float) -> "NodeCost":
        return replace(self, time_s=seconds)

    def with_backward_time(self, seconds: float | None) -> "NodeCost":
        return replace(self, bwd_time_s=seconds)

    def backward_split(self, seconds: float) -> tuple[float, float]:
        """``seconds`` of backward shared between input- and weight-gradient work by their FLOPs."""
        total = self.igrad_flops + self.wgrad_flops
        if total:
            return seconds * self.igrad_flops / total, seconds * self.wgrad_flops / total
        return seconds, 0.0


def node_cost(node: fx.Node) -> NodeCost:
    """The node's costs; raises if ``annotate_costs`` has not run on its graph."""
    cost = node.meta.get(META_KEY)
    if cost is None:
        raise CostError(
            f"node {node.name!r} has no cost annotation: run "
            "pipesplit.passes.annotate.costs.annotate_costs(gm) before planning."
        )
    return cast(NodeCost, cost)


def set_node_cost(node: fx.Node, cost: NodeCost) -> None:
    node.meta[META_KEY] = cost
