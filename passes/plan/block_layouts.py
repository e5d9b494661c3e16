"""Splits between a model's repeated blocks, as people lay them out by hand, priced against the solver's.

Megatron-LM and torchtitan give each stage a count of whole layers: as even as the count allows, the
first stage a block or two lighter (it holds the embedding) and the last a few lighter (the head and
the loss). The chain solver cuts where the stages balance best, which may be a few nodes off a block
boundary, and its candidates are chosen among by a tie rule (the best balanced within
:data:`~pipesplit.passes.plan.step_planner.TIE`): nothing kept the plan from being predicted a hair
slower than such a layout. :func:`best_block_layout` prices, by the same simulated step and with the
best checkpointing each allows, every layout by block counts (:func:`count_layouts`) and the chosen
split with its cuts moved to the nearest block boundaries; the planner takes the fastest of them
where it is predicted faster than its own choice. A handful of splits, each priced once: planning
time hardly changes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.objective import (
    CommModel, MemoryModel, activation_units_per_stage, in_flight_per_stage, split_stages,
)
from pipesplit.passes.plan.partial_checkpoint import Blocks
from pipesplit.passes.plan.partial_search import with_shortest_heads
from pipesplit.passes.plan.partition import StageLimits
from pipesplit.passes.plan.step_planner import Candidate, candidate, figures_for
from pipesplit.schedules import Schedule

# How many blocks lighter than an even share the first stage (its embedding) and the last (its head) may be.
FIRST_LIGHTER = 2
LAST_LIGHTER = 3


def count_layouts(blocks: int, k: int) -> list[list[int]]:
    """Blocks per stage: the first ``0..FIRST_LIGHTER`` lighter than an even share, the last
    ``0..LAST_LIGHTER`` lighter, the rest as even as the count allows (the earlier ones the larger).

    >>> count_layouts(8, 4)
    [[2, 2, 2, 2], [2, 3, 2, 1], [1, 3, 2, 2], [1, 3, 3, 1]]
    >>> count_layouts(6, 2)
    [[3, 3], [2, 4], [1, 5]]
    """
    out: dict[tuple[int, ...], None] = {}
    base = -(-blocks // k)
    for a in range(FIRST_LIGHTER + 1):
        for b in range(LAST_LIGHTER + 1):
            first, last = base - a, base - b
            rest = blocks - first - last
            if k == 2 and b == 0 and 1 <= first < blocks:  # two stages: the first lighter, the last takes the rest
                out.setdefault((first, blocks - first))
            if k < 3 or first < 1 or last < 1 or rest < k - 2:
                continue
            q, r = divmod(rest, k - 2)
            counts = [first] + [q + (1 if i < r else 0) for i in range(k - 2)] + [last]
            if max(counts[1:-1]) <= base + 1:
                out.setdefault(tuple(counts))
    return [list(c) for c in out]


def block_starts(blocks: Blocks) -> list[int]:
    """The chain position where each repeated block begins, in the blocks' order; ``[]`` without blocks,
    or where a block begins before the one ahead of it has (an order of the nodes that interleaves them)."""
    if blocks.prefix is None:
        return []
    ids = blocks.ids
    found = sorted(set(ids[ids >= 0].tolist()))
    firsts = [int(np.argmax(ids == i)) for i in found]
    return firsts if all(x < y for x, y in zip(firsts, firsts[1:])) else []


def layouts(
    chain: Chain, blocks: Blocks, k: int, limits: StageLimits, seeds: Sequence[Sequence[int]],
) -> list[tuple[int, ...]]:
    """The splits into ``k`` stages between blocks: each of :func:`count_layouts`, and each of ``seeds`` with
    its cuts moved to the nearest block boundary, the one before and the one after; those the chain allows
    (no cut inside what must stay together) and the pins' limits too."""
    firsts = block_starts(blocks)
    if k < 2 or len(firsts) < k:
        return []
    out: dict[tuple[int, ...], None] = {}
    for counts in count_layouts(len(firsts), k):
        at = np.cumsum([0] + counts[:-1])
        out.setdefault((0, *(firsts[i] for i in at[1:])))
    edges = np.array(firsts)
    for seed in seeds:
        cuts = np.asarray(seed[1:], dtype=np.int64)
        after = np.minimum(np.searchsorted(edges, cuts), len(edges) - 1)
        before = np.maximum(after - 1, 0)
        nearest = np.where(np.abs(edges[before] - cuts) <= np.abs(edges[after] - cuts), before, after)
        for pick in (nearest, before, after):
            out.setdefault((0, *(int(edges[i]) for i in pick)))
    return [st for st in out if _valid(chain, st, limits)]


def _valid(chain: Chain, starts: tuple[int, ...], limits: StageLimits) -> bool:
    if any(x >= y for x, y in zip(starts, starts[1:])):
        return False
    if not all(0 < c < chain.n and chain.allowed[c] for c in starts[1:]):
        return False
    if limits.start_lo is not None and limits.start_hi is not None:
        return all(int(lo) <= st <= int(hi) for st, lo, hi in zip(starts, limits.start_lo, limits.start_hi))
    return True


def best_block_layout(
    chain: Chain, blocks: Blocks, seconds: np.ndarray, schedule: Schedule, *, comm: CommModel, memory: MemoryModel,
    mem_cap: int | None, limits: StageLimits, device_kind: str, checkpoint: frozenset[int] | None,
    seeds: Sequence[Sequence[int]] = (),
) -> Candidate | None:
    """The fastest of :func:`layouts` under ``mem_cap``, each with its best checkpointing: ``checkpoint`` None
    (the planner chooses) each stage over the cap recomputing the shortest head of its blocks that fits,
    or all of its forward (:func:`with_shortest_heads`: the best for a fixed split); else the stages
    ``checkpoint`` names. None where none fits, or the model has no repeated blocks to cut between."""
    k = schedule.num_stages
    in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
    split = split_stages(schedule)
    best: Candidate | None = None
    for starts in layouts(chain, blocks, k, limits, seeds):
        cand: Candidate | None
        if checkpoint is None and mem_cap is not None:
            cand = with_shortest_heads(chain, blocks, starts, seconds, schedule, memory, comm, device_kind, mem_cap)
        else:
            ckpt = checkpoint if checkpoint is not None else frozenset()
            fig = figures_for(chain, starts, seconds, in_flight, memory, comm, device_kind, units, ckpt, split=split)
            fits = mem_cap is None or max(fig.memory) <= mem_cap
            cand = candidate(chain, schedule, starts, fig, whole=ckpt) if fits else None
        if cand is not None and (best is None or cand.step_s < best.step_s):
            best = cand
    return best
