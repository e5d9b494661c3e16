"""Schedule-aware planning: choose the split whose *simulated step time* is lowest.

The exact chain solver proposes candidates (the fewest cut bytes within several
slacks of the optimal bottleneck, under per-stage memory limits that count the
microbatches the schedule keeps in flight); the schedule simulator prices each with
stage forward, input-gradient and weight-gradient times plus communication at the
cuts; the cheapest wins. A lower bound that holds for every split (the busiest rank's
share of the work; one microbatch's forward and input-gradient path) is reported too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch.fx as fx

from pipesplit.errors import PlanError
from pipesplit.meta import node_cost
from pipesplit.passes.chain import Chain
from pipesplit.passes.objective import CommModel, MemoryModel, StageFigures, in_flight_per_stage, step_time
from pipesplit.passes.partition import StageLimits, solve_candidates, stage_memory_limits
from pipesplit.schedules import Schedule, StageCost

SLACKS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35)


def node_seconds(
    nodes: Sequence[fx.Node], cost_name: str, cost_fn: Callable[[fx.Node], float], flops_per_s: float
) -> np.ndarray:
    """Per node (forward, input-gradient, weight-gradient) seconds, shape (n, 3)."""
    out = np.zeros((len(nodes), 3))
    timed = cost_name in ("profile", "hybrid")
    for i, node in enumerate(nodes):
        c = node_cost(node)
        if timed and c.time_s is not None:
            f = c.time_s
            if c.bwd_time_s is not None:  # profiled backward
                out[i] = (f, *c.backward_split(c.bwd_time_s))
            elif c.fwd_flops:
                out[i] = (f, f * c.igrad_flops / c.fwd_flops, f * c.wgrad_flops / c.fwd_flops)
            else:
                out[i] = (f, f if c.requires_grad else 0.0, 0.0)
        else:
            out[i] = (c.fwd_flops, c.igrad_flops, c.wgrad_flops)
            out[i] /= flops_per_s
    if not timed and cost_name != "flops":  # user units: keep their weights, split like FLOPs
        weights = np.array([cost_fn(n) for n in nodes])
        totals = out.sum(axis=1)
        share = np.where(totals[:, None] > 0, out / np.where(totals > 0, totals, 1)[:, None], 1.0 / 3.0)
        scale = out.sum() / weights.sum() if weights.sum() > 0 else 1.0
        out = share * (weights * scale)[:, None]
    return out


@dataclass
class Candidate:
    starts: tuple[int, ...]
    figures: StageFigures
    step_s: float
    cut_bytes: int


def figures_for(
    chain: Chain, starts: Sequence[int], seconds: np.ndarray, in_flight: Sequence[int],
    memory: MemoryModel, comm: CommModel, device_kind: str,
) -> StageFigures:
    bounds = list(starts) + [chain.n]
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    costs, mem = [], []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        f, i, w = seconds[a:b].sum(axis=0)
        costs.append(StageCost(float(f), float(i), float(w)))
        # chain.mem already counts trainable state x (1 + grad + optimizer): see plan_partition
        state = float((chain.mem[a:b] - act[a:b]).sum())
        state += sum(nbytes for nbytes, pos in chain.shared if any(a <= p < b for p in pos))
        inputs = float(chain.cut_bytes[a]) if a > 0 else 0.0
        mem.append(memory.held_bytes(state, float(act[a:b].sum()), inputs, in_flight[s]))
    comm_s = [comm.seconds(float(chain.cut_bytes[c]), device_kind, device_kind) for c in starts[1:]]
    return StageFigures(costs, comm_s, mem, list(in_flight))


def best_for_schedule(
    chain: Chain,
    seconds: np.ndarray,
    schedule: Schedule,
    *,
    comm: CommModel,
    memory: MemoryModel,
    mem_cap: int | None,
    limits: StageLimits,
    device_kind: str,
) -> tuple[Candidate, float]:
    """The candidate split with the lowest simulated step time, and a lower bound on any split's."""
    k = schedule.n_stages
    in_flight = in_flight_per_stage(schedule)
    if mem_cap is not None:
        limits = StageLimits(stage_memory_limits(chain, mem_cap, in_flight), limits.start_lo, limits.start_hi)
    try:
        splits = solve_candidates(chain, k, SLACKS, limits=limits)
    except PlanError as e:
        if mem_cap is None:
            raise
        raise PlanError(_memory_message(chain, schedule, in_flight, mem_cap, limits)) from e
    best: Candidate | None = None
    for split in splits:
        fig = figures_for(chain, split.starts, seconds, in_flight, memory, comm, device_kind)
        cand = Candidate(split.starts, fig, step_time(schedule, fig), split.cut_bytes)
        if best is None or (cand.step_s, cand.cut_bytes) < (best.step_s, best.cut_bytes):
            best = cand
    assert best is not None
    return best, step_lower_bound(seconds, schedule)


def _memory_message(chain: Chain, schedule: Schedule, in_flight: Sequence[int], cap: int, limits: StageLimits) -> str:
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    state = int((chain.mem - act).sum()) + sum(nbytes for nbytes, _ in chain.shared)
    one = int(act.sum())
    pinned = " (and the pins)" if limits.start_lo is not None else ""
    return (
        f"no split into {schedule.n_stages} stages keeps every stage under max_stage_memory={cap:,} bytes under "
        f"{schedule.name!r} with {schedule.n_microbatches} microbatches{pinned}: the stages keep {list(in_flight)} "
        f"microbatches of activations in flight; the model's training state (parameters, gradients, optimizer) is "
        f"{state:,} bytes and one microbatch's activations {one:,} bytes, so some stage holds at least "
        f"{(state + one * min(in_flight)) // schedule.n_stages:,} bytes; the largest single operation holds "
        f"{int(chain.node_memory().max(initial=0)):,} bytes with its parameters. Use more stages, fewer "
        "microbatches in flight (a schedule that holds fewer, or smaller microbatches), activation "
        "checkpointing, or a larger max_stage_memory."
    )


def step_lower_bound(seconds: np.ndarray, schedule: Schedule) -> float:
    """A step time no split can beat: the busiest rank does at least its share of all the
    work, and one microbatch must go forward through every stage and back (W may wait)."""
    f, i, w = seconds.sum(axis=0)
    return max(schedule.n_microbatches * (f + i + w) / schedule.n_ranks, f + i)
