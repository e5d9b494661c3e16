"""Price a given split (``split_points=`` or a saved plan) under a schedule, and warn of stages over the memory cap.

"Is the automatic plan better than mine?" needs both priced alike: the same stage times,
communication, memory model and schedule simulator the planner uses
(:mod:`pipesplit.passes.plan.step_planner`), for the split as given.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
import torch.fx as fx

from pipesplit.passes.annotate.rates import device_rates, largest_matmul
from pipesplit.passes.plan.chain import build_chain, compute_nodes
from pipesplit.passes.plan.checkpointing import Checkpoint, check_checkpoint, describe, fixed_set
from pipesplit.passes.plan.objective import (
    DEFAULT_FLOPS_PER_S, CommModel, MemoryModel, activation_units_per_stage, in_flight_per_stage, split_stages,
    step_time,
)
from pipesplit.passes.plan.planner import CostSpec, cost_function
from pipesplit.passes.plan.partial_checkpoint import asked_heads, find_blocks, plan_fields, shortest_heads
from pipesplit.passes.plan.step_planner import figures_for, node_seconds, stage_state, step_lower_bound
from pipesplit.plan import Plan
from pipesplit.schedules import Schedule
from pipesplit.errors import PlanError
from pipesplit.units import human_bytes


def price_plan(
    gm: fx.GraphModule, plan: Plan, schedule: Schedule, *, cost: CostSpec = "flops", comm: CommModel = CommModel(),
    memory: MemoryModel = MemoryModel(), max_stage_memory: int | None = None, checkpoint: Checkpoint = None,
    device_kind: str = "cpu", saved: Mapping[int, int] | None = None,
) -> None:
    """Fill ``plan``'s schedule figures for its split as it is: ``predicted_step_s``, ``ideal_step_s``,
    ``stage_memory`` (bytes per stage) and ``checkpoint`` (with ``"auto"``: each stage over
    ``max_stage_memory`` without it recomputes the shortest head of its blocks that fits, or its whole
    forward: the best choice for a fixed split; ``saved``: the partial checkpointing a saved plan keeps)."""
    check_checkpoint(checkpoint)
    name, fn = cost_function(cost)
    rate = DEFAULT_FLOPS_PER_S.get(device_kind, DEFAULT_FLOPS_PER_S["cpu"])
    rates = device_rates(device_kind, largest_matmul(gm.graph.nodes)) if name == "flops" else None
    by_name = {n.name: n for n in compute_nodes(gm)}
    order = [by_name[x] for stage in plan.stages for x in stage]  # a valid plan's stages: a topological order
    chain = build_chain(gm, fn, state_factor=memory.state_factor_for, recompute=set(plan.recompute), order=order)
    starts = [int(x) for x in np.cumsum([0] + [len(s) for s in plan.stages[:-1]])]
    seconds = node_seconds(chain.nodes, name, fn, rate, rates)
    in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
    k = plan.num_stages
    ckpt = fixed_set(checkpoint, k, memory.checkpoint)
    heads: dict[int, int] = {}
    if isinstance(checkpoint, Mapping):  # {stage: blocks}
        ckpt, heads = asked_heads(find_blocks(chain), starts, chain.n, checkpoint)
    elif saved:  # stage -> how many of its first nodes recompute, as a saved plan says
        heads = {s: starts[s] + n for s, n in saved.items()}
    elif ckpt is None and max_stage_memory is not None:  # each stage over the cap: the shortest head that fits
        plain = figures_for(chain, starts, seconds, in_flight, memory, comm, device_kind, units, ())
        bounds = starts + [chain.n]
        act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
        states = [stage_state(chain, act, a, b) for a, b in zip(bounds, bounds[1:])]
        ckpt, heads = shortest_heads(chain, find_blocks(chain), memory, starts, plain.memory, states, in_flight, units,
                                     max_stage_memory, split_stages(schedule))
    if ckpt is None:
        ckpt = frozenset()
    fig = figures_for(chain, starts, seconds, in_flight, memory, comm, device_kind, units, ckpt, heads,
                      split=split_stages(schedule))
    plan.schedule, plan.num_microbatches = schedule.name, schedule.num_microbatches
    plan.predicted_step_s = step_time(schedule, fig)
    plan.ideal_step_s = step_lower_bound(seconds, schedule, len(ckpt) == k)
    plan.stage_memory = [int(m) for m in fig.memory]
    plan.checkpoint = sorted(ckpt)
    for key, value in plan_fields(chain, starts, heads).items():
        setattr(plan, key, value)
    plan.max_stage_memory = max_stage_memory


def price_given(
    gm: fx.GraphModule, plan: Plan, schedule: Schedule | None, *, cost: CostSpec, comm: CommModel, memory: MemoryModel,
    max_stage_memory: int | None, checkpoint: Checkpoint, device_kind: str, keep_saved: bool,
) -> None:
    """A split the user gave (``split_points=``, or a saved plan: ``keep_saved`` keeps its checkpointing
    unless ``checkpoint`` says otherwise), priced under ``schedule`` when one is given."""
    if keep_saved and checkpoint is None and not memory.checkpoint:
        checkpoint = list(plan.checkpoint)
        saved = dict(plan.checkpoint_partial)  # a saved plan's partial checkpointing, in its stages' nodes
    else:
        saved = {}
    if schedule is not None:
        price_plan(gm, plan, schedule, cost=cost, comm=comm, memory=memory, max_stage_memory=max_stage_memory,
                   checkpoint=checkpoint, device_kind=device_kind, saved=saved)
        return
    check_checkpoint(checkpoint)
    if isinstance(checkpoint, Mapping):
        raise PlanError(f"checkpoint={dict(checkpoint)} recomputes part of a stage, which is planned under a "
                        "schedule: pass schedule= and num_microbatches= too (e.g. schedule='1f1b').")
    plan.checkpoint = sorted(fixed_set(checkpoint, plan.num_stages, memory.checkpoint) or ())
    if not saved:
        plan.checkpoint_partial, plan.checkpoint_labels = {}, {}
    plan.max_stage_memory = max_stage_memory


# What a CUDA device's default cap leaves free of its memory: the CUDA context, cuBLAS/cuDNN
# workspaces, NCCL buffers and the caching allocator's fragmentation.
DEVICE_MEMORY_MARGIN = 0.10


def device_memory_cap(devices: Sequence[str | torch.device]) -> int | None:
    """The default ``max_stage_memory`` on CUDA: the smallest device's memory less ``DEVICE_MEMORY_MARGIN``
    (None when no device is a GPU: host memory is shared and not planned against)."""
    sizes = [torch.cuda.get_device_properties(torch.device(d)).total_memory
             for d in devices if torch.device(d).type == "cuda"]
    return int(min(sizes) * (1 - DEVICE_MEMORY_MARGIN)) if sizes else None


def memory_warnings(plan: Plan, cap: int | None = None, what: str = "max_stage_memory") -> list[str]:
    """One sentence per stage predicted over ``cap`` (default the plan's own): the stage, its figure, the cap, the fix."""
    cap = plan.max_stage_memory if cap is None else cap
    if cap is None or not plan.stage_memory:
        return []
    out = []
    over = [s for s, held in enumerate(plan.stage_memory) if held > cap]
    more = sorted({*plan.checkpoint, *over})
    for s in over:
        held = plan.stage_memory[s]
        if plan.schedule is not None and s not in plan.checkpoint:
            fix = f"checkpoint it (compile(..., checkpoint={more}) or checkpoint='auto'), move layers off it"
        else:
            fix = "move layers off it"
        out.append(
            f"stage {s} is predicted to hold {human_bytes(held)} ({held:,} bytes), over {what}={cap:,} "
            f"({human_bytes(cap)}){_context(plan)}: the step would run out of memory there. Fix: {fix}, "
            "use more stages or fewer microbatches in flight, or raise the cap."
        )
    return out


def _context(plan: Plan) -> str:
    if plan.schedule is None:
        return ""
    return (f" under {plan.schedule!r} with {plan.num_microbatches} microbatches, checkpointing "
            f"{describe(plan.checkpoint, plan.num_stages)}"
            + "".join(f", stage {s}'s {t}" for s, t in plan.checkpoint_labels.items()))
