"""Splits that recompute part of some stages (:mod:`pipesplit.passes.plan.partial_checkpoint`), priced and re-balanced.

Each split the checkpointing search finds is priced again with every stage over the cap
recomputing only the shortest head that fits; then, ``ROUNDS`` times, the chain is solved
again with each stage's cost weighed by its own recompute (a stage that recomputes a third
of its forward gets a little less work), and the new splits shortened the same way.
"""

from __future__ import annotations

import numpy as np

from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.objective import (
    CommModel, MemoryModel, activation_units_per_stage, in_flight_per_stage, split_stages,
)
from pipesplit.passes.plan.partial_checkpoint import Blocks, shortest_heads
from pipesplit.passes.plan.partition import StageLimits, solve_candidates
from pipesplit.passes.plan.step_planner import SLACKS, Candidate, candidate, figures_for, stage_state
from pipesplit.errors import PlanError
from pipesplit.schedules import Schedule


def with_shortest_heads(
    chain: Chain, blocks: Blocks, starts: tuple[int, ...], seconds: np.ndarray, schedule: Schedule,
    memory: MemoryModel, comm: CommModel, device_kind: str, cap: int,
) -> Candidate | None:
    """The split at ``starts`` with each stage over ``cap`` recomputing the shortest head that fits (or all
    of its forward); None when some stage is over the cap even so."""
    in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
    plain = figures_for(chain, starts, seconds, in_flight, memory, comm, device_kind, units, ())
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    bounds = list(starts) + [chain.n]
    states = [stage_state(chain, act, a, b) for a, b in zip(bounds, bounds[1:])]
    split = split_stages(schedule)
    whole, heads = shortest_heads(chain, blocks, memory, starts, plain.memory, states, in_flight, units, cap, split)
    fig = figures_for(chain, starts, seconds, in_flight, memory, comm, device_kind, units, whole, heads, split=split)
    if max(fig.memory) > cap:
        return None
    return candidate(chain, schedule, starts, fig, heads, whole)


def reweigh(
    chain: Chain, blocks: Blocks, seconds: np.ndarray, schedule: Schedule, memory: MemoryModel, comm: CommModel,
    device_kind: str, cap: int, limits: StageLimits, found: list[Candidate],
) -> None:
    """Add to ``found`` the splits solved with each stage's cost weighed by the recompute of the best one so far."""
    tried: set[tuple[float, ...]] = set()
    for _ in range(ROUNDS):
        if not found:
            return
        before = min(c.step_s for c in found)
        for best in sorted(found, key=lambda c: c.step_s)[:WIDTH]:
            scale = tuple(round((c.forward + c.backward) / plain if plain > 0 else 1.0, 3)
                          for c, plain in zip(best.figures.costs, _plain_seconds(seconds, best.starts, chain.n)))
            if scale in tried:
                continue
            tried.add(scale)
            weighed = StageLimits(None, limits.start_lo, limits.start_hi, None, scale)
            try:
                splits = solve_candidates(chain, schedule.num_stages, SLACKS, limits=weighed)
            except PlanError:
                continue
            for split in dict.fromkeys(s.starts for s in splits):
                got = with_shortest_heads(chain, blocks, tuple(split), seconds, schedule, memory, comm, device_kind, cap)
                if got is not None:
                    found.append(got)
        if min(c.step_s for c in found) >= before * (1 - 1e-9):
            return


def _plain_seconds(seconds: np.ndarray, starts: tuple[int, ...], n: int) -> list[float]:
    bounds = list(starts) + [n]
    return [float(seconds[a:b].sum()) for a, b in zip(bounds, bounds[1:])]


# How many times the chain is solved again with the stages weighed by their recompute, from the best WIDTH so far.
ROUNDS = 3
WIDTH = 3
