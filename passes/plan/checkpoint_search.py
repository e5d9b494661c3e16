"""Cuts and activation checkpointing chosen together: the split and set of checkpointed stages with the
lowest simulated step under the memory cap (the sets tried: :mod:`pipesplit.passes.plan.checkpointing`)."""

from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

from pipesplit.errors import PlanError
from pipesplit.passes.plan.block_layouts import best_block_layout
from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.checkpointing import candidate_sets, needed
from pipesplit.passes.plan.objective import (
    CommModel, MemoryModel, activation_units_per_stage, in_flight_per_stage, split_stages,
)
from pipesplit.passes.plan.partition import StageLimits
from pipesplit.passes.plan.partial_checkpoint import Blocks, asked_heads, find_blocks
from pipesplit.passes.plan.partial_search import reweigh, with_shortest_heads
from pipesplit.passes.plan.step_planner import TIE, Candidate, best_for_schedule, candidate, figures_for, step_lower_bound
from pipesplit.schedules import Schedule

log = logging.getLogger(__name__)


def best_with_checkpointing(
    chain: Chain, seconds: np.ndarray, schedule: Schedule, *, comm: CommModel, memory: MemoryModel,
    mem_cap: int | None, limits: StageLimits, device_kind: str, checkpoint: frozenset[int] | None,
    asked: Mapping[int, int] | None = None,
) -> tuple[Candidate, float, frozenset[int]]:
    """The best split of :func:`_searched`, or the fastest split between the model's repeated blocks
    (:func:`best_block_layout`: the layouts by block counts and the split found with its cuts moved to
    block boundaries, each with its best checkpointing) where that is predicted faster: the plan is
    never predicted slower than a layout by whole blocks that fits the cap."""
    kw = dict(comm=comm, memory=memory, mem_cap=mem_cap, limits=limits, device_kind=device_kind)
    blocks = find_blocks(chain)  # once: the search's heads and the layouts between blocks both read them
    if asked is not None:  # the stages' blocks as asked, on the split solved for them
        return _searched(chain, blocks, seconds, schedule, checkpoint=checkpoint, asked=asked,
                         **kw)  # type: ignore[arg-type]
    try:
        cand, ideal, ckpt = _searched(chain, blocks, seconds, schedule, checkpoint=checkpoint,
                                      **kw)  # type: ignore[arg-type]
    except PlanError:
        fallback = best_block_layout(chain, blocks, seconds, schedule, checkpoint=checkpoint,
                                     **kw)  # type: ignore[arg-type]
        if fallback is None:
            raise
        whole = fallback.whole
        return fallback, step_lower_bound(seconds, schedule, len(whole) == schedule.num_stages), whole
    block = best_block_layout(chain, blocks, seconds, schedule, checkpoint=checkpoint, seeds=[cand.starts],
                              **kw)  # type: ignore[arg-type]
    if block is not None and block.step_s < cand.step_s:
        log.debug("between blocks %s: step %.6g against %.6g", block.starts, block.step_s, cand.step_s)
        return block, ideal, block.whole
    return cand, ideal, ckpt


def _searched(
    chain: Chain, blocks: Blocks, seconds: np.ndarray, schedule: Schedule, *, comm: CommModel, memory: MemoryModel,
    mem_cap: int | None, limits: StageLimits, device_kind: str, checkpoint: frozenset[int] | None,
    asked: Mapping[int, int] | None = None,
) -> tuple[Candidate, float, frozenset[int]]:
    """The best split, a lower bound on any split's step, and the stages to checkpoint (``blocks``: the
    chain's repeated blocks, :func:`~pipesplit.passes.plan.partial_checkpoint.find_blocks`).

    ``checkpoint`` fixes the set (see :func:`best_for_schedule`); None chooses it: without a cap
    no stage (checkpointing only adds time); with one, each candidate set of
    :func:`candidate_sets` is solved (unless the best split without a cap fits), its split keeps
    only the stages that need checkpointing to fit (:func:`needed`), and the lowest simulated step
    wins (the fewest checkpointed among ties). Each split found is priced too with the stages over
    the cap recomputing only their first blocks (:mod:`pipesplit.passes.plan.partial_search`); the
    best of those wins where it is faster (``cand.heads`` says where each such stage's head ends).

    ``asked`` (``compile(checkpoint={stage: blocks})``): the split solved as if those stages were
    checkpointed whole, then each recomputes the blocks asked for.
    """
    kw = dict(comm=comm, memory=memory, mem_cap=mem_cap, limits=limits, device_kind=device_kind)
    if asked is not None:
        cand, ideal = best_for_schedule(chain, seconds, schedule, checkpoint=frozenset(asked), **kw)  # type: ignore[arg-type]
        whole, heads = asked_heads(blocks, cand.starts, chain.n, asked)
        in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
        fig = figures_for(chain, cand.starts, seconds, in_flight, memory, comm, device_kind, units, whole, heads,
                          split=split_stages(schedule))
        return candidate(chain, schedule, cand.starts, fig, heads, whole), ideal, whole
    if checkpoint is not None or mem_cap is None:
        chosen = checkpoint if checkpoint is not None else frozenset()
        cand, ideal = best_for_schedule(chain, seconds, schedule, checkpoint=chosen, **kw)  # type: ignore[arg-type]
        return cand, ideal, chosen
    in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
    free, ideal = best_for_schedule(chain, seconds, schedule, checkpoint=frozenset(), **{**kw, "mem_cap": None})  # type: ignore[arg-type]
    if max(free.figures.memory) <= mem_cap:  # the cap does not bind: checkpointing would only add time
        return free, ideal, frozenset()
    found: list[tuple[float, int, Candidate, float, frozenset[int]]] = []
    error: PlanError | None = None

    def solve(tried: frozenset[int], quick: bool) -> None:
        nonlocal error
        try:
            cand, ideal = best_for_schedule(chain, seconds, schedule, checkpoint=tried, quick=quick, **kw)  # type: ignore[arg-type]
        except PlanError as e:
            error = e  # the last (every stage checkpointed) says best why nothing fits
            return
        plain = figures_for(chain, cand.starts, seconds, in_flight, memory, comm, device_kind, units, ())
        keep = needed(plain.memory, mem_cap)
        if keep != tried:  # a stage of the set that fits without: it need not pay the second forward
            fig = figures_for(chain, cand.starts, seconds, in_flight, memory, comm, device_kind, units, keep,
                              split=split_stages(schedule))
            cand = candidate(chain, schedule, cand.starts, fig)
        found.append((cand.step_s, len(keep), cand, ideal, keep))
        shorten(cand)
        log.debug("checkpointing %s (of %s tried%s): step %.6g", sorted(keep), sorted(tried), ", quick" if quick else "",
                  cand.step_s)

    cap = mem_cap
    partial: list[Candidate] = []

    def shorten(cand: Candidate) -> None:  # the same split recomputing only the heads it needs
        got = with_shortest_heads(chain, blocks, cand.starts, seconds, schedule, memory, comm, device_kind, cap)
        if got is not None:
            partial.append(got)

    shorten(free)
    worse = 0
    for tried in candidate_sets(units):  # the sets quickly, in order, then the best few with the full search
        before, count = min((f[0] for f in found), default=float("inf")), len(found)
        solve(tried, quick=True)
        if len(found) > count and found[-1][0] >= before:
            worse += 1
            if worse == PATIENCE:  # the recompute now costs more than the balance it buys
                break
        elif len(found) > count:
            worse = 0
    for tried in [f[4] for f in sorted(found, key=lambda f: f[0])[:THOROUGH]]:
        solve(tried, quick=False)
    reweigh(chain, blocks, seconds, schedule, memory, comm, device_kind, cap, limits, partial)
    if not found and not partial:
        assert error is not None
        raise error
    ideal = min((f[3] for f in found), default=step_lower_bound(seconds, schedule))
    if partial:
        best_p = min(partial, key=lambda c: c.step_s)
        if not found or best_p.step_s < min(f[0] for f in found) * (1 - TIE):  # recomputing part of a stage wins
            return best_p, ideal, best_p.whole
    best_s = min(f[0] for f in found)
    step, _, cand, ideal_f, keep = min((f for f in found if f[0] <= best_s * (1 + 1e-9)), key=lambda f: (f[1], f[0]))
    return cand, ideal, keep


# The quick pass stops after this many sets in a row that price no better than the best before them.
PATIENCE = 2
# How many of the sets that priced best quickly are solved again with every slack and the sides re-split.
THOROUGH = 1
