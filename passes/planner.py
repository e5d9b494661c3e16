"""Analysis pass: choose, check and evaluate a node -> stage plan (``gm -> Plan``)."""

from __future__ import annotations

import difflib
from typing import Any, Callable, Sequence, Union

import torch.fx as fx

from pipesplit.errors import CostError, PlanError
from pipesplit.meta import NodeCost, node_cost
from pipesplit.passes.chain import build_chain, compute_nodes
from pipesplit.passes.costs import unknown_ops
from pipesplit.passes.partition import solve_chain
from pipesplit.plan import Plan

CostFn = Callable[[fx.Node], float]
CostSpec = Union[str, CostFn, Any]


def _profile_cost(node: fx.Node) -> float:
    c = node_cost(node)
    if c.time_s is None:
        raise CostError(f"node {node.name!r} has no profiled time: run pipesplit.passes.profile.profile_nodes first.")
    ratio = c.bwd_flops / c.fwd_flops if c.fwd_flops else (1.0 if c.bwd_flops else 0.0)
    return c.time_s * (1.0 + ratio)


def _param_cost(node: fx.Node) -> float:
    return float(sum(node_cost(a).param_bytes for a in node.all_input_nodes if a.op == "get_attr"))


BUILTIN_COSTS: dict[str, CostFn] = {
    "flops": lambda node: float(node_cost(node).total_flops),
    "params": _param_cost,
    "uniform": lambda node: 1.0,
    "profile": _profile_cost,
}


def cost_function(cost: CostSpec) -> tuple[str, CostFn]:
    """Resolve ``cost`` to (name, per-node function).

    ``cost`` is a built-in name, a callable ``node -> float``, or an object with a
    ``node_cost(node, costs: NodeCost) -> float`` method.
    """
    if isinstance(cost, str):
        if cost not in BUILTIN_COSTS:
            close = difflib.get_close_matches(cost, BUILTIN_COSTS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise CostError(f"unknown cost {cost!r}; choose one of {sorted(BUILTIN_COSTS)} or pass a cost object.{hint}")
        return cost, BUILTIN_COSTS[cost]
    if hasattr(cost, "node_cost"):
        return type(cost).__name__, lambda node: float(cost.node_cost(node, node_cost(node)))
    if callable(cost):
        return getattr(cost, "__name__", "custom"), lambda node: float(cost(node))
    raise CostError(f"cost must be a name, a callable or an object with node_cost(); got {type(cost).__name__}.")


def evaluate(gm: fx.GraphModule, stages: list[list[str]], cost_name: str, cost_fn: CostFn, source: str) -> Plan:
    """Figures of a given plan: stage costs, bound, memory, bytes each stage sends."""
    by_name = {n.name: n for n in compute_nodes(gm)}
    stage_of = {name: s for s, names in enumerate(stages) for name in names}
    last = len(stages) - 1
    costs, memory, sent = [], [], []
    for s, names in enumerate(stages):
        nodes = [by_name[x] for x in names]
        costs.append(sum(cost_fn(n) for n in nodes))
        attrs = {a for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}
        params = {}
        for a in attrs:
            c = node_cost(a)
            params[id(_resolve(gm, str(a.target)))] = c.param_bytes * (2 if c.trainable else 1)
        memory.append(sum(params.values()) + sum(node_cost(n).out_bytes for n in nodes))
        out = 0
        for n in nodes:
            consumers = {stage_of.get(u.name, last) for u in n.users} - {s}
            out += node_cost(n).out_bytes * len(consumers)
        sent.append(out)
    all_costs = [cost_fn(n) for n in by_name.values()]
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


def _resolve(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def plan_partition(
    gm: fx.GraphModule,
    num_stages: int,
    cost: CostSpec = "flops",
    *,
    max_stage_memory: int | None = None,
    slack: float = 0.05,
) -> Plan:
    """The balanced plan: the exact minimum bottleneck, then the fewest bytes at the cuts."""
    name, fn = cost_function(cost)
    chain = build_chain(gm, fn)
    if chain.n == 0:
        raise PlanError("the model's graph has no operations to split.")
    sol = solve_chain(chain, num_stages, mem_cap=max_stage_memory, slack=slack)
    bounds = list(sol.starts) + [chain.n]
    stages = [[n.name for n in chain.nodes[a:b]] for a, b in zip(bounds, bounds[1:])]
    return evaluate(gm, stages, name, fn, "planner")


def _module_path_of(node: fx.Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]


def plan_from_split_points(
    gm: fx.GraphModule, split_points: Sequence[str], module_paths: set[str], cost: CostSpec = "flops"
) -> Plan:
    """A manual plan: a new stage starts at the first operation of each named module."""
    nodes = compute_nodes(gm)
    starts = [0]
    for point in split_points:
        if point not in module_paths:
            close = difflib.get_close_matches(point, sorted(module_paths), n=3)
            raise PlanError(
                f"split point {point!r} names no module of the model"
                + (f"; did you mean {', '.join(map(repr, close))}?" if close else ".")
            )
        first = next((i for i, n in enumerate(nodes) if point in _module_path_of(n)), None)
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
                raise PlanError(f"node {name!r} is in stage {seen[name]} and again in stage {s}.")
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
                raise PlanError(
                    f"{arg.name!r} (stage {a}) is a {type(arg.meta.get('val')).__name__}, not a tensor, and cannot "
                    f"be sent to {node.name!r} in stage {b}; keep them in one stage."
                )


__all__ = ["plan_partition", "plan_from_split_points", "check_plan", "evaluate", "cost_function", "NodeCost"]
