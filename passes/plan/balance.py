"""A second objective after the bottleneck: balance the stages that do not set it.

A min-max split says nothing about the stages that do not set the bottleneck;
:func:`rebalance` re-splits the positions on either side of the bottleneck stage,
keeping it where it is, for those stages' own balance.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.partition import largest_stage

Solve = Callable[[Chain, int, int, int], Sequence[int]]


def sub_chain(chain: Chain, a: int, b: int) -> Chain:
    """Positions ``[a, b)`` of ``chain`` as a chain of their own (its two ends become program ends)."""
    mem = chain.mem[a:b].copy()
    shared = []
    for nbytes, positions in chain.shared:
        inside = tuple(p - a for p in positions if a <= p < b)
        if len(inside) > 1:
            shared.append((nbytes, inside))
        elif inside:
            mem[inside[0]] += nbytes
    cut = chain.cut_bytes[a : b + 1].copy()
    allowed = chain.allowed[a : b + 1].copy()
    cut[0] = cut[-1] = 0
    allowed[0] = allowed[-1] = True
    act = None if chain.act is None else chain.act[a:b]
    tensors = None if chain.cut_tensors is None else chain.cut_tensors[a : b + 1].copy()
    if tensors is not None:
        tensors[0] = tensors[-1] = 0
    returned = chain.returned[a:b] if chain.returned is not None and b == chain.n else None
    return Chain(chain.nodes[a:b], chain.cost[a:b], mem, cut, allowed, shared, act, tensors, int(chain.end_bytes()[b]),
                 returned)


def rebalance(chain: Chain, starts: Sequence[int], solve: Solve) -> tuple[int, ...]:
    """Balance the stages that do not set the bottleneck, keeping the one that does.

    A min-max split says nothing about the other stages: when one indivisible operation
    (a large-vocabulary head) sets the bottleneck, any split whose other stages stay
    under it is optimal, including ones that leave stages nearly empty and pile layers
    on others. This keeps the largest stage where it is and re-splits the positions on
    each side of it into the same number of stages by ``solve``, recursively. A side
    whose new split would have a stage above the kept one keeps its old split, so the
    bottleneck never grows.

    ``solve(sub, k, first_stage, first_pos)`` splits ``sub`` (the positions from
    ``first_pos`` on, that stages ``first_stage`` onwards will hold) into ``k`` stages
    and returns their starts in ``sub``'s positions.
    """
    bounds = list(starts) + [chain.n]
    k = len(starts)
    if k <= 1:
        return tuple(starts)
    costs = [float(chain.cost[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    t = int(np.argmax(costs))

    def side(first: int, last: int) -> list[int]:  # stages first..last-1
        a, b = bounds[first], bounds[last]
        if last - first <= 1:
            return bounds[first:last]
        sub = sub_chain(chain, a, b)
        new = list(solve(sub, last - first, first, a))
        if largest_stage(sub, new) > costs[t]:
            new = [x - a for x in bounds[first:last]]
        inner = rebalance(sub, new, lambda c, s, st, pos: solve(c, s, st + first, pos + a))
        return [a + x for x in inner]

    return tuple(side(0, t) + [bounds[t]] + side(t + 1, k))
