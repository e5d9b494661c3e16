"""Orders in which to lay a graph out as a chain.

The chain solver is exact for one order of the nodes, but a graph with parallel branches
has many topological orders, and a stage is any run of consecutive nodes in one of them.
The program's own order puts a branch where the model's code computes it, which may be
long before its result is used: that result then crosses every cut in between. So the
planner also solves the *late* order, in which every node runs as late as its consumers
allow (ordered by the longest path to the end of the graph, ties in program order), and
keeps whichever plan is better. The program's order is always one
of the candidates, so the result is never worse than the exact chain optimum over it.

Data edges alone do not order an in-place write: ``buf[:, t].copy_(v)`` has no users, and
a read of ``buf`` before it does not feed it. The dependency graph therefore also keeps
every write in program order with every other access to the same storage (see
:func:`pipesplit.passes.aliasing.ordering_edges`), so no order moves a read across a write.
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

from pipesplit.passes.aliasing import ordering_edges


def dependency_graph(nodes: list[fx.Node]) -> nx.DiGraph:
    """Producer -> consumer edges between compute nodes, and the edges that keep each in-place
    write in program order with the other accesses to its storage."""
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    members = set(nodes)
    g.add_edges_from((n, u) for n in nodes for u in n.users if u in members)
    g.add_edges_from(ordering_edges(nodes))
    return g


def late_order(nodes: list[fx.Node]) -> list[fx.Node]:
    """A topological order that runs every node as late as possible (ALAP), ties in program order.

    A node's depth is the length of the longest path from it to the end of the graph (its
    topological generation in the reversed graph): a node whose result only the last
    operation uses gets depth 1, however early the program computes it. Sorting by
    decreasing depth is topological, since a producer is always deeper than its consumers.
    """
    depth = {}
    for d, generation in enumerate(nx.topological_generations(dependency_graph(nodes).reverse(copy=False))):
        for n in generation:
            depth[n] = d
    pos = {n: i for i, n in enumerate(nodes)}
    return sorted(nodes, key=lambda n: (-depth[n], pos[n]))


def candidate_orders(program: list[fx.Node]) -> list[tuple[str, list[fx.Node]]]:
    """The program's order of its compute nodes first, then the other orders worth solving
    (those that differ from it)."""
    out = [("program", program)]
    late = late_order(program)
    if late != program:
        out.append(("late", late))
    return out
