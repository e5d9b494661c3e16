"""Analysis pass: choose, check and evaluate a node -> stage plan (``gm -> Plan``)."""

from __future__ import annotations

import difflib
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch.fx as fx

from pipesplit.compat import data_dependent
from pipesplit.errors import PlanError, nearest_names
from pipesplit.meta import NodeCost, node_cost, node_module_paths
from pipesplit.passes.plan.cost_spec import BUILTIN_COSTS, CostFn, CostSpec, cost_function
from pipesplit.passes.plan.chain import Chain, build_chain, compute_nodes
from pipesplit.passes.plan.lengths import LengthMix
from pipesplit.passes.plan.constraints import check_pins_cuttable, forbid_cuts_inside, module_positions, pin_ranges
from pipesplit.passes.plan.inplace import Requirement, check_cuts_left, keep_writes_with_reads, write_requirements
from pipesplit.passes.annotate.costs import unknown_ops
from pipesplit.passes.plan.objective import DEFAULT_FLOPS_PER_S, CommModel, MemoryModel
from pipesplit.passes.annotate.rates import DeviceRates, device_rates, largest_matmul
from pipesplit.passes.plan.orders import candidate_orders
from pipesplit.passes.plan.balance import rebalance
from pipesplit.passes.plan.blocks import block_paths, prefer_block_cuts
from pipesplit.passes.plan.partition import StageLimits, largest_stage, solve_candidates, solve_chain
from pipesplit.passes.plan.recompute import recomputable
from pipesplit.passes.plan.checkpointing import Checkpoint, check_checkpoint, fixed_set
from pipesplit.passes.plan.partial_checkpoint import ask_blocks
from pipesplit.passes.plan.scheduled import solve_scheduled
from pipesplit.passes.plan.step_planner import TIE
from pipesplit.plan import Plan
from pipesplit.schedules import Schedule

def evaluate(gm: fx.GraphModule, stages: list[list[str]], cost_name: str, cost_fn: CostFn, source: str) -> Plan:
    """Figures of a given plan: stage costs, bound, memory, bytes each stage sends."""
    by_name = {n.name: n for n in compute_nodes(gm)}
    stage_of = {name: s for s, names in enumerate(stages) for name in names}
    last = len(stages) - 1
    node_costs = {name: cost_fn(n) for name, n in by_name.items()}  # a profile-based cost_fn is not free
    costs, memory, sent = [], [], []
    for s, names in enumerate(stages):
        nodes = [by_name[x] for x in names]
        costs.append(sum(node_costs[x] for x in names))
        attrs = {a for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}
        params = {}
        for a in attrs:
            c = node_cost(a)
            params[id(operator.attrgetter(str(a.target))(gm))] = c.param_bytes * (2 if c.trainable else 1)
        memory.append(sum(params.values()) + sum(node_cost(n).held_bytes for n in nodes))  # each storage once
        out = 0
        for n in nodes:
            consumers = {stage_of.get(u.name, last) for u in n.users} - {s}
            out += node_cost(n).out_bytes * len(consumers)
        sent.append(out)
    all_costs = list(node_costs.values())
    lower = max(sum(all_costs) / max(len(stages), 1), max(all_costs, default=0.0))
    return Plan(
        stages=[list(x) for x in stages],
        cost_name=cost_name,
        stage_costs=costs,
        bottleneck=max(costs, default=0.0),
        lower_bound=lower,
        stage_memory=memory,
        sent_bytes=sent,
        unknown_ops=unknown_ops(gm),
        source=source,
    )


def plan_partition(
    gm: fx.GraphModule,
    num_stages: int,
    cost: CostSpec = "flops",
    *,
    max_stage_memory: int | None = None,
    slack: float = 0.05,
    module_paths: set[str] | None = None,
    pins: Mapping[str, int] | None = None,
    no_split: Sequence[str] = (),
    schedule: Schedule | None = None,
    comm: CommModel = CommModel(),
    memory: MemoryModel = MemoryModel(),
    recompute: str = "auto",
    mutated_targets: set[str] = frozenset(),  # type: ignore[assignment]
    device_kind: str = "cpu",
    flops_per_s: float | None = None,
    order: str = "auto",
    checkpoint: Checkpoint = None,
    lengths: LengthMix | None = None,
) -> Plan:
    """The balanced plan.

    Without ``schedule``: the exact minimum bottleneck, then the fewest bytes at the cuts
    within ``slack`` of it. With ``schedule``: the split with the lowest simulated step
    time of that schedule (see :mod:`pipesplit.passes.plan.step_planner`), with
    ``max_stage_memory`` counting parameters, gradients, optimizer state and the
    activations of every microbatch the schedule keeps in flight on each stage.

    ``order="auto"`` solves the chain for the program's order of the nodes and for the
    order that runs every node as late as possible (see :mod:`pipesplit.passes.plan.orders`),
    and keeps the better; ``"program"`` solves the program's order only.

    ``checkpoint`` (with ``schedule``): ``"auto"`` chooses the stages that recompute their forward
    together with the cuts (:mod:`pipesplit.passes.plan.checkpoint_search`); True, False or stage
    indices fix them (None: as ``memory.checkpoint``).

    ``lengths`` (with ``schedule``): the lowest expected step over those lengths of a dynamic
    dimension (:mod:`pipesplit.passes.plan.lengths`).
    """
    check_checkpoint(checkpoint)
    name, fn = cost_function(cost)
    rate = flops_per_s or DEFAULT_FLOPS_PER_S.get(device_kind, DEFAULT_FLOPS_PER_S["cpu"])
    # a schedule's step time prices the default cost at this device's measured rates (unless a FLOP
    # rate is given); balancing alone needs no seconds, so compiling without a schedule measures nothing
    rates = (device_rates(device_kind, largest_matmul(gm.graph.nodes))
             if name == "flops" and flops_per_s is None and schedule is not None else None)
    check_choice("recompute", recompute, RECOMPUTE_CHOICES)
    check_choice("order", order, ORDER_CHOICES)
    rebuild = cheap_to_recompute(gm, mutated_targets, comm, device_kind, rate) if recompute == "auto" else set()
    program = compute_nodes(gm)
    if not program:
        raise PlanError("the model's graph has no operations to split.")
    orders = candidate_orders(program) if order == "auto" else [("program", program)]
    together = write_requirements(gm)  # in-place writes kept with the reads a cut would separate
    # seconds per unit of cost, to price a split between blocks against the free one (None: a unit of its own)
    per_cost = 1.0 / rate if name == "flops" else 1.0 if name in ("profile", "hybrid") else None
    blocks = block_paths(gm, num_stages) if per_cost is not None and schedule is None and not pins else []
    solved: list[_Solved] = []
    for i, (label, nodes) in enumerate(orders):
        # the other orders take the checkpointed stages the program's order chose (the search is the slow part)
        chosen = solved[0].extra.get("checkpoint", checkpoint) if solved and checkpoint == "auto" else checkpoint
        try:
            solved.append(_solve_order(
                gm, nodes, label, fn, name, rate, num_stages, rebuild, max_stage_memory=max_stage_memory,
                slack=slack, known=module_paths or set(), pins=pins or {}, no_split=no_split, schedule=schedule,
                comm=comm, memory=memory, device_kind=device_kind, rates=rates, checkpoint=chosen, lengths=lengths,
                together=together, blocks=blocks, per_cost=per_cost,
            ))
        except PlanError:
            if i == 0:  # the program's order: the user's error
                raise
    best = _best_order(solved, slack)
    bounds = list(best.starts) + [best.chain.n]
    stages = [[n.name for n in best.chain.nodes[a:b]] for a, b in zip(bounds, bounds[1:])]
    plan = evaluate(gm, stages, name, fn, "planner")
    plan.recompute = sorted(rebuild)
    fixed = fixed_set(checkpoint, num_stages, memory.checkpoint)
    plan.checkpoint = sorted(fixed or ())  # with a schedule, the choice made (in best.extra)
    if isinstance(checkpoint, Mapping) and schedule is None:  # {stage: blocks} on the split as balanced
        ask_blocks(plan, best.chain, best.starts, checkpoint)
    plan.max_stage_memory = max_stage_memory
    plan.order = best.label
    for key, value in best.extra.items():
        setattr(plan, key, value)
    if best.memory is not None:
        plan.stage_memory = best.memory
    return plan


RECOMPUTE_CHOICES = ("auto", "never")
ORDER_CHOICES = ("auto", "program")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    """Raise PlanError unless ``value`` is one of ``choices`` (a planner option given by name)."""
    if value not in choices:
        raise PlanError(f"{name} must be {' or '.join(map(repr, choices))}, got {value!r}.")


@dataclass
class _Solved:
    """The best split of one order of the nodes, with what it is compared by."""

    label: str
    chain: Chain
    starts: tuple[int, ...]
    bottleneck: float
    cut_bytes: int
    step_s: float | None = None
    memory: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _solve_order(
    gm: fx.GraphModule, nodes: list[fx.Node], label: str, fn: CostFn, name: str, rate: float, num_stages: int,
    rebuild: set[str], *, max_stage_memory: int | None, slack: float, known: set[str], pins: Mapping[str, int],
    no_split: Sequence[str], schedule: Schedule | None, comm: CommModel, memory: MemoryModel, device_kind: str,
    rates: DeviceRates | None = None, checkpoint: Checkpoint = None, lengths: LengthMix | None = None,
    together: Sequence[Requirement] = (), blocks: Sequence[str] = (), per_cost: float | None = None,
) -> _Solved:
    state_factor = memory.training_state_factor(with_optimizer=schedule is not None)
    chain = build_chain(gm, fn, state_factor=state_factor, recompute=rebuild, order=nodes)
    if together:
        before = chain.allowed
        chain.allowed, spans = keep_writes_with_reads(chain.nodes, before, together)
        check_cuts_left(num_stages, before, chain.allowed, spans)
    if no_split:
        chain.allowed = forbid_cuts_inside(chain.nodes, chain.allowed, no_split, known)
    ranges = pin_ranges(chain.nodes, pins, num_stages, known)
    if no_split and pins:
        check_pins_cuttable(chain.nodes, chain.allowed, pins, no_split)
    limits = StageLimits(None, ranges.start_lo, ranges.start_hi) if ranges else StageLimits()
    if schedule is not None:
        got = solve_scheduled(
            gm, chain, nodes, lambda: build_chain(gm, fn, state_factor=state_factor, recompute=rebuild, order=nodes),
            name, fn, rate, num_stages, schedule, comm=comm, memory=memory, mem_cap=max_stage_memory, limits=limits,
            device_kind=device_kind, rates=rates, checkpoint=checkpoint, lengths=lengths)
        return _Solved(label, chain, got.starts, largest_stage(chain, got.starts), got.cut_bytes, got.step_s,
                       got.memory, got.extra)
    if ranges is not None:
        cands = solve_candidates(chain, num_stages, [slack], limits=limits, mem_cap=max_stage_memory)
        best_b = min(c.bottleneck for c in cands)
        ok = [c for c in cands if c.bottleneck <= best_b * (1 + slack)]
        starts = min(ok, key=lambda c: (c.cut_bytes, c.bottleneck)).starts
    else:
        def split(ch: Chain) -> tuple[int, ...]:
            found = solve_chain(ch, num_stages, mem_cap=max_stage_memory, slack=slack).starts
            # the stages on each side of the bottleneck by the same rule, for their own bottleneck
            return rebalance(ch, found, lambda sub, k, _s, _p: solve_chain(sub, k, mem_cap=max_stage_memory,
                                                                           slack=slack).starts)

        starts = split(chain)
        if blocks and per_cost is not None:  # whole blocks per stage unless that is slower, priced in seconds
            starts = prefer_block_cuts(chain, starts, blocks, split, slack=slack, seconds_per_cost=per_cost,
                                       comm=comm, device_kind=device_kind)
    return _Solved(label, chain, tuple(starts), largest_stage(chain, starts),
                   int(chain.cut_bytes[list(starts[1:])].sum()))


def _best_order(solved: list[_Solved], slack: float) -> _Solved:
    """The program's order unless another one is clearly better: a lower predicted step (beyond
    the planner's tie), or, without a schedule, fewer bytes within ``slack`` of the best bottleneck."""
    program = solved[0]
    if program.step_s is not None:
        best = min(solved, key=lambda s: s.step_s)  # type: ignore[arg-type, return-value]
        return best if best.step_s < program.step_s * (1 - TIE) else program  # type: ignore[operator]
    opt = min(s.bottleneck for s in solved)
    ok = [s for s in solved if s.bottleneck <= opt * (1 + slack) + 1e-12]
    return min(ok, key=lambda s: (s.cut_bytes, s.bottleneck))


def cheap_to_recompute(
    gm: fx.GraphModule, mutated: set[str], comm: CommModel, device_kind: str, rate: float | None = None
) -> set[str]:
    """Input-derived values whose recomputation costs less time than sending them."""
    rate = rate or DEFAULT_FLOPS_PER_S.get(device_kind, DEFAULT_FLOPS_PER_S["cpu"])
    out = set()
    by_name = {n.name: n for n in gm.graph.nodes}
    for name, flops in recomputable(gm, mutated).items():
        nbytes = node_cost(by_name[name]).out_bytes
        if nbytes and flops / rate < comm.seconds(nbytes, device_kind, device_kind):
            out.add(name)
    return out


def plan_from_split_points(
    gm: fx.GraphModule, split_points: Sequence[str], module_paths: set[str], cost: CostSpec = "flops"
) -> Plan:
    """A manual plan: a new stage starts at the first operation of each named module."""
    nodes = compute_nodes(gm)
    starts = [0]
    for point in split_points:
        if point not in module_paths:
            raise PlanError(f"split point {point!r} names no module of the model"
                            + (nearest_names(point, module_paths) or ".")
                            + " Split points are module names of model.named_modules(), e.g. split_points=['layers.2'].")
        first = next(iter(module_positions(nodes, point)), None)
        if first is None:
            raise PlanError(f"split point {point!r} is a module that runs no operation in the captured graph.")
        if first <= starts[-1]:
            raise PlanError(
                f"split points must follow the order modules run in: {point!r} starts at operation {first}, "
                f"not after the previous split at operation {starts[-1]}."
            )
        starts.append(first)
    bounds = starts + [len(nodes)]
    stages = [[n.name for n in nodes[a:b]] for a, b in zip(bounds, bounds[1:])]
    name, fn = cost_function(cost)
    plan = evaluate(gm, stages, name, fn, "split_points")
    check_plan(gm, plan)
    return plan


def check_plan(gm: fx.GraphModule, plan: Plan) -> None:
    """Raise PlanError unless ``plan`` assigns every compute node once, forward-only, no empty stage."""
    nodes = compute_nodes(gm)
    names = {n.name for n in nodes}
    seen: dict[str, int] = {}
    for s, stage in enumerate(plan.stages):
        if not stage:
            raise PlanError(f"stage {s} of the plan is empty; every stage needs at least one operation.")
        for name in stage:
            if name in seen:
                raise PlanError(f"node {name!r} is in stage {seen[name]} and again in stage {s}; each node runs in "
                                "exactly one stage: remove it from one of them.")
            seen[name] = s
    unknown = sorted(set(seen) - names)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(names), n=3)
        raise PlanError(
            f"the plan names {len(unknown)} node(s) the graph does not have, e.g. {unknown[:5]}"
            + (f"; close names: {close}" if close else "")
            + ". Was the plan made for another model or input shape?"
        )
    missing = [n.name for n in nodes if n.name not in seen]
    if missing:
        raise PlanError(f"the plan leaves {len(missing)} node(s) without a stage, e.g. {missing[:5]}.")
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.name not in seen:
                continue
            a, b = seen[arg.name], seen[node.name]
            if a > b:
                raise PlanError(
                    f"node {node.name!r} (stage {b}) uses {arg.name!r} from a later stage {a}; "
                    "values may only flow to the same or a later stage."
                )
            if a < b and not node_cost(arg).sendable:
                what = f"a {type(arg.meta.get('val')).__name__}, not a tensor,"
                if data_dependent(arg.meta.get("val")):
                    source = _size_source(arg)
                    what = (f"a value whose size depends on the inputs' values (made by {source.name!r}, "
                            f"{source.target}) and")
                raise PlanError(
                    f"{arg.name!r} (stage {a}) is {what} cannot be sent to {node.name!r} in stage {b}; keep them in "
                    "one stage (a cut before it, or after the value is reduced to a fixed size)."
                )


def _size_source(node: fx.Node) -> fx.Node:
    """The op that made ``node``'s data-dependent size: the first one up its inputs whose own inputs have none."""
    while True:
        up = next((a for a in node.all_input_nodes if data_dependent(a.meta.get("val"))), None)
        if up is None:
            return node
        node = up


__all__ = [
    "plan_partition", "plan_from_split_points", "check_plan", "evaluate", "cost_function", "cheap_to_recompute",
    "NodeCost", "BUILTIN_COSTS", "CostFn", "CostSpec",
]
