"""Planning across lengths: the split with the lowest expected simulated step over the lengths a batch takes.

Attention's work grows with the square of the sequence length and an MLP's linearly, so the cut
that balances short batches leaves long ones with a slow attention-heavy stage, and the other way
round. ``compile(..., dynamic_dims={"input_ids": 1}, schedule="1f1b", plan_lengths={128: 0.7,
1024: 0.3})`` prices every node at each length (the graph's size symbol set to it: FLOPs, bytes,
the device's rates), simulates each candidate split at each, and keeps the split whose step,
weighted over the lengths, is lowest. ``plan.lengths``, ``plan.length_weights`` and
``plan.length_steps_s`` say the step predicted at each; ``plan.predicted_step_s`` is their
weighted mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.fx as fx

from pipesplit.capture import InputInfo
from pipesplit.errors import PlanError
from pipesplit.meta import META_KEY, node_cost
from pipesplit.passes.annotate.costs import annotate_costs
from pipesplit.passes.annotate.flops import at_sizes, hint
from pipesplit.passes.annotate.rates import DeviceRates
from pipesplit.passes.plan.chain import Chain, build_chain, compute_nodes
from pipesplit.passes.plan.checkpoint_search import best_with_checkpointing
from pipesplit.passes.plan.objective import (
    CommModel, MemoryModel, StageFigures, activation_units_per_stage, in_flight_per_stage, split_stages, step_time,
)
from pipesplit.passes.plan.partition import StageLimits
from pipesplit.passes.plan.step_planner import (
    Candidate, choose, figures_for, node_seconds, schedule_candidates, step_lower_bound,
)
from pipesplit.schedules import Schedule, StageCost

EXAMPLE = "plan_lengths=[128, 1024] (equal weights) or plan_lengths={128: 0.7, 1024: 0.3}"


def parse_plan_lengths(given: Any) -> dict[int, float] | None:
    """``plan_lengths=`` as {length: weight}, the weights summing to 1; None stays None.

    >>> parse_plan_lengths([32, 128])
    {32: 0.5, 128: 0.5}
    >>> parse_plan_lengths({64: 3, 256: 1})
    {64: 0.75, 256: 0.25}
    """
    if given is None:
        return None
    if isinstance(given, Mapping):
        pairs = list(given.items())
    elif isinstance(given, (list, tuple, set, frozenset)):
        pairs = [(length, 1) for length in given]
        if len(set(pairs)) != len(pairs):
            raise PlanError(f"plan_lengths={given!r} names a length twice; give each once, or weights as a dict: "
                            f"{EXAMPLE}.")
    else:
        raise PlanError(f"plan_lengths takes a list of lengths or a dict of length -> weight, got "
                        f"{type(given).__name__} {given!r}; e.g. {EXAMPLE}.")
    if not pairs:
        raise PlanError(f"plan_lengths is empty; give at least one length, e.g. {EXAMPLE}.")
    for length, weight in pairs:
        if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1:
            raise PlanError(f"plan_lengths: {length!r} is not a length; lengths are whole numbers >= 1, e.g. {EXAMPLE}.")
        if (isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight)
                or weight <= 0):
            raise PlanError(f"plan_lengths[{length}] = {weight!r}: a weight is a finite number > 0 (how often batches "
                            f"of that length come; they need not sum to 1), e.g. {EXAMPLE}.")
    total = float(sum(float(w) for _, w in pairs))
    return {int(length): float(w) / total for length, w in sorted(pairs)}


@dataclass(frozen=True)
class LengthMix:
    """The lengths to plan for: the size symbol of the one dynamic dimension they give, and each length's weight."""

    symbol: Any  # the sympy symbol the capture named the dimension by
    where: str  # "input 'input_ids' dimension 1", for messages
    weights: dict[int, float]  # length -> weight, summing to 1
    dim: int = 1  # the dimension of the inputs that holds the length
    example: int = 0  # the example's length


def length_mix(gm: fx.GraphModule, inputs: Sequence[InputInfo], batch_dim: int, weights: Mapping[int, float]) -> LengthMix:
    """The dimension ``plan_lengths`` applies to: the one dynamic dimension besides the batch that the capture
    has (inputs that share a length share its symbol); a PlanError when there is none or several."""
    found: dict[Any, list[str]] = {}
    dims: dict[Any, tuple[int, int]] = {}  # symbol -> (dimension, example size) where it is first read
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, info in zip(placeholders, inputs):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt) or (info.batched and d == batch_dim):
                continue
            expr = size.node.expr
            if getattr(expr, "is_Symbol", False):
                found.setdefault(expr, []).append(f"input {info.name!r} dimension {d}")
                dims.setdefault(expr, (d, hint(size)))
    if not found:
        raise PlanError(
            f"plan_lengths={dict(weights)} prices the split at lengths of a dynamic dimension, but the program has none "
            "besides the batch. Declare the length dynamic: compile(..., dynamic_dims={'input_ids': 1}, plan_lengths=...).")
    if len(found) > 1:
        listed = "; ".join(" = ".join(places) for places in found.values())
        raise PlanError(
            f"plan_lengths applies to one length, but the program has {len(found)} dynamic dimensions besides the "
            f"batch ({listed}), so which one it means is ambiguous. Declare only the length dynamic "
            "(dynamic_dims={'input_ids': 1} rather than True).")
    symbol, places = next(iter(found.items()))
    where = places[0]
    for node, info in zip(placeholders, inputs):
        val = node.meta.get("val")
        for d, (low, high) in info.ranges.items():
            taken = val.shape[d] if isinstance(val, torch.Tensor) and d < val.dim() else None
            if not isinstance(taken, torch.SymInt) or taken.node.expr != symbol:
                continue
            bad = [length for length in weights if (high is not None and length > high) or (low > 2 and length < low)]
            if bad:
                raise PlanError(f"plan_lengths {bad}: {where} takes sizes {low}..{high or 'any'} in this program; plan "
                                "for lengths within them, or declare a wider range in dynamic_dims.")
    return LengthMix(symbol, where, dict(weights), *dims[symbol])


@contextlib.contextmanager
def costs_at(gm: fx.GraphModule, mix: LengthMix, length: int) -> Iterator[None]:
    """Within the block every node's costs, and every size the planner reads, are those at ``length``;
    the example's costs (with any profiled times) come back after."""
    saved = {n: n.meta[META_KEY] for n in gm.graph.nodes if META_KEY in n.meta}
    requires = [node_cost(n).requires_grad for n in gm.graph.nodes if n.op == "placeholder"]
    with at_sizes({mix.symbol: length}):
        try:
            annotate_costs(gm, requires)
            yield
        finally:
            for node, cost in saved.items():
                node.meta[META_KEY] = cost


@dataclass
class AtLength:
    """One length's chain (costs, memory, cut bytes at that length) and per-node seconds."""

    length: int
    weight: float
    chain: Chain
    seconds: np.ndarray


@dataclass
class Expected:
    """The split chosen for the expected step: the candidate (``step_s`` the expected step), a lower bound
    on any split's expected step, the steps at each length."""

    candidate: Candidate
    ideal: float
    steps: list[float]


def best_over_lengths(
    per: Sequence[AtLength], schedule: Schedule, *, comm: CommModel, memory: MemoryModel, mem_cap: int | None,
    limits: StageLimits, device_kind: str, checkpoint: frozenset[int],
) -> Expected:
    """The split with the lowest expected simulated step over ``per``'s lengths, from every length's candidates
    (each split the schedule-aware planner weighs at that length), under ``mem_cap`` at every length."""
    in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
    kw = dict(comm=comm, memory=memory, mem_cap=mem_cap, limits=limits, device_kind=device_kind, checkpoint=checkpoint)
    starts: list[tuple[int, ...]] = []
    errors: list[PlanError] = []
    for at in per:
        # each length's splits balanced by its costs (FLOPs), and by its seconds: at a short length a per-op
        # overhead the FLOPs do not see can move the best cut far from the FLOP balance
        for chain in (at.chain, dataclasses.replace(at.chain, cost=at.seconds.sum(axis=1))):
            try:
                starts += [c.starts for c in schedule_candidates(chain, at.seconds, schedule, **kw)]  # type: ignore[arg-type]
            except PlanError as e:  # no split fits this length's memory: the others' candidates are checked below
                errors.append(e)
    if len(errors) == 2 * len(per):
        raise errors[-1]
    scored: list[tuple[Candidate, list[float]]] = []
    for st in dict.fromkeys(starts):
        figs = [figures_for(at.chain, st, at.seconds, in_flight, memory, comm, device_kind, units, checkpoint,
                            split=split_stages(schedule))
                for at in per]
        peak = [max(f.memory[s] for f in figs) for s in range(len(st))]
        if mem_cap is not None and max(peak) > mem_cap:
            continue
        steps = [step_time(schedule, f) for f in figs]
        mean = _mean_figures(figs, [at.weight for at in per], peak)
        expected = float(sum(at.weight * s for at, s in zip(per, steps)))
        cut = int(sum(per[-1].chain.cut_bytes[list(st[1:])]))
        scored.append((Candidate(st, mean, expected, cut), steps))
    if not scored:
        raise errors[-1] if errors else PlanError(
            f"no split keeps every stage under max_stage_memory={mem_cap:,} bytes at every length of plan_lengths "
            f"{[at.length for at in per]}; plan for shorter lengths, or raise the cap.")
    best = choose([c for c, _ in scored])
    steps = next(s for c, s in scored if c is best)
    ideal = float(sum(at.weight * step_lower_bound(at.seconds, schedule, len(checkpoint) == schedule.num_stages)
                      for at in per))
    return Expected(best, ideal, steps)


def _mean_figures(figs: Sequence[StageFigures], weights: Sequence[float], memory: list[float]) -> StageFigures:
    """Stage times and link times weighted over the lengths, and each stage's peak memory over them."""
    costs = [StageCost(*(float(sum(w * getattr(f.costs[s], part) for f, w in zip(figs, weights)))
                         for part in ("forward", "backward_input", "backward_weight")))
             for s in range(len(figs[0].costs))]
    comm = [float(sum(w * f.comm[c] for f, w in zip(figs, weights))) for c in range(len(figs[0].comm))]
    return StageFigures(costs, comm, memory, list(figs[0].in_flight))


def solve_over_lengths(
    gm: fx.GraphModule, chain: Chain, mix: LengthMix, schedule: Schedule, build: Callable[[], tuple[Chain, np.ndarray]],
    *, comm: CommModel, memory: MemoryModel, mem_cap: int | None, limits: StageLimits, device_kind: str,
    checkpoint: frozenset[int] | None,
) -> tuple[Expected, frozenset[int]]:
    """The split for ``mix``'s expected step and the stages it checkpoints. ``build`` makes the chain and the
    per-node seconds from the costs in force (called at each length); cuts stay where ``chain`` allows them.
    ``checkpoint`` None (``"auto"``): the set the longest length, whose activations bind the cap, needs."""
    per = []
    for length, weight in mix.weights.items():
        with costs_at(gm, mix, length):
            at_chain, seconds = build()
        at_chain.allowed = chain.allowed
        per.append(AtLength(length, weight, at_chain, seconds))
    if checkpoint is None:
        longest = per[-1]
        found, _, checkpoint = best_with_checkpointing(
            longest.chain, longest.seconds, schedule, comm=comm, memory=memory, mem_cap=mem_cap, limits=limits,
            device_kind=device_kind, checkpoint=None)
        # over several lengths a stage is checkpointed whole: one that would recompute only its first
        # blocks at the longest length recomputes all of its forward (never over the cap; a little slower)
        checkpoint = frozenset(checkpoint) | frozenset(found.heads)
    best = best_over_lengths(per, schedule, comm=comm, memory=memory, mem_cap=mem_cap, limits=limits,
                             device_kind=device_kind, checkpoint=checkpoint)
    return best, checkpoint


def steps_over_lengths(
    gm: fx.GraphModule, stages: Sequence[Sequence[str]], mix: LengthMix, schedule: Schedule, *, flops_per_s: float,
    rates: DeviceRates | None = None, comm: CommModel = CommModel(), memory: MemoryModel = MemoryModel(),
    device_kind: str = "cpu", checkpoint: frozenset[int] = frozenset(), recompute: Sequence[str] = (),
) -> list[float]:
    """The simulated step of the split ``stages`` (node names per stage) at each of ``mix``'s lengths, FLOPs
    priced at ``rates`` (the device's measured ones) or, without, at ``flops_per_s``: what the planner weighs."""
    by_name = {n.name: n for n in compute_nodes(gm)}
    nodes = [by_name[name] for stage in stages for name in stage]
    starts = tuple(int(s) for s in np.cumsum([0] + [len(stage) for stage in stages[:-1]]))
    def fn(node: fx.Node) -> float:
        return float(node_cost(node).total_flops)

    factor = memory.training_state_factor(with_optimizer=True)
    in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
    steps = []
    for length in mix.weights:
        with costs_at(gm, mix, length):
            chain = build_chain(gm, fn, state_factor=factor, recompute=recompute, order=nodes)
            seconds = node_seconds(nodes, "flops", fn, flops_per_s, rates)
        fig = figures_for(chain, starts, seconds, in_flight, memory, comm, device_kind, units, checkpoint,
                          split=split_stages(schedule))
        steps.append(step_time(schedule, fig))
    return steps
