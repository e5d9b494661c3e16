"""Refinement pass: correct profiled node times with measured stage times.

A per-node profile times each operation on its own; inside a stage the same operations
run back to back, with warm caches and another memory footprint, so a stage's measured
time can differ from the sum of its nodes' by 10-30%: enough to move the bottleneck.
Given a plan and its measured stages, :func:`correct_node_times` scales the forward and
the backward time of every node of a stage by that stage's measured / predicted ratio.
Planning again on the corrected times moves cuts where the profile was wrong;
``pipesplit.compile(..., refine=n)`` does this ``n`` times and keeps the plan whose
measured stages are best.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from pipesplit.meta import node_cost, set_node_cost
from pipesplit.passes.plan.step_planner import node_seconds
from pipesplit.schedules import StageCost


def correct_node_times(
    gm: fx.GraphModule, stages: Sequence[Sequence[str]], measured: Sequence[StageCost]
) -> list[tuple[float, float]]:
    """Scale each stage's node times to its measured forward and backward; returns the factors.

    Nodes without a profiled time (no ``cost="profile"`` or ``"hybrid"``) are left alone;
    a stage whose predicted forward (or backward) is zero keeps factor 1.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    factors = []
    for names, m in zip(stages, measured):
        nodes = [by_name[x] for x in names if node_cost(by_name[x]).time_s is not None]
        # forward and backward as the planner prices them (profiled, or forward x FLOP ratio)
        fwd, igrad, wgrad = node_seconds(nodes, "profile", lambda n: 0.0, 1.0).sum(axis=0)
        bwd = igrad + wgrad
        ff = m.forward / fwd if fwd > 0 and m.forward > 0 else 1.0
        fb = m.backward / bwd if bwd > 0 and m.backward > 0 else 1.0
        for n in nodes:
            c = node_cost(n)
            new = c.with_time(c.time_s * ff)  # type: ignore[operator]
            # a backward priced from the forward follows the forward's factor; a profiled one gets its own
            if c.bwd_time_s is not None:
                new = new.with_backward_time(c.bwd_time_s * fb)
            set_node_cost(n, new)
        factors.append((ff, fb))
    return factors
