"""The compute nodes of a graph as a chain: per-position costs, memory and cut sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch.fx as fx

from pipesplit.meta import node_cost

COMPUTE_OPS = ("call_function", "call_module", "call_method")


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that do work, in the graph's (topological) order."""
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


@dataclass
class Chain:
    """A graph flattened to a sequence; a cut at position ``c`` starts a stage at node ``c``.

    Arrays indexed by cut position have length ``n + 1``: position 0 and ``n`` are the
    ends of the program and are always allowed.
    """

    nodes: list[fx.Node]
    cost: np.ndarray  # float64 per node: the objective's cost
    mem: np.ndarray  # int64 per node: parameter (+grad) bytes at first use + output bytes
    cut_bytes: np.ndarray  # int64 per position: bytes live across that cut
    allowed: np.ndarray  # bool per position: no tuple/list value crosses it

    @property
    def n(self) -> int:
        return len(self.nodes)


def build_chain(gm: fx.GraphModule, cost_fn: Callable[[fx.Node], float]) -> Chain:
    """Lay out ``gm``'s compute nodes as a chain; ``annotate_costs`` must have run."""
    nodes = compute_nodes(gm)
    n = len(nodes)
    pos = {node: i for i, node in enumerate(nodes)}
    cost = np.array([float(cost_fn(node)) for node in nodes], dtype=np.float64)
    mem = np.zeros(n, dtype=np.int64)
    live = np.zeros(n + 2, dtype=np.int64)
    blocked = np.zeros(n + 2, dtype=np.int64)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            first = min((pos[u] for u in node.users if u in pos), default=None)
            if first is not None:
                c = node_cost(node)
                mem[first] += c.param_bytes * (2 if c.trainable else 1)
    for i, node in enumerate(nodes):
        c = node_cost(node)
        mem[i] += c.out_bytes
        last = max((pos.get(u, n) for u in node.users), default=i)  # the output node counts as n
        if last > i:
            live[i + 1] += c.out_bytes
            live[last + 1] -= c.out_bytes
            if not c.sendable:
                blocked[i + 1] += 1
                blocked[last + 1] -= 1
    cut_bytes = np.cumsum(live)[: n + 1]
    allowed = np.cumsum(blocked)[: n + 1] == 0
    cut_bytes[0] = cut_bytes[n] = 0
    allowed[0] = allowed[n] = True
    return Chain(nodes, cost, mem, cut_bytes, allowed)
