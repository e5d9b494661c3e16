"""The split of one order of the nodes under a schedule: its lowest simulated step, at one length or over several.

:func:`pipesplit.passes.plan.planner.plan_partition` solves each order of the nodes; with a schedule the
split, its checkpointed stages and its figures come from here (:mod:`pipesplit.passes.plan.checkpoint_search`
at the captured lengths, :mod:`pipesplit.passes.plan.lengths` over a mix of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch.fx as fx

from pipesplit.passes.annotate.rates import DeviceRates
from pipesplit.passes.plan.chain import Chain, build_chain
from pipesplit.passes.plan.checkpoint_search import best_with_checkpointing
from pipesplit.passes.plan.checkpointing import Checkpoint, fixed_set
from pipesplit.passes.plan.lengths import LengthMix, solve_over_lengths
from pipesplit.passes.plan.objective import CommModel, MemoryModel
from pipesplit.passes.plan.partial_checkpoint import plan_fields
from pipesplit.passes.plan.partition import StageLimits
from pipesplit.passes.plan.step_planner import node_seconds
from pipesplit.schedules import Schedule


@dataclass
class Scheduled:
    """A split chosen by its simulated step: where its stages start, its cut bytes, step, per-stage memory,
    and the plan's fields it sets (schedule, predicted step, checkpointed stages, ...)."""

    starts: tuple[int, ...]
    cut_bytes: int
    step_s: float
    memory: list[int]
    extra: dict[str, Any]


def solve_scheduled(
    gm: fx.GraphModule, chain: Chain, order: list[fx.Node], build: Callable[[], Chain], cost_name: str,
    cost_fn: Callable[[fx.Node], float], rate: float, num_stages: int, schedule: Schedule, *, comm: CommModel,
    memory: MemoryModel, mem_cap: int | None, limits: StageLimits, device_kind: str, rates: DeviceRates | None,
    checkpoint: Checkpoint, lengths: LengthMix | None,
) -> Scheduled:
    """The split of ``chain`` (the nodes in ``order``; ``build`` makes it again) with the lowest predicted step of
    ``schedule``: at the captured lengths, or the lowest expected step over ``lengths``."""
    fixed = fixed_set(checkpoint, num_stages, memory.checkpoint)
    common = dict(schedule=schedule.name, num_microbatches=schedule.num_microbatches)
    if lengths is not None:
        def rebuilt() -> tuple[Chain, np.ndarray]:
            at = build()
            return at, node_seconds(at.nodes, cost_name, cost_fn, rate, rates)

        mixed, ckpt = solve_over_lengths(gm, chain, lengths, schedule, rebuilt, comm=comm, memory=memory,
                                         mem_cap=mem_cap, limits=limits, device_kind=device_kind, checkpoint=fixed)
        extra = dict(common, predicted_step_s=mixed.candidate.step_s, ideal_step_s=mixed.ideal, checkpoint=sorted(ckpt),
                     lengths=list(lengths.weights), length_weights=list(lengths.weights.values()),
                     length_steps_s=mixed.steps)
        cand = mixed.candidate
    else:
        seconds = node_seconds(chain.nodes, cost_name, cost_fn, rate, rates)
        cand, ideal, ckpt = best_with_checkpointing(
            chain, seconds, schedule, comm=comm, memory=memory, mem_cap=mem_cap, limits=limits, device_kind=device_kind,
            checkpoint=fixed, asked=checkpoint if isinstance(checkpoint, Mapping) else None)
        extra = dict(common, predicted_step_s=cand.step_s, ideal_step_s=ideal, checkpoint=sorted(ckpt),
                     **plan_fields(chain, cand.starts, cand.heads))
    return Scheduled(tuple(cand.starts), cand.cut_bytes, cand.step_s, [int(m) for m in cand.figures.memory], extra)
