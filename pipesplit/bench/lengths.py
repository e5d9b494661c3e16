"""``pipesplit.benchmark`` over the lengths a plan was made for: each configuration predicted and measured at each."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from pipesplit.compat import pytree
from pipesplit.meta import META_KEY
from pipesplit.passes.annotate.flops import at_sizes
from pipesplit.passes.plan.lengths import LengthMix, costs_at, length_mix
from pipesplit.passes.split.program import SplitProgram


def program_mix(prog: SplitProgram) -> LengthMix | None:
    """The lengths ``prog``'s plan was made for (``compile(..., plan_lengths=...)``), None if it was made for one."""
    plan = prog.plan
    if not plan.lengths:
        return None
    return length_mix(prog.captured_gm, prog.inputs, prog.batch_dim, dict(zip(plan.lengths, plan.length_weights)))


@contextlib.contextmanager
def stage_costs_at(prog: SplitProgram, mix: LengthMix, length: int) -> Iterator[None]:
    """Within the block the stages' nodes carry their costs at ``length`` (what ``predict`` reads)."""
    gm = prog.captured_gm
    with costs_at(gm, mix, length), at_sizes({mix.symbol: length}):
        at = {n.name: n.meta[META_KEY] for n in gm.graph.nodes if META_KEY in n.meta}
        saved = []
        for stage in prog.stages:
            for node in stage.module.graph.nodes:
                if node.name in at and META_KEY in node.meta:
                    saved.append((node, node.meta[META_KEY]))
                    node.meta[META_KEY] = at[node.name]
        try:
            yield
        finally:
            for node, cost in saved:
                node.meta[META_KEY] = cost


def at_length(value: Any, mix: LengthMix, length: int) -> Any:
    """``value`` (the inputs, the target) with every tensor whose dimension ``mix.dim`` is the example's
    length cut to ``length``, or repeated along it and cut, when longer."""
    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() <= mix.dim or x.shape[mix.dim] != mix.example:
            return x
        if length > mix.example:
            reps = [1] * x.dim()
            reps[mix.dim] = -(-length // mix.example)
            x = x.repeat(*reps)
        return x.narrow(mix.dim, 0, length)

    return pytree.tree_map(one, value)
