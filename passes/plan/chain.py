"""The compute nodes of a graph as a chain: per-position costs, memory and cut sizes."""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import Callable, Collection

import numpy as np
import torch
import torch.fx as fx

from pipesplit.meta import COMPUTE_OPS, node_cost


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
    mem: np.ndarray  # int64 per node: new storage bytes + parameter (+grad) bytes of state only it reads
    cut_bytes: np.ndarray  # int64 per position: bytes live across that cut
    allowed: np.ndarray  # bool per position: no tuple/list value crosses it
    # State read at several positions (tied weights): (bytes, sorted positions). Every stage
    # that reads it holds a copy, so a stage's memory is its ``mem`` plus these once each.
    shared: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    # New storage per node (``held_bytes``, the activation part of ``mem``): a schedule that keeps
    # several microbatches in flight on a stage holds this several times.
    act: np.ndarray | None = None
    # Values live across each cut position (int64, n + 1): of two cuts carrying the same bytes the
    # partition takes the one sending fewer tensors (one message each). None: not counted.
    cut_tensors: np.ndarray | None = None
    # Bytes of the program's outputs: what the last stage's backward starts from (``cut_bytes[n]`` is 0).
    output_bytes: int = 0
    # Per node (int64, n): its new storage where the program returns its value, nothing else reads it and its op
    # does not save its result (a head's logits), else 0: what the last stage lets go of after its forward (its
    # loss keeps what it needs) and a recompute does not make again. None: not known.
    returned: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.nodes)

    def end_bytes(self) -> np.ndarray:
        """Per end position ``j`` (``n + 1``), the bytes a stage ending there hands on: ``cut_bytes[j]``,
        and at ``n`` the program's outputs."""
        out: np.ndarray = self.cut_bytes.astype(np.int64)
        out[self.n] = self.output_bytes
        return out

    def shared_in(self, a: int, b: int) -> list[int]:
        """The bytes of each shared tensor a node of ``[a, b)`` reads (its positions are sorted: a bisection each)."""
        out = []
        for nbytes, positions in self.shared:
            i = bisect.bisect_left(positions, a)
            if i < len(positions) and positions[i] < b:
                out.append(nbytes)
        return out

    def node_memory(self) -> np.ndarray:
        """Bytes each node alone would hold as a stage."""
        out: np.ndarray = self.mem.copy()
        for nbytes, positions in self.shared:
            out[list(positions)] += nbytes
        return out

    def total_memory(self) -> int:
        return int(self.mem.sum()) + sum(nbytes for nbytes, _ in self.shared)


# Ops whose backward reads only their inputs: where nothing else reads their result, no graph keeps it (the last
# stage lets it go after its forward) and torch's checkpoint (stopping once it has made every tensor the forward
# saved) does not make it again. A log-softmax, softmax, sigmoid or tanh saves its own result, so it is kept, and
# a recompute makes it again (a review measured such a returned value's checkpointed last stage at 1.065 of the
# figure while every returned value was taken as not remade).
_RESULT_NOT_SAVED = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                     torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, torch.ops.aten.add.Tensor,
                     torch.ops.aten.mul.Tensor, torch.ops.aten.to.dtype}


def _kept_not_remade(node: fx.Node) -> bool:
    """The program returns ``node``'s value, nothing else reads it and its op does not save its result: the last
    stage lets it go after its forward, and a recompute does not make it again."""
    return bool(node.users) and all(u.op == "output" for u in node.users) and node.target in _RESULT_NOT_SAVED


def _itemsize(value: object) -> int:
    return value.element_size() if isinstance(value, torch.Tensor) else 4


def build_chain(
    gm: fx.GraphModule,
    cost_fn: Callable[[fx.Node], float],
    *,
    state_factor: float | Callable[[int], float] = 2.0,
    recompute: Collection[str] = (),
    order: list[fx.Node] | None = None,
) -> Chain:
    """Lay out ``gm``'s compute nodes as a chain; ``annotate_costs`` must have run.

    ``order`` is a topological order of the compute nodes (default: the program's).

    ``state_factor`` multiplies the bytes of trainable parameters (weights + gradients
    by default; add optimizer state for training memory), or gives that factor per element
    size (``MemoryModel.state_factor_for``: bf16 weights with fp32 master weights and moments). Values named in
    ``recompute`` are rebuilt by each stage that needs them, so they never cross a cut.
    """
    nodes = compute_nodes(gm) if order is None else list(order)
    n = len(nodes)
    pos = {node: i for i, node in enumerate(nodes)}
    cost = np.array([float(cost_fn(node)) for node in nodes], dtype=np.float64)
    mem = np.zeros(n, dtype=np.int64)
    live = np.zeros(n + 2, dtype=np.int64)
    values = np.zeros(n + 2, dtype=np.int64)
    blocked = np.zeros(n + 2, dtype=np.int64)
    readers: dict[int, tuple[int, set[int]]] = {}  # id(tensor) -> (bytes, positions reading it)
    for node in gm.graph.nodes:
        uses = {pos[u] for u in node.users if u in pos}
        if node.op == "get_attr" and uses:
            c = node_cost(node)
            tensor = operator.attrgetter(str(node.target))(gm)
            key = id(tensor)  # tied names share one tensor
            factor = state_factor if not callable(state_factor) else state_factor(_itemsize(tensor))
            nbytes = int(c.param_bytes * (factor if c.trainable else 1))
            readers.setdefault(key, (nbytes, set()))[1].update(uses)
    shared = []
    for nbytes, positions in readers.values():
        if len(positions) == 1:
            mem[min(positions)] += nbytes
        else:
            shared.append((nbytes, tuple(sorted(positions))))
    for i, node in enumerate(nodes):
        c = node_cost(node)
        mem[i] += c.held_bytes  # each storage once: a view or an in-place write allocates nothing new
        last = max((pos.get(u, n) for u in node.users), default=i)  # the output node counts as n
        if last > i and node.name not in recompute:
            live[i + 1] += c.out_bytes
            live[last + 1] -= c.out_bytes
            values[i + 1] += 1
            values[last + 1] -= 1
            if not c.sendable:
                blocked[i + 1] += 1
                blocked[last + 1] -= 1
    cut_bytes = np.cumsum(live)[: n + 1]
    output_bytes = int(cut_bytes[n])
    allowed = np.cumsum(blocked)[: n + 1] == 0
    cut_tensors = np.cumsum(values)[: n + 1]
    cut_bytes[0] = cut_bytes[n] = cut_tensors[0] = cut_tensors[n] = 0
    allowed[0] = allowed[n] = True
    act = np.array([node_cost(node).held_bytes for node in nodes], dtype=np.int64)
    returned = np.array([node_cost(node).held_bytes if _kept_not_remade(node) else 0 for node in nodes], dtype=np.int64)
    return Chain(nodes, cost, mem, cut_bytes, allowed, shared, act, cut_tensors, output_bytes, returned)
