"""What the planner balances: the cost of a node by name (``"flops"``, ``"params"``, ...), a callable, or an
object with ``node_cost(node, costs)``, checked to give a finite number >= 0 for every node."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Union

import torch.fx as fx

from pipesplit.errors import CostError, did_you_mean
from pipesplit.meta import node_cost

CostFn = Callable[[fx.Node], float]
CostSpec = Union[str, CostFn, Any]


def _profile_cost(node: fx.Node) -> float:
    c = node_cost(node)
    if c.time_s is None:
        raise CostError(f"node {node.name!r} has no profiled time: run pipesplit.passes.annotate.profile.profile_nodes first.")
    if c.bwd_time_s is not None:  # profiled backward
        return c.time_s + c.bwd_time_s
    ratio = c.bwd_flops / c.fwd_flops if c.fwd_flops else (1.0 if c.bwd_flops else 0.0)
    return c.time_s * (1.0 + ratio)


def _param_cost(node: fx.Node) -> float:
    return float(sum(node_cost(a).param_bytes for a in node.all_input_nodes if a.op == "get_attr"))


BUILTIN_COSTS: dict[str, CostFn] = {
    "flops": lambda node: float(node_cost(node).total_flops),
    "params": _param_cost,
    "uniform": lambda node: 1.0,
    "profile": _profile_cost,
    "hybrid": _profile_cost,  # times from pipesplit.passes.annotate.calibrate: FLOPs and bytes fitted to a profile
}


def cost_function(cost: CostSpec) -> tuple[str, CostFn]:
    """Resolve ``cost`` to (name, per-node function).

    ``cost`` is a built-in name, a callable ``node -> float``, or an object with a
    ``node_cost(node, costs: NodeCost) -> float`` method.
    """
    if isinstance(cost, str):
        if cost not in BUILTIN_COSTS:
            hint = did_you_mean(cost, BUILTIN_COSTS, n=1, sentence=True)
            raise CostError(f"unknown cost {cost!r}; choose one of {sorted(BUILTIN_COSTS)} or pass a cost object.{hint}")
        return cost, BUILTIN_COSTS[cost]
    if hasattr(cost, "node_cost"):
        name = type(cost).__name__
        _check_arity(f"cost={name}'s node_cost", cost.node_cost, 2)
        return name, _checked_cost(f"cost={name}'s node_cost", lambda node: cost.node_cost(node, node_cost(node)))
    if callable(cost):
        name = getattr(cost, "__name__", "custom")
        _check_arity(f"cost={name}", cost, 1)
        return name, _checked_cost(f"cost={name}", cost)
    raise CostError(f"cost must be a name, a callable or an object with node_cost(); got {type(cost).__name__}.")


def _check_arity(what: str, fn: Callable[..., Any], n: int) -> None:
    """``fn`` can be called with ``n`` positional arguments (refused before the capture otherwise)."""
    try:
        inspect.signature(fn).bind(*([None] * n))
    except TypeError:
        takes = "node" if n == 1 else "node, costs"
        raise CostError(f"{what} must take {n} argument(s) ({takes}) and return a number, but its signature is "
                        f"{inspect.signature(fn)}; e.g. cost=lambda node: 1.0.") from None
    except ValueError:  # a builtin without a signature: called as is
        pass


def _checked_cost(what: str, fn: Callable[[fx.Node], Any]) -> CostFn:
    """``fn``'s cost of a node as a finite number >= 0; its failure or another value is a CostError naming the node."""
    def checked(node: fx.Node) -> float:
        try:
            value = fn(node)
        except Exception as e:
            raise CostError(f"{what} raised on node {node.name!r} ({node.target}): {type(e).__name__}: {e}") from e
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise CostError(f"{what} returned {value!r} for node {node.name!r} ({node.target}); a cost is a finite "
                            "number >= 0 (FLOPs, seconds, or any unit the stages share).")
        return float(value)

    return checked
