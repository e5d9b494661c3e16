"""Orders in which to lay a graph out as a chain.

The chain solver is exact for one order of the nodes, but a graph with parallel branches
has many topological orders, and a stage is any run of consecutive nodes in one of them.
The program's own order puts a branch where the model's code computes it, which may be
long before its result is used: that result then crosses every cut in between. So the
planner also solves the *late* order, in which every node runs as late as its consumers
allow (ordered by the longest path to the end of the graph, ties in program order), and
keeps whichever plan is better. The program's order is always one
of the candidates, so the result is never worse than the exact chain optimum over it.
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

from pipesplit.passes.chain import compute_nodes


def dependency_graph(nodes: list[fx.Node]) -> nx.DiGraph:
    """Producer -> consumer edges between compute nodes."""
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    members = set(nodes)
    g.add_edges_from((n, u) for n in nodes for u in n.users if u in members)
    return g


def late_order(nodes: list[fx.Node]) -> list[fx.Node]:
    """A topological order that runs every node as late as possible (ALAP), ties in program order.

    A node's level is the length of the longest path from it to the end of the graph,
    counted backwards: a node whose result is used only by the last operation gets the
    level just below it, however early the program computes it.
    """
    g = dependency_graph(nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    depth: dict[fx.Node, int] = {}
    for n in reversed(list(nx.topological_sort(g))):
        depth[n] = max((depth[u] + 1 for u in g.successors(n)), default=0)
    return list(nx.lexicographical_topological_sort(g, key=lambda n: (-depth[n], pos[n])))


def candidate_orders(gm: fx.GraphModule) -> list[tuple[str, list[fx.Node]]]:
    """``("program", ...)`` first, then the other orders worth solving (those that differ from it)."""
    program = compute_nodes(gm)
    out = [("program", program)]
    late = late_order(program)
    if late != program:
        out.append(("late", late))
    return out
