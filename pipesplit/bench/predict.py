"""What the compiler predicts for a split under a schedule: stage times, step time, memory, bytes."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from pipesplit.errors import InputError
from pipesplit.meta import META_KEY, node_cost
from pipesplit.passes.plan.chain import compute_nodes
from pipesplit.passes.plan.objective import (
    DEFAULT_FLOPS_PER_S, CommModel, MemoryModel, activation_units_per_stage, in_flight_per_stage,
)
from pipesplit.passes.plan.planner import cost_function
from pipesplit.passes.annotate.gpu_rates import gpu_slowdown
from pipesplit.passes.annotate.rates import concurrent_slowdown, device_rates, largest_matmul, priced
from pipesplit.passes.plan.step_planner import node_seconds
from pipesplit.passes.split.program import SplitProgram
from pipesplit.runtime.engine.weight_grads import split_overhead_s, weight_graph
from pipesplit.schedules import ActionKind, Schedule, StageCost, Timeline, simulate
from pipesplit.schedules.shared import simulate_shared


@dataclass(frozen=True)
class Prediction:
    """The cost model's view of one configuration (seconds are per microbatch unless named _step)."""

    costs: list[StageCost]
    """Per stage forward, input-gradient and weight-gradient seconds of one microbatch, alone
    (``timeline.stage_costs()``: as they run in the simulated step, sharing cores)."""
    comm: list[float]
    """Seconds to move one microbatch's boundary values across each cut (0 within a device)."""
    timeline: Timeline
    """The simulated step."""
    memory: list[float]
    """Estimated peak bytes per stage: parameters, their gradients, activations in flight."""


def _stage_nodes(prog: SplitProgram) -> list[list[Any]]:
    return [[n for n in compute_nodes(s.module) if META_KEY in n.meta] for s in prog.stages]


def stage_seconds(prog: SplitProgram, cost: Any, scale: float) -> list[StageCost]:
    """Per stage (F, I, W) seconds from the nodes' cost annotations, for a microbatch ``scale``
    times the example batch the program was compiled with.

    FLOP costs become seconds at the measured rates of each stage's device (as the
    schedule-aware planner prices them); profiled costs use the profiled times; user
    units keep their per-node weights, spread like FLOPs. In seconds (FLOPs, profile), each
    op's fixed cost, the per-op overhead its device measured, stays as it is and only the rest
    scales with the batch: a microbatch of 2 does not launch an op in 1/8 of the time 16 do.
    """
    name, fn = cost_function(cost)
    per_stage = _stage_nodes(prog)
    everything = [n for nodes in per_stage for n in nodes]
    rates = [DEFAULT_FLOPS_PER_S.get(s.device.type, DEFAULT_FLOPS_PER_S["cpu"]) for s in prog.stages]
    largest = largest_matmul(everything)  # a GPU measures its FLOP rate up to the graph's largest multiply
    if name == "flops":  # each stage priced at its own device's measured rates
        seconds = [node_seconds(nodes, name, fn, rates[i], device_rates(prog.stages[i].device, largest))
                   if nodes else np.zeros((0, 3)) for i, nodes in enumerate(per_stage)]
    else:
        flat = node_seconds(everything, name, fn, rates[0]) if everything else np.zeros((0, 3))
        bounds = np.cumsum([0] + [len(nodes) for nodes in per_stage])
        seconds = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
    timed = name in ("flops", "profile", "hybrid")  # seconds on each stage's own device
    out = []
    for stage, secs in enumerate(seconds):
        if timed and len(secs):
            r = device_rates(prog.stages[stage].device, largest)
            fixed = np.minimum(secs, [r.forward_op_s, r.backward_op_s, 0.0])
            f, i, w = fixed.sum(axis=0) + (secs - fixed).sum(axis=0) * scale
        else:
            f, i, w = secs.sum(axis=0) * scale * rates[0] / rates[stage] if len(secs) else (0.0, 0.0, 0.0)
        out.append(StageCost(float(f), float(i), float(w)))
    return out


def boundary_bytes_per_step(prog: SplitProgram, batch: int, num_microbatches: int, training: bool = True) -> int:
    """Bytes all boundaries carry in one step: activations forward and, in training, gradients back."""
    mb = batch // num_microbatches
    total = 0
    for b in prog.boundaries:
        if b.kind == "tensor":
            total += int(microbatch_bytes(prog, b, mb, num_microbatches)) * num_microbatches * (
                2 if training and b.requires_grad else 1)
    return total


def microbatch_bytes(prog: SplitProgram, b: Any, mb: int, num_microbatches: int) -> float:
    """Bytes boundary tensor ``b`` carries for one microbatch of ``mb``.

    A program still captured at the example's batch knows its boundaries at that batch only:
    they are taken to grow in proportion to the batch (as activations do).
    """
    if prog.static_batch is not None:
        return float(b.nbytes * mb / prog.static_batch)
    try:
        numel = float(np.prod(prog.resolve_shape(b, mb)))
        return numel * (torch.empty((), dtype=b.dtype).element_size() if b.dtype else 4)
    except InputError:  # a size that is not a function of the batch: fall back to the example's bytes
        return float(b.nbytes / max(num_microbatches, 1))


def cut_seconds(prog: SplitProgram, batch: int, num_microbatches: int, comm: CommModel) -> list[float]:
    """Per cut ``s -> s+1``, seconds to move one microbatch's values across it.

    Stages on one device hand values over in memory, which costs nothing here.
    """
    mb = batch // num_microbatches
    out = []
    for s in range(prog.num_stages - 1):
        src, dst = prog.stages[s].device, prog.stages[s + 1].device
        if src == dst:
            out.append(0.0)
            continue
        nbytes = sum(microbatch_bytes(prog, b, mb, num_microbatches) for b in prog.boundaries
                     if b.kind == "tensor" and b.src <= s < b.dst)
        out.append(comm.seconds(nbytes, str(src), str(dst)))
    return out


def memory_estimate(prog: SplitProgram, schedule: Schedule, scale: float, memory: MemoryModel) -> list[float]:
    """Peak bytes per stage: state (parameters, gradients, optimizer factor) + activations in flight."""
    in_flight, units = in_flight_per_stage(schedule), activation_units_per_stage(schedule)
    out = []
    for stage, nodes in zip(prog.stages, _stage_nodes(prog)):
        state = sum(t.numel() * t.element_size() for t in stage.module.parameters())
        state += sum(t.numel() * t.element_size() for t in stage.module.buffers())
        # each storage once (views are free): the estimate of what a step holds, where the planner's
        # budget (passes/plan/chain.py) sums every output, since a backward allocates the views' gradients too
        act = sum(node_cost(n).held_bytes for n in nodes) * scale
        inputs = sum(b.nbytes for b in prog.boundaries if b.dst == stage.index) * scale
        out.append(memory.stage_bytes(float(state), float(act), float(inputs), in_flight[stage.index],
                                      units[stage.index]))
    return out


def cpu_ranks(prog: SplitProgram, schedule: Schedule) -> set[int]:
    """The ranks holding CPU stages: as threads of one process (the local executor) they share
    this host's cores."""
    return {schedule.stage_to_rank[s.index] for s in prog.stages if s.device.type == "cpu"}


SharingGroups = list[tuple[set[int], Callable[[int], float]]]


def device_share(nodes: Sequence[Any], rates: Any, scale: float) -> float:
    """The share of a stage's time its device computes, 0..1, at ``rates`` for a microbatch ``scale``
    times the example: per op, the device's work over the longer of the host's launch and that work
    (:meth:`~pipesplit.passes.annotate.rates.DeviceRates.forward`). A GPU stage of small kernels
    is mostly launches (a low share), one of large multiplies mostly work (near 1)."""
    work_only = dataclasses.replace(rates, forward_op_s=0.0, backward_op_s=0.0)
    work = total = 0.0
    for n in nodes:
        for w, host in zip(priced(n, work_only), (rates.forward_op_s, rates.backward_op_s, 0.0)):
            if w > 0:
                work += w * scale
                total += max(host, w * scale)
    return work / total if total > 0 else 1.0


def sharing_groups(prog: SplitProgram, schedule: Schedule, scale: float = 1.0) -> SharingGroups:
    """The ranks that share one resource in the local executor, with how much each slows while
    ``n`` of them compute: the CPU ranks share the host's cores
    (:func:`~pipesplit.passes.annotate.rates.concurrent_slowdown`), the ranks of each GPU that
    holds two or more share that GPU. There the device is busy only for the stages' device share
    ``u`` (:func:`device_share`; the rest is the host launching), so ``n`` of them slow each other
    only once ``n * u`` passes 1: ``max(1, gpu_slowdown(n) * u)``, with
    :func:`~pipesplit.passes.annotate.gpu_rates.gpu_slowdown` measured on that GPU for work that
    fills it (4 stages of a GPT 12x768 on one H100 ran each action ~1.4x its time alone, 2 stages
    ~1.0x, where large multiplies alone slowed 3.7x and 1.9x). A group of one is left out."""
    by_device: dict[torch.device, set[int]] = {}
    for s in prog.stages:
        by_device.setdefault(s.device, set()).add(schedule.stage_to_rank[s.index])
    groups: SharingGroups = []
    cpu = cpu_ranks(prog, schedule)
    if len(cpu) > 1:
        groups.append((cpu, concurrent_slowdown))
    per_stage = None
    for dev, ranks in sorted(by_device.items(), key=lambda kv: str(kv[0])):
        if dev.type == "cuda" and len(ranks) > 1:
            per_stage = per_stage or _stage_nodes(prog)
            rates = device_rates(dev, largest_matmul([n for nodes in per_stage for n in nodes]))
            shares = [device_share(per_stage[s.index], rates, scale) for s in prog.stages if s.device == dev]
            u = sum(shares) / len(shares)
            groups.append((ranks, functools.partial(_shared_gpu, str(dev), u)))
    return groups


def _shared_gpu(device: str, share: float, n: int) -> float:
    return max(1.0, gpu_slowdown(device, n) * share)


_WEIGHT_OPS: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


def weight_ops(module: torch.nn.Module) -> int:
    """How many ops of a stage's graph consume weights: the W action's units of fixed cost."""
    if module not in _WEIGHT_OPS:
        graph = weight_graph(module)  # type: ignore[arg-type]
        _WEIGHT_OPS[module] = len(graph.groups) if graph is not None else 0
    return _WEIGHT_OPS[module]


def split_backward(prog: SplitProgram, schedule: Schedule, costs: list[StageCost]) -> list[StageCost]:
    """Stage times with the W of every stage the schedule splits (I, then W) charged the split's
    fixed cost per weight op (:func:`~pipesplit.runtime.engine.weight_grads.split_overhead_s`)."""
    split = {a.stage for actions in schedule.actions for a in actions if a.kind is ActionKind.BACKWARD_WEIGHT}
    out = []
    for c, s in zip(costs, prog.stages):
        extra = weight_ops(s.module) * split_overhead_s(s.device) if s.index in split else 0.0
        out.append(dataclasses.replace(c, backward_weight=c.backward_weight + extra))
    return out


def predict(
    prog: SplitProgram, schedule: Schedule, cost: Any, batch: int, *, comm: CommModel | None = None,
    memory: MemoryModel | None = None, local: bool = True,
) -> Prediction:
    """The cost model's prediction for running ``prog`` under ``schedule`` on batches of ``batch``.

    ``costs`` are each stage's seconds alone. ``local``: the ranks are threads of this process
    (the local executor), so the ranks holding CPU stages share this host's cores: while ``n``
    of them compute, each runs :func:`~pipesplit.passes.annotate.rates.concurrent_slowdown`
    ``(n)`` times slower (:func:`~pipesplit.schedules.shared.simulate_shared`); the timeline's
    :meth:`~pipesplit.schedules.Timeline.stage_costs` are the stage times as they ran so."""
    m = schedule.num_microbatches
    example = prog.example_batch or batch
    scale = (batch / m) / example
    costs = split_backward(prog, schedule, stage_seconds(prog, cost, scale))
    groups = sharing_groups(prog, schedule, scale) if local else []
    comm_s, timeline = step_timeline(prog, schedule, costs, batch, comm or CommModel(), groups=groups)
    mem = memory_estimate(prog, schedule, scale, memory or MemoryModel(optimizer_factor=0.0))
    return Prediction(costs, comm_s, timeline, mem)


def step_timeline(prog: SplitProgram, schedule: Schedule, costs: Sequence[StageCost], batch: int,
                  comm: CommModel, *, groups: SharingGroups | None = None) -> tuple[list[float], Timeline]:
    """``schedule``'s step over ``prog``'s stages at ``costs`` (predicted or measured, alone), with
    the seconds each cut takes to carry a microbatch of a ``batch``: (those seconds, the timeline).
    The ranks of each of ``groups`` share one resource (:func:`sharing_groups`, :func:`predict`)."""
    comm_s = cut_seconds(prog, batch, schedule.num_microbatches, comm)
    if groups:
        timeline = simulate_shared(schedule, list(costs), comm_s if comm_s else 0.0, groups=groups)
    else:
        timeline = simulate(schedule, list(costs), comm_cost=comm_s if comm_s else 0.0)
    return comm_s, dataclasses.replace(timeline, unit="s")
