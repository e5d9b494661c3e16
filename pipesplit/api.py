"""``pipesplit.compile``: capture, annotate costs, plan, split — one readable sequence."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from pipesplit.capture import capture
from pipesplit.errors import PlanError
from pipesplit.passes.costs import annotate_costs
from pipesplit.passes.planner import CostSpec, check_plan, cost_function, evaluate, plan_from_split_points, plan_partition
from pipesplit.passes.profile import profile_nodes
from pipesplit.passes.split import check_devices, split_graph
from pipesplit.plan import Plan
from pipesplit.program import SplitProgram

log = logging.getLogger(__name__)


@contextmanager
def _timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
    log.debug("pipesplit: %s took %.3fs", name, timings[name])


def _default_device(model: nn.Module) -> str:
    for t in model.parameters():
        return str(t.device)
    for t in model.buffers():
        return str(t.device)
    return "cpu"


def compile(
    model: nn.Module,
    example_input: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    num_stages: int | None = None,
    cost: CostSpec = "flops",
    devices: Sequence[str | torch.device] | None = None,
    split_points: Sequence[str] | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    max_stage_memory: int | None = None,
    slack: float = 0.05,
    progress: bool = True,
) -> SplitProgram:
    """Split ``model`` into pipeline stages that compute exactly what it computes.

    Args:
        model: any ``nn.Module`` that ``torch.export`` can capture. It is never modified;
            the program holds its own copy of the parameters and buffers.
        example_input: a tensor or a tuple of positional arguments.
        example_kwargs: keyword arguments of the example call.
        num_stages: stages to cut into (default 1, or as many as ``split_points``/``plan`` give).
        cost: ``"flops"`` (default), ``"params"``, ``"profile"``, ``"uniform"``, a callable
            ``node -> float`` or an object with ``node_cost(node, costs)``.
        devices: one device per stage (stages may share one); default the model's device.
        split_points: module paths (``"layers.4"``) where new stages start; bypasses the planner.
        plan: a :class:`Plan` or the path of a saved one, reused instead of planning.
        max_stage_memory: bytes a stage may hold (parameters, gradients, activations).
        slack: fraction above the optimal bottleneck the planner may spend to send fewer bytes.
        progress: show a progress bar while profiling.

    >>> import torch, pipesplit
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> prog = pipesplit.compile(model, torch.randn(2, 8), num_stages=2)
    >>> x = torch.randn(5, 8)
    >>> torch.allclose(prog(x), model(x))
    True
    """
    if num_stages is not None and num_stages < 1:  # fail before the (slow) export
        raise PlanError(f"num_stages must be at least 1, got {num_stages}.")
    timings: dict[str, float] = {}
    with _timed("capture", timings):
        captured = capture(model, example_input, example_kwargs)
    device0 = str(devices[0]) if devices else _default_device(model)
    with _timed("annotate", timings):
        requires = [isinstance(x, torch.Tensor) and x.requires_grad for x in captured.example_flat]
        gm = annotate_costs(captured.gm, requires)
        if cost == "profile":
            profile_nodes(gm, captured.example_flat, device0, mutated_targets=captured.mutated_targets, progress=progress)
    with _timed("plan", timings):
        chosen = _choose_plan(gm, captured.module_paths, num_stages, cost, split_points, plan, max_stage_memory, slack)
    k = chosen.num_stages
    devs = check_devices(list(devices) if devices is not None else [device0] * k, k)
    with _timed("split", timings):
        split = split_graph(gm, chosen.stages, devs)
        program = SplitProgram(captured, split, chosen, devs)
    timings["export"] = captured.export_seconds
    program.timings = timings
    return program


def _choose_plan(
    gm: Any,
    module_paths: set[str],
    num_stages: int | None,
    cost: CostSpec,
    split_points: Sequence[str] | None,
    plan: Plan | str | os.PathLike[str] | None,
    max_stage_memory: int | None,
    slack: float,
) -> Plan:
    if plan is not None and split_points is not None:
        raise PlanError("pass either plan= or split_points=, not both.")
    if plan is not None:
        given = plan if isinstance(plan, Plan) else Plan.load(plan)
        check_plan(gm, given)
        _check_count(num_stages, given.num_stages, "the plan has")
        name, fn = cost_function(cost)
        return evaluate(gm, given.stages, name, fn, "loaded")
    if split_points is not None:
        chosen = plan_from_split_points(gm, list(split_points), module_paths, cost)
        _check_count(num_stages, chosen.num_stages, f"{len(split_points)} split points make")
        return chosen
    return plan_partition(gm, 1 if num_stages is None else num_stages, cost, max_stage_memory=max_stage_memory, slack=slack)


def _check_count(requested: int | None, actual: int, what: str) -> None:
    if requested is not None and requested != actual:
        raise PlanError(f"num_stages={requested} but {what} {actual} stages; drop num_stages or make them agree.")
