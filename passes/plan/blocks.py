"""Cuts between a model's repeated blocks, priced in seconds against the free split.

Pipeline systems give each stage whole layers (Megatron-LM and torchtitan by layer counts, DeepSpeed by
layer), so their users expect a stage boundary between two blocks, where one tensor crosses (the
residual stream). The free split balances cost exactly and may cut inside attention, where several
cross (the residual, its normalised copy, a projection), for a few percent of balance. Balance alone
(cost units, bytes as a tie-break within ``slack``) does not see that each crossing tensor is a
message, forward and backward. :func:`prefer_block_cuts` prices both splits in seconds, each stage
its compute at the device's rate plus its cuts' messages (:class:`CommModel`: latency per tensor plus
bytes over bandwidth, its activations forward and their gradients backward), and keeps the split
between blocks when it is faster, by more than a tie, and its bottleneck is at most twice ``slack``
above the free split's (``slack=0``: the exact optimum, as asked): the link's figures are defaults,
not measured, and a tiny model, whose stages take microseconds, would otherwise give up any balance
for one message less. On a tie the free split stays: its other stages are balanced too (a split
between blocks may leave a stage with no block when a large head sets the bottleneck).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch.fx as fx

from pipesplit.errors import PlanError
from pipesplit.passes.plan.advice import repeated_blocks
from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.constraints import module_positions
from pipesplit.passes.plan.objective import CommModel
from pipesplit.passes.plan.partition import largest_stage
from pipesplit.passes.plan.step_planner import TIE

__all__ = ["block_paths", "between_blocks", "priced_seconds", "prefer_block_cuts"]

Split = Callable[[Chain], Sequence[int]]


def block_paths(gm: fx.GraphModule, num_stages: int) -> list[str]:
    """The repeated blocks' module paths (``model.layers.0``, ...) when ``num_stages`` stages can each
    hold whole blocks; ``[]`` when the model has none, or fewer blocks than stages (:mod:`advice` says so)."""
    found = repeated_blocks(gm)
    if found is None or num_stages < 2 or num_stages > found[1]:
        return []
    prefix, n = found
    return [f"{prefix}.{i}" if prefix else str(i) for i in range(n)]


def between_blocks(chain: Chain, paths: Sequence[str]) -> np.ndarray:
    """``chain.allowed`` with every cut strictly inside one of the blocks ``paths`` removed."""
    out: np.ndarray = chain.allowed.copy()
    for path in paths:
        pos = module_positions(chain.nodes, path)
        if pos:
            out[pos[0] + 1 : pos[-1] + 1] = False
    return out


def priced_seconds(chain: Chain, starts: Sequence[int], seconds_per_cost: float, comm: CommModel,
                   device_kind: str) -> float:
    """The slowest stage of the split at ``starts``, in seconds: its cost at ``seconds_per_cost``, plus
    the messages at the cuts on both its sides, forward (activations) and backward (their gradients).

    >>> from pipesplit.passes.plan.chain import Chain
    >>> c = Chain([None] * 2, np.array([1e6, 1e6]), np.zeros(2, np.int64), np.array([0, 4000, 0]),
    ...           np.ones(3, bool), cut_tensors=np.array([0, 2, 0]))
    >>> round(priced_seconds(c, [0, 1], 1e-10, CommModel(latency_s=1e-5, bandwidth=1e9), "cpu"), 6)
    0.000148
    """
    bounds = list(starts) + [chain.n]
    tensors = chain.cut_tensors if chain.cut_tensors is not None else (chain.cut_bytes > 0).astype(np.int64)

    def cut_s(c: int) -> float:
        if c <= 0 or c >= chain.n:
            return 0.0
        return 2 * comm.seconds(float(chain.cut_bytes[c]), device_kind, device_kind, messages=int(tensors[c]))

    return max(float(chain.cost[a:b].sum()) * seconds_per_cost + cut_s(a) + cut_s(b) for a, b in zip(bounds, bounds[1:]))


def prefer_block_cuts(chain: Chain, starts: Sequence[int], paths: Sequence[str], split: Split, *, slack: float,
                      seconds_per_cost: float, comm: CommModel, device_kind: str) -> tuple[int, ...]:
    """The split between the blocks ``paths`` (by ``split``, the free split's own rule on a chain that
    allows no cut inside a block) when it prices faster than the free split ``starts`` by more than
    the planner's tie and its bottleneck is at most ``2 * slack`` above theirs; else ``starts``, as
    when there is none (more stages than places between blocks, or a memory cap it cannot meet)."""
    if not paths:
        return tuple(starts)
    blocked = replace(chain, allowed=between_blocks(chain, paths))
    try:
        whole = tuple(split(blocked))
    except PlanError:  # too few places between blocks for the stages, or none that fits max_stage_memory
        return tuple(starts)
    if largest_stage(chain, whole) > largest_stage(chain, starts) * (1 + 2 * slack):
        return tuple(starts)
    free_s = priced_seconds(chain, starts, seconds_per_cost, comm, device_kind)
    whole_s = priced_seconds(chain, whole, seconds_per_cost, comm, device_kind)
    return whole if whole_s < free_s * (1 - TIE) else tuple(starts)
