"""Warnings on a plan a user would want to hear of: more stages than the model can balance or has
blocks, empty stages."""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch.fx as fx

from pipesplit.meta import node_cost, node_module_paths
from pipesplit.passes.plan.chain import compute_nodes
from pipesplit.plan import Plan
from pipesplit.units import format_cost

_TOLERANCE = 1e-9  # relative: a largest op of exactly a k-th of the model still balances k stages
# warn once the largest op alone is this far above the mean stage: a little above is the usual
# granularity of a small model, not a stage count chosen too high
_UNBALANCED = 1.25


def plan_warnings(gm: fx.GraphModule, plan: Plan, node_costs: dict[str, float]) -> list[str]:
    """What is wrong with ``plan``'s stage count, one sentence each (``[]``: nothing).

    A stage count is more than the model can balance when its largest op, which no cut can
    divide, costs more than the model's total over that count (warned from ``_UNBALANCED``
    times that): no split reaches the mean, and that op sets the bottleneck. ``node_costs``
    holds each compute node's cost in the plan's unit. A stage without FLOPs (lookups, views,
    copies) does no compute: its rank only waits and passes values on.
    """
    out = []
    k = plan.num_stages
    total = sum(node_costs.values())
    if k > 1 and node_costs:
        name, biggest = max(node_costs.items(), key=lambda item: item[1])
        if biggest > 0 and biggest * k > total * _UNBALANCED:
            most = max(1, math.floor(total / biggest * (1 + _TOLERANCE)))
            unit = plan.cost_name
            out.append(
                f"num_stages={k} is more than this model can balance: its largest op, {_describe(gm, name)}, costs "
                f"{format_cost(biggest, unit)}, more than a 1/{k} share of the model's {format_cost(total, unit)} "
                f"({format_cost(total / k, unit)}); no cut divides an op, so the bottleneck stage cannot cost less "
                f"(cost balance {plan.bottleneck / (total / k):.2f}x the mean). At most {most} stage{'s' if most > 1 else ''} balance{'' if most > 1 else 's'}: "
                f"compile with num_stages={most}{' or fewer' if most > 1 else ''}."
            )
    blocks = repeated_blocks(gm)
    if plan.source == "planner" and blocks is not None and k > blocks[1]:
        (prefix, n) = blocks
        first, last = (f"{prefix}.0", f"{prefix}.{n - 1}") if prefix else ("0", str(n - 1))
        out.append(
            f"num_stages={k} is more than the model's {n} repeated blocks ({first} to {last}): {k - n} or more "
            f"cut{'s' if k - n > 1 else ''} fall inside a block (in its attention or MLP), where more tensors cross "
            f"than between two blocks. Compile with num_stages={n} or fewer to cut between blocks only."
        )
    by_name = {n.name: n for n in compute_nodes(gm)}
    empty = [s for s, names in enumerate(plan.stages)
             if not any(node_cost(by_name[x]).total_flops for x in names if x in by_name)]
    if empty and len(empty) < k:  # a model without FLOPs at all (a lookup) is not split wrongly
        which = f"stage {empty[0]}" if len(empty) == 1 else f"stages {', '.join(map(str, empty))}"
        out.append(
            f"{which} of {k} {'does' if len(empty) == 1 else 'do'} no compute (0 FLOPs: only lookups, views or "
            "copies), a rank that only waits and passes values on. Compile with fewer stages."
        )
    return out


def _describe(gm: fx.GraphModule, name: str) -> str:
    node = next(n for n in gm.graph.nodes if n.name == name)
    paths = node_module_paths(node)
    target = getattr(node.target, "__name__", str(node.target)) if node.op != "call_function" else str(node.target)
    return f"{name!r} ({target}{f' in {paths[-1]}' if paths else ''})"


_INDEXED = re.compile(r"^(?:(.*)\.)?(\d+)$")


def repeated_blocks(gm: fx.GraphModule) -> tuple[str, int] | None:
    """The model's repeated blocks: the most numerous children ``prefix.0``, ``prefix.1``, ... of one
    class that its ops ran in (``("blocks", 12)`` for a 12-block GPT, ``("model.layers", 4)`` for a
    Hugging Face Llama), outermost first on a tie; None without two such children."""
    return repeated_in(compute_nodes(gm))


def repeated_in(nodes: Sequence[fx.Node]) -> tuple[str, int] | None:
    """:func:`repeated_blocks` of these nodes."""
    found: dict[tuple[str, str], set[int]] = {}
    for node in nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            m = _INDEXED.match(path or "")
            if m:
                found.setdefault((m.group(1) or "", str(kind)), set()).add(int(m.group(2)))
    if not found:
        return None
    (prefix, _), indices = max(found.items(), key=lambda item: (len(item[1]), -item[0][0].count(".")))
    return (prefix, len(indices)) if len(indices) > 1 else None
