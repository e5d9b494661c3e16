"""Schedule-aware planning: choose the split whose *simulated step time* is lowest.

The exact chain solver proposes candidates (the fewest cut bytes within several
slacks of the optimal bottleneck, under per-stage memory limits that count the
microbatches the schedule keeps in flight), and each of them again with the stages on
either side of its bottleneck re-split for their own balance (``balance.rebalance``);
the schedule simulator prices each with stage forward, input-gradient and
weight-gradient times plus communication at the cuts; the cheapest wins, and of
predictions within ``TIE`` of it the best balanced. A lower bound that holds for every
split (the busiest rank's share of the work; one microbatch's forward and
input-gradient path) is reported too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, Sequence

import numpy as np
import torch.fx as fx

from pipesplit.errors import PlanError
from pipesplit.meta import node_cost
from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.objective import (
    CommModel, MemoryModel, StageFigures, activation_units_per_stage, in_flight_per_stage, split_stages, step_time,
)
from pipesplit.passes.plan.balance import Solve, rebalance
from pipesplit.passes.plan.checkpointing import checkpoint_limits, recompute_scale
from pipesplit.passes.plan.partition import StageLimits, solve_candidates
from pipesplit.passes.plan.stage_bytes import stage_bytes
from pipesplit.passes.annotate.rates import DeviceRates, priced
from pipesplit.schedules import Schedule, StageCost

SLACKS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35)
QUICK_SLACKS = (0.0, 0.05, 0.2)


def node_seconds(
    nodes: Sequence[fx.Node], cost_name: str, cost_fn: Callable[[fx.Node], float], flops_per_s: float,
    rates: DeviceRates | None = None,
) -> np.ndarray:
    """Per node (forward, input-gradient, weight-gradient) seconds, shape (n, 3).

    With ``rates`` (the default cost on a device whose rates were measured,
    :mod:`pipesplit.passes.annotate.rates`) FLOP costs are priced as per-op overhead + FLOPs / FLOP
    rate + bytes / bandwidth; without, as FLOPs / ``flops_per_s``.
    """
    out = np.zeros((len(nodes), 3))
    timed = cost_name in ("profile", "hybrid")
    for i, node in enumerate(nodes):
        c = node_cost(node)
        if not timed and cost_name == "flops" and rates is not None:
            out[i] = priced(node, rates)
        elif timed and c.time_s is not None:
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
    heads: dict[int, int] = field(default_factory=dict)  # stage -> where its recomputed head ends (partial checkpointing)
    whole: frozenset[int] = frozenset()  # with ``heads``: the stages recomputing all of their forward


def candidate(chain: Chain, schedule: Schedule, starts: Sequence[int], fig: StageFigures,
              heads: Mapping[int, int] | None = None, whole: frozenset[int] = frozenset()) -> Candidate:
    """The split at ``starts`` with its figures (:func:`figures_for`): its simulated step under ``schedule``, the
    bytes its cuts carry, and where its stages' recomputed heads end (``heads``, ``whole``: see :class:`Candidate`)."""
    return Candidate(tuple(starts), fig, step_time(schedule, fig), int(chain.cut_bytes[list(starts[1:])].sum()),
                     dict(heads or {}), whole)


def figures_for(
    chain: Chain, starts: Sequence[int], seconds: np.ndarray, in_flight: Sequence[int],
    memory: MemoryModel, comm: CommModel, device_kind: str, units: Sequence[float] | None = None,
    checkpoint: Collection[int] | None = None, heads: Mapping[int, int] | None = None,
    split: Mapping[int, int] | None = None,
) -> StageFigures:
    """Per-stage figures of the split at ``starts``; ``checkpoint``: the stages that recompute their
    forward (default: every stage under ``MemoryModel(checkpoint=True)``, else none); ``heads``: stage ->
    the chain position where the part it recomputes ends (:mod:`pipesplit.passes.plan.partial_checkpoint`);
    ``split``: the stages whose backward the schedule splits into I and W, each with the microbatches it
    holds from a forward until its I (:func:`split_stages`).

    A checkpointed stage runs its forward again before its backward; where the schedule splits the
    backward, the runtime runs the whole of it (input and weight gradients) in I and nothing in W: an I
    keeping the recomputed graph for W held it until the step ended, and W recomputed it again
    (:meth:`pipesplit.runtime.engine.worker.StageWorker.backward_input`). A stage recomputing its head
    does the same, its head's forward again in I."""
    split = split or {}
    bounds = list(starts) + [chain.n]
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    if checkpoint is None:
        checkpoint = range(len(starts)) if memory.checkpoint else ()
    costs, mem = [], []
    act_sum = np.concatenate([[0], np.cumsum(act)])
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        f, i, w = seconds[a:b].sum(axis=0)
        ck = s in checkpoint
        h = heads.get(s) if heads else None
        if ck and s in split:  # the whole backward in I
            costs.append(StageCost(float(f), float(f + i + w), 0.0))
        elif h is not None and not ck:  # its head's forward again before its backward (the whole of it in I if split)
            redo = float(seconds[a:h, 0].sum())
            costs.append(StageCost(float(f), float(i + redo + w), 0.0) if s in split else
                         StageCost(float(f), float(i + redo), float(w)))
        else:  # a checkpointed stage runs its forward again before its backward
            costs.append(StageCost(float(f), float(i + f if ck else i), float(w)))
        # chain.mem already counts trainable state x (1 + grad + optimizer): see plan_partition
        mem.append(stage_bytes(chain, memory, stage_state(chain, act, a, b), a, b, in_flight[s],
                               None if units is None else units[s], checkpointed=ck, head=h, act_sum=act_sum,
                               split=split.get(s)))
    comm_s = [comm.seconds(float(chain.cut_bytes[c]), device_kind, device_kind) for c in starts[1:]]
    return StageFigures(costs, comm_s, mem, list(in_flight))


def stage_state(chain: Chain, act: np.ndarray, a: int, b: int) -> float:
    """Training state bytes of stage ``[a, b)``: its nodes' memory less their activations, shared state once."""
    state = float((chain.mem[a:b] - act[a:b]).sum())
    return state + sum(chain.shared_in(a, b))


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
    checkpoint: frozenset[int] | None = None,
    quick: bool = False,
) -> tuple[Candidate, float]:
    """The candidate split with the lowest simulated step time, and a lower bound on any split's.

    ``checkpoint``: the stages that recompute their forward (default: all under
    ``MemoryModel(checkpoint=True)``, else none); their memory counts their inputs per microbatch
    in flight, and their cost their second forward (see :mod:`pipesplit.passes.plan.checkpointing`).
    ``quick``: fewer slacks and no re-split of the sides (:func:`rebalance`), to compare sets quickly.
    """
    cands = schedule_candidates(chain, seconds, schedule, comm=comm, memory=memory, mem_cap=mem_cap, limits=limits,
                                device_kind=device_kind, checkpoint=checkpoint, quick=quick)
    ckpt = (frozenset(range(schedule.num_stages)) if memory.checkpoint else frozenset()) if checkpoint is None else checkpoint
    return choose(cands), step_lower_bound(seconds, schedule, len(ckpt) == schedule.num_stages)


def schedule_candidates(
    chain: Chain, seconds: np.ndarray, schedule: Schedule, *, comm: CommModel, memory: MemoryModel,
    mem_cap: int | None, limits: StageLimits, device_kind: str, checkpoint: frozenset[int] | None = None,
    quick: bool = False,
) -> list[Candidate]:
    """Every split :func:`best_for_schedule` chooses from, each with its simulated step.

    The solver's memory limits count each stage's nodes; the figures also count what it receives
    (:mod:`pipesplit.passes.plan.stage_bytes`), which depends on where it starts and ends: the limits
    leave room for a typical cut's inputs per microbatch in flight, splits whose figures still go over
    ``mem_cap`` are dropped, and where that leaves none, solved again with the limits lowered by the
    least overshoot (twice at most)."""
    if mem_cap is None:
        return _candidates(chain, seconds, schedule, comm=comm, memory=memory, mem_cap=None, room=None,
                           limits=limits, device_kind=device_kind, checkpoint=checkpoint, quick=quick)
    # the limits start with room for a stage's received inputs at a typical cut, so that the first solve fits
    inner = chain.cut_bytes[1:chain.n][chain.allowed[1:chain.n]]
    typical = float(np.median(inner)) if inner.size else 0.0
    room = int(mem_cap - typical * (max(in_flight_per_stage(schedule), default=0) + 1))
    for _ in range(3):
        try:
            cands = _candidates(chain, seconds, schedule, comm=comm, memory=memory, mem_cap=mem_cap, room=room,
                                limits=limits, device_kind=device_kind, checkpoint=checkpoint, quick=quick)
        except PlanError:
            if room >= mem_cap:
                raise
            room = mem_cap  # that room was too little for any split: the figures decide
            continue
        fits = [c for c in cands if max(c.figures.memory) <= mem_cap]
        if fits:
            return fits
        room = int(room - (min(max(c.figures.memory) for c in cands) - mem_cap) * 1.01) - 1
    k = schedule.num_stages
    ckpt = (frozenset(range(k)) if memory.checkpoint else frozenset()) if checkpoint is None else checkpoint
    in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
    raise PlanError(_memory_message(chain, schedule, in_flight, mem_cap, limits, len(ckpt) == k,
                                    [in_flight[s] if s in ckpt else units[s] for s in range(k)]))


def _candidates(
    chain: Chain, seconds: np.ndarray, schedule: Schedule, *, comm: CommModel, memory: MemoryModel,
    mem_cap: int | None, room: int | None, limits: StageLimits, device_kind: str, checkpoint: frozenset[int] | None,
    quick: bool,
) -> list[Candidate]:
    """The candidates of :func:`schedule_candidates` with the solver's memory limits at ``room`` bytes."""
    k = schedule.num_stages
    in_flight = in_flight_per_stage(schedule)
    units = activation_units_per_stage(schedule)
    ckpt = (frozenset(range(k)) if memory.checkpoint else frozenset()) if checkpoint is None else checkpoint
    # what multiplies one microbatch's activations: its inputs' count when checkpointed, else the units
    held = [in_flight[s] if s in ckpt else units[s] for s in range(k)]
    scale = recompute_scale(seconds)
    limits = checkpoint_limits(chain, room, in_flight, units, ckpt, limits.start_lo, limits.start_hi, scale)
    try:
        splits = solve_candidates(chain, k, QUICK_SLACKS if quick else SLACKS, limits=limits,
                                  precision=10 if quick else 20)
    except PlanError as e:
        if mem_cap is None:
            raise
        raise PlanError(_memory_message(chain, schedule, in_flight, mem_cap, limits, len(ckpt) == k, held)) from e
    base = list(dict.fromkeys(split.starts for split in splits))
    starts = list(base)
    for side_slack in () if quick else REBALANCE_SLACKS:
        solve = _side_solver(chain, limits, room, in_flight, units, ckpt, scale, side_slack)
        for split in base:
            try:
                starts.append(rebalance(chain, split, solve))
            except PlanError:  # a side the limits make unsolvable on its own: keep the split as it is
                continue
    cands = []
    for st in dict.fromkeys(starts):
        fig = figures_for(chain, st, seconds, in_flight, memory, comm, device_kind, units, ckpt,
                          split=split_stages(schedule))
        cands.append(candidate(chain, schedule, st, fig))
    return cands


# Each side of the bottleneck is re-split exactly for balance, and for the fewest bytes within 5% of it.
REBALANCE_SLACKS = (0.0, 0.05)
# Candidates whose predicted steps differ by less than this are ties, far below what the
# cost model can tell apart: of two such splits the better balanced one is the safer.
TIE = 0.002


def choose(cands: Sequence[Candidate]) -> Candidate:
    """The lowest predicted step; among ties, the best balanced (stage times sorted from the
    largest), then the fewest bytes."""
    best_s = min(c.step_s for c in cands)
    ties = [c for c in cands if c.step_s <= best_s * (1 + TIE)]

    def balance(c: Candidate) -> tuple[float, ...]:
        return tuple(sorted((x.forward + x.backward for x in c.figures.costs), reverse=True))

    return min(ties, key=lambda c: (balance(c), c.cut_bytes, c.step_s))


def _side_solver(
    chain: Chain, limits: StageLimits, mem_cap: int | None, in_flight: Sequence[int], units: Sequence[float],
    ckpt: frozenset[int], scale: float, slack: float,
) -> Solve:
    """``rebalance``'s solver under the plan's limits: pins shifted to the side, memory per stage in flight."""

    def solve(sub: Chain, k: int, first_stage: int, first_pos: int) -> Sequence[int]:
        lo = hi = None
        if limits.start_lo is not None and limits.start_hi is not None:
            lo = np.maximum(limits.start_lo[first_stage : first_stage + k] - first_pos, 0)
            hi = limits.start_hi[first_stage : first_stage + k] - first_pos
        stages = range(first_stage, first_stage + k)
        side_ckpt = frozenset(s - first_stage for s in ckpt if s in stages)
        side = checkpoint_limits(sub, mem_cap, [in_flight[s] for s in stages], [units[s] for s in stages],
                                 side_ckpt, lo, hi, scale)
        return solve_candidates(sub, k, [slack], limits=side)[-1].starts

    return solve


def _memory_message(
    chain: Chain, schedule: Schedule, in_flight: Sequence[int], cap: int, limits: StageLimits, checkpoint: bool = False,
    units: Sequence[float] | None = None,
) -> str:
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    state = int((chain.mem - act).sum()) + sum(nbytes for nbytes, _ in chain.shared)
    one = int(act.sum())
    units = in_flight if units is None else units
    pinned = " (and the pins)" if limits.start_lo is not None else ""
    head = (
        f"no split into {schedule.num_stages} stages keeps every stage under max_stage_memory={cap:,} bytes under "
        f"{schedule.name!r} with {schedule.num_microbatches} microbatches{pinned}"
    )
    largest = f"the largest single operation holds {int(chain.node_memory().max(initial=0)):,} bytes with its parameters"
    if checkpoint:
        return (
            f"{head}, even with activation checkpointing: each stage holds its training state, one microbatch's "
            f"activations and its inputs for each of the {list(in_flight)} microbatches in flight; the training "
            f"state is {state:,} bytes, one microbatch's activations {one:,} bytes, and {largest}. Use more stages, "
            "fewer or smaller microbatches in flight, or a larger max_stage_memory."
        )
    return (
        f"{head}: the stages keep {list(in_flight)} microbatches of activations in flight, and with a running "
        f"backward's working set hold {list(units)} microbatches' worth at their peak; the model's training "
        f"state (parameters, gradients, optimizer) is {state:,} bytes and one microbatch's activations {one:,} "
        f"bytes, so some stage holds at least {int(state + one * min(units)) // schedule.num_stages:,} bytes; "
        f"{largest}. Use more stages, fewer microbatches in flight (a schedule that holds fewer, or smaller "
        "microbatches), activation checkpointing, or a larger max_stage_memory."
    )


def step_lower_bound(seconds: np.ndarray, schedule: Schedule, checkpoint: bool = False) -> float:
    """A step time no split can beat: the busiest rank does at least its share of all the
    work, and one microbatch must go forward through every stage and back (W may wait).
    Checkpointing adds the recomputed forward to the work (before each backward)."""
    f, i, w = seconds.sum(axis=0)
    redo = f if checkpoint else 0.0
    return float(max(schedule.num_microbatches * (f + redo + i + w) / schedule.num_ranks, f + redo + i))
