"""``pipesplit.compile``: capture, annotate costs, plan, split — one readable sequence."""

from __future__ import annotations

import functools
import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipesplit.agree import agree_on_plan
from pipesplit.bench.refine import refine_plan
from pipesplit.capture import as_args, capture
from pipesplit.checks import known_keywords, name_list
from pipesplit.dims import parse_dynamic_dims
from pipesplit.errors import PlanError
from pipesplit.devices import device_name, machine_devices
from pipesplit.export import paused_gc
from pipesplit.passes.split.generalise import recapture_fn
from pipesplit.passes.annotate.costs import annotate_costs
from pipesplit.passes.annotate.calibrate import calibrate
from pipesplit.passes.plan.advice import plan_warnings
from pipesplit.passes.plan.checkpointing import Checkpoint
from pipesplit.passes.plan.pricing import device_memory_cap, memory_warnings, price_given
from pipesplit.passes.plan.chain import compute_nodes
from pipesplit.passes.plan.lengths import length_mix, parse_plan_lengths
from pipesplit.passes.plan.objective import CommModel, MemoryModel
from pipesplit.passes.plan.planner import (
    CostSpec,
    check_plan,
    cheap_to_recompute,
    cost_function,
    evaluate,
    plan_from_split_points,
    plan_partition,
)
from pipesplit.passes.plan.recompute import recomputable
from pipesplit.passes.annotate.profile import profile_nodes
from pipesplit.passes.split import check_devices, split_graph
from pipesplit.options import Order, PlannerOptions, Recompute, planner_options, refuse_mixing
from pipesplit.plan import Plan
from pipesplit.passes.split.program import SplitProgram
from pipesplit.schedules import Schedule, resolve_schedule
from pipesplit.deprecation import num_keywords
from pipesplit.units import human_seconds

log = logging.getLogger(__name__)


@contextmanager
def _timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
    log.info("pipesplit: %s took %s", name, human_seconds(timings[name]))  # progress (the CLI shows it)


def _default_device(model: nn.Module) -> str:
    """The model's device; a model on "meta" (no storage yet) runs on the CPU unless devices= says otherwise."""
    for t in list(model.parameters()) + list(model.buffers()):
        return "cpu" if t.is_meta else str(t.device)
    return "cpu"


def check_devices_exist(devices: Any, num_stages: int | None) -> None:
    """Every device parses and exists on this machine (before the slow export, not at placement)."""
    if devices is None:
        return
    n = num_stages if num_stages is not None else "n"
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, (list, tuple)):
        raise PlanError(f"devices takes one device per stage, got the single device {str(devices)!r}; "
                        f"pass a list, e.g. devices=[{str(devices)!r}] * {n}.")
    for s, d in enumerate(devices):
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError):  # torch's message lists every device type it knows, not what is here
            raise PlanError(f"devices[{s}]={d!r} is not a device; this machine has "
                            f"{', '.join(map(repr, machine_devices()))}.") from None
        if dev.type == "meta":
            raise PlanError(f"devices[{s}]='meta' holds no data, so a stage there computes nothing (its outputs are "
                            f"meta tensors); give each stage a real device, e.g. devices=['cpu'] * {n}. A model built "
                            "on meta is compiled as is and runs on the CPU, or on the devices given.")
        module = getattr(torch, dev.type, None)
        if dev.type == "cpu" or module is None or not hasattr(module, "device_count"):
            continue
        count = module.device_count()
        if (dev.index or 0) >= count:
            have = ["cpu"] + [f"{dev.type}:{i}" for i in range(count)]
            raise PlanError(
                f"devices[{s}]={str(dev)!r} is not available: this machine has {count} {dev.type} device(s) "
                f"(available: {', '.join(have)}). Use one of those, e.g. devices=['cpu'] * {n}."
            )


def _gc_paused(fn: Callable[..., SplitProgram]) -> Callable[..., SplitProgram]:
    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> SplitProgram:
        with paused_gc():
            return fn(*args, **kwargs)

    return paused


def _one_way(fn: Callable[..., SplitProgram]) -> Callable[..., SplitProgram]:
    """A planner keyword passed beside ``planner=`` is refused even at its default value (which
    ``compile`` itself cannot tell from one left out): one of the two would be ignored."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> SplitProgram:
        if kwargs.get("planner") is not None:
            refuse_mixing(kwargs)
        return fn(*args, **kwargs)

    return checked


@num_keywords  # outermost: an old n_* keyword is renamed before the checks below see it
@known_keywords
@_one_way
@_gc_paused
def compile(
    model: nn.Module,
    example_input: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    planner: PlannerOptions | None = None,
    num_stages: int | None = None,
    cost: CostSpec = "flops",
    devices: Sequence[str | torch.device] | None = None,
    split_points: Sequence[str] | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    max_stage_memory: int | None = None,
    slack: float = 0.05,
    schedule: str | Schedule | None = None,
    num_microbatches: int | None = None,
    num_ranks: int | None = None,
    pins: Mapping[str, int] | None = None,
    no_split: Sequence[str] = (),
    comm: CommModel | None = None,
    memory: MemoryModel | None = None,
    recompute: Recompute = "auto",
    order: Order = "auto",
    refine: int = 0,
    checkpoint: Checkpoint = None,
    batch_dim: int = 0,
    unbatched: Sequence[str] = (),
    dynamic_batch: bool = False,
    dynamic_dims: Mapping[str, Any] | bool | None = None,
    progress: bool | None = None,
    plan_lengths: Mapping[int, float] | Sequence[int] | None = None,
) -> SplitProgram:
    """Split ``model`` into pipeline stages that compute exactly what it computes.

    Args:
        model: any ``nn.Module`` that ``torch.export`` can capture. It is never modified;
            the program holds its own copy of the parameters and buffers.
        example_input: a tensor or a tuple of positional arguments.
        example_kwargs: keyword arguments of the example call.
        planner: the planner's options (``num_stages`` to ``refine`` below) as one
            :class:`~pipesplit.PlannerOptions`; give either it or those keywords, not both.
        num_stages: stages to cut into (default 1, or as many as ``split_points``/``plan`` give).
        cost: ``"flops"`` (default), ``"params"``, ``"profile"``, ``"hybrid"``, ``"uniform"``, a
            callable ``node -> float`` or an object with ``node_cost(node, costs)``. ``"profile"``
            times every node on its device; ``"hybrid"`` prices FLOPs and bytes at rates
            fitted to a profile of the model (:mod:`pipesplit.passes.annotate.calibrate`). With ``"flops"``
            the stages are balanced by FLOP counts, and times (``schedule``-aware planning,
            predictions, benchmarks) price each op at the device's measured rates: per-op
            overhead + FLOPs / FLOP rate + bytes / bandwidth (:mod:`pipesplit.passes.annotate.rates`).
            Measured costs differ between processes, so under an initialised
            ``torch.distributed`` world every rank takes global rank 0's plan
            (:mod:`pipesplit.agree`): each rank must compile the same model alike.
        devices: one device per stage (stages may share one); default the model's device.
        split_points: module paths (``"layers.4"``; one may be given as a bare string) where new
            stages start; bypasses the planner.
        plan: a :class:`Plan` or the path of a saved one, reused instead of planning; the model is
            captured as the plan's was (``plan.capture``: ``"static"`` or ``"dynamic"``).
        max_stage_memory: bytes a stage may hold (parameters, gradients, activations; with
            ``schedule``, optimizer state and every microbatch in flight too). On CUDA with a
            ``schedule`` it defaults to the device's memory less 10%; a plan (or a given split)
            predicted over the cap warns, naming the stage, its bytes and the fix.
        slack: fraction above the optimal bottleneck the planner may spend to send fewer bytes
            (without ``schedule``; with one, the simulated step time decides); twice that for
            cuts between the model's repeated blocks, when they price faster (docs/planner.md).
        schedule: plan for this schedule's step time (``"1f1b"``, ``"zb_h1"``, ...): stage
            forward, input- and weight-gradient times plus communication, simulated.
        num_microbatches: microbatches per step for ``schedule`` (default: 4 x stages); the
            example input is taken to be one microbatch.
        num_ranks: ranks for multi-stage-per-rank schedules (interleaved, V-shaped).
        pins: ``{"module.path": stage}`` keeps that module whole in that stage.
        no_split: module paths (wildcards allowed, ``"blocks.*"``) that no cut may enter. A
            container never called itself (an ``nn.ModuleList`` ``"blocks"``) means each of its
            children, as ``"blocks.*"``: cuts between the blocks stay allowed.
        comm: link latency and bandwidth for pricing boundaries (defaults per device kind).
        memory: optimizer/gradient factors and checkpointing for the memory estimate
            (``MemoryModel(checkpoint=True)`` is ``checkpoint=True``).
        checkpoint: activation checkpointing, per stage: a checkpointed stage holds its inputs
            per microbatch in flight plus one microbatch's activations, and its backward pays
            a second forward. ``"auto"`` (with ``schedule``) chooses the stages with the cuts,
            for the lowest simulated step under ``max_stage_memory``; True every stage, False
            none, a list of stage indices, or ``{stage: n}``: those stages recompute only their
            first ``n`` blocks (``"auto"`` may choose that too). ``prog.plan.checkpoint`` lists the
            stages recomputed whole, ``prog.plan.checkpoint_summary`` what each stage recomputes,
            and ``Pipeline`` checkpoints exactly that.
        recompute: ``"auto"`` rebuilds cheap input-derived values (masks, rotary tables) in
            each stage that needs them instead of sending them; ``"never"`` sends everything.
        order: ``"auto"`` also solves the order that computes each node as late as its
            consumers allow (a branch computed early but used late need not cross every
            cut) and keeps the better plan (``plan.order`` says which); ``"program"``
            solves the program's own order only.
        refine: with ``cost="profile"`` or ``"hybrid"``, time the planned stages (forward +
            backward of the example on their devices), scale their nodes' profiled times to
            what the stages measured, and plan again; ``refine`` rounds, keeping the plan
            that measured best (``plan.measured_s``: its measured bottleneck, or with a
            ``schedule`` the step simulated from the measured stages).
        batch_dim: the inputs' batch dimension, cut into microbatches by :class:`pipesplit.Pipeline`.
        dynamic_batch: capture the batch dimension dynamic from the start. By default the model
            is exported at the example's shapes (a static export is 1.5-2.6x faster), and the
            program captures it once more with a dynamic batch the first time it meets another
            batch size (:mod:`pipesplit.passes.split.generalise`); until then it keeps a reference to ``model``.
        unbatched: names of forward() arguments without a batch dimension (a lookup table, a
            shared mask): kept at their example shape and given whole to every microbatch.
        dynamic_dims: other dimensions to capture dynamic from the start, with the batch: per
            forward() argument a dimension, a list, or ``{dim: (low, high)}`` (``{"input_ids": 1}``,
            ``{"input_ids": {1: (1, 4096)}}``), or ``True`` for every dimension of every batched
            input. A declared dimension the model fixes (a reshape to a constant) or caps below
            ``high`` (a position table) is refused, naming it and the model's limit. Without it,
            the first call whose length differs captures the model once more with every dimension
            dynamic (:mod:`pipesplit.passes.split.generalise`); the program keeps ``model`` until then.
        plan_lengths: with ``schedule`` and a length in ``dynamic_dims``, the lengths to plan for: a list, or
            ``{length: weight}`` (``{128: 0.7, 1024: 0.3}``); the split with the lowest expected simulated step
            over them (``prog.plan.length_steps_s``: the step at each; :mod:`pipesplit.passes.plan.lengths`).
        progress: a progress bar while profiling (``cost="profile"``/``"hybrid"``, ``refine``): True
            always, False never, None (default) only when stderr is a terminal.

    >>> import torch, pipesplit
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> prog = pipesplit.compile(model, torch.randn(2, 8), num_stages=2)
    >>> x = torch.randn(5, 8)
    >>> torch.allclose(prog(x), model(x))
    True
    """
    opts = planner_options(  # checks every option before the (slow) export
        planner, num_stages=num_stages, cost=cost, max_stage_memory=max_stage_memory, slack=slack, schedule=schedule,
        num_microbatches=num_microbatches, num_ranks=num_ranks, pins=pins, no_split=no_split, comm=comm, memory=memory,
        recompute=recompute, order=order, refine=refine, checkpoint=checkpoint, plan_lengths=plan_lengths)
    num_stages, cost, max_stage_memory, slack, schedule = (
        opts.num_stages, opts.cost, opts.max_stage_memory, opts.slack, opts.schedule)
    num_microbatches, num_ranks, pins, no_split, comm, memory = (
        opts.num_microbatches, opts.num_ranks, opts.pins, opts.no_split, opts.comm, opts.memory)
    recompute, order, refine, checkpoint = opts.recompute, opts.order, opts.refine, opts.checkpoint
    check_devices_exist(devices, num_stages)
    split_points = None if split_points is None else name_list("split_points", split_points, error=PlanError)
    unbatched = name_list("unbatched", unbatched)
    devices = None if devices is None else [device_name(d) for d in devices]  # "cuda" is the current GPU from here on
    if refine and (plan is not None or split_points is not None):
        raise PlanError("refine= re-plans from measured stage times; it cannot change a given plan= or split_points=.")
    if plan is not None or split_points is not None:
        _refuse_planner_options(  # schedule=, max_stage_memory=, memory=, checkpoint=... price the split instead
            "plan=" if plan is not None else "split_points=",
            pins=(pins, None), no_split=(tuple(no_split), ()), slack=(slack, 0.05), order=(order, "auto"),
            plan_lengths=(opts.plan_lengths, None),
        )
    timings: dict[str, float] = {}
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if plan is not None and plan.capture == "dynamic":
        dynamic_batch = True  # its node names are those of a capture with a dynamic batch
    if plan is not None and plan.capture == "every_dim" and dynamic_dims is None:
        dynamic_dims = True  # its node names are those of a capture with every dimension dynamic
    dims = None if dynamic_dims is None or dynamic_dims is False else parse_dynamic_dims(dynamic_dims, batch_dim, unbatched)
    dynamic_batch = dynamic_batch or dims is not None
    if opts.plan_lengths is not None and dims is None:
        raise PlanError(f"plan_lengths={opts.plan_lengths} prices the split at lengths of a dynamic dimension: declare "
                        "which one, e.g. compile(..., dynamic_dims={'input_ids': 1}, plan_lengths=...).")
    with _timed("capture", timings):
        captured = capture(model, example_input, example_kwargs, batch_dim=batch_dim, unbatched=unbatched,
                           dynamic=dynamic_batch, dims=dims)
    device0 = str(devices[0]) if devices else _default_device(model)
    with _timed("annotate", timings):
        requires = [isinstance(x, torch.Tensor) and x.requires_grad for x in captured.example_flat]
        gm = annotate_costs(captured.gm, requires)
        if cost == "profile":
            profile_nodes(gm, captured.example_flat, device0, mutated_targets=captured.mutated_targets, progress=progress)
        elif cost == "hybrid":
            calibrate(gm, captured.example_flat, device0, mutated_targets=captured.mutated_targets, progress=progress)
    with _timed("plan", timings):
        if plan is not None or split_points is not None:
            chosen = _choose_plan(gm, captured.module_paths, num_stages, cost, split_points, plan)
            if split_points is not None:  # the planner's choices that a manual split still wants
                if recompute == "auto":
                    kind = torch.device(device0).type
                    chosen.recompute = sorted(cheap_to_recompute(gm, captured.mutated_targets, comm or CommModel(), kind))
            sched = None if schedule is None else resolve_schedule(
                schedule, chosen.num_stages, num_ranks, num_microbatches or 4 * chosen.num_stages)
            price_given(gm, chosen, sched, cost=cost, comm=comm or CommModel(), memory=memory or MemoryModel(),
                        max_stage_memory=max_stage_memory, checkpoint=checkpoint, device_kind=torch.device(device0).type,
                        keep_saved=plan is not None)
        else:
            k = 1 if num_stages is None else num_stages
            sched = None
            if schedule is not None:
                sched = resolve_schedule(schedule, k, num_ranks, num_microbatches or 4 * k)
            # on CUDA a schedule's plan fits the device's memory less a margin unless a cap is given
            cap = max_stage_memory if max_stage_memory is not None or sched is None else device_memory_cap(
                list(devices) if devices is not None else [device0])

            mix = None if opts.plan_lengths is None else length_mix(
                gm, captured.inputs, batch_dim, parse_plan_lengths(opts.plan_lengths) or {})

            def replan(cap: int | None = cap) -> Plan:
                try:
                    return plan_partition(
                        gm, k, cost, max_stage_memory=cap, slack=slack, module_paths=captured.module_paths,
                        pins=pins, no_split=no_split, schedule=sched, comm=comm or CommModel(),
                        memory=memory or MemoryModel(), recompute=recompute, mutated_targets=captured.mutated_targets,
                        device_kind=torch.device(device0).type, order=order, checkpoint=checkpoint,
                        lengths=mix,
                    )
                except PlanError:
                    if cap is None or max_stage_memory is not None:
                        raise
                    unfit = replan(None)  # nothing fits the device: plan without, and warn stage by stage below
                    unfit.max_stage_memory = cap
                    return unfit

            chosen = replan()
            if refine:
                devs = check_devices(list(devices) if devices is not None else [device0] * k, k)
                args = as_args(example_input)
                chosen = refine_plan(
                    gm, captured, chosen, replan, devs, args, example_kwargs or {}, rounds=refine, schedule=sched,
                    comm=comm or CommModel(), progress=progress,
                )
            chosen = agree_on_plan(gm, chosen)  # measured costs differ between processes: all take rank 0's
    chosen.capture = "every_dim" if captured.every_dim else "dynamic" if dynamic_batch else "static"
    k = chosen.num_stages
    devs = check_devices(list(devices) if devices is not None else [device0] * k, k)
    with _timed("split", timings):
        split = split_graph(gm, chosen.stages, devs, recompute=chosen.recompute)
        program = SplitProgram(captured, split, chosen, devs)
        if not captured.every_dim:  # a batch or a length that changes captures it again (generalise)
            program.recapture = recapture_fn(model, example_input, example_kwargs, batch_dim, unbatched, dims)
    timings["export"] = captured.export_seconds
    program.timings = timings
    fn = cost_function(cost)[1]
    for warning in plan_warnings(gm, chosen, {n.name: fn(n) for n in compute_nodes(gm)}) + memory_warnings(chosen):
        program.notes.append(warning)
        log.warning("pipesplit: %s", warning, extra={"pipesplit_note": True})  # the CLI prints prog.notes
    return program


def _choose_plan(
    gm: Any,
    module_paths: set[str],
    num_stages: int | None,
    cost: CostSpec,
    split_points: Sequence[str] | None,
    plan: Plan | str | os.PathLike[str] | None,
) -> Plan:
    """A plan the user gave: a saved or edited one, or manual split points."""
    if plan is not None and split_points is not None:
        raise PlanError("pass either plan= or split_points=, not both.")
    if plan is not None:
        given = plan if isinstance(plan, Plan) else Plan.load(plan)
        check_plan(gm, given)
        _check_count(num_stages, given.num_stages, "the plan has")
        name, fn = cost_function(cost)
        checked = evaluate(gm, given.stages, name, fn, "loaded")
        checked.recompute = [r for r in given.recompute if r in recomputable(gm)]
        checked.checkpoint = given.checkpoint
        checked.checkpoint_partial, checked.checkpoint_labels = given.checkpoint_partial, given.checkpoint_labels
        return checked
    assert split_points is not None
    chosen = plan_from_split_points(gm, list(split_points), module_paths, cost)
    _check_count(num_stages, chosen.num_stages, f"{len(split_points)} split points make")
    return chosen


def _refuse_planner_options(given: str, **options: tuple[Any, Any]) -> None:
    """Options only the planner reads must not be passed beside a fixed split, where they would do nothing."""
    passed = [name for name, (value, default) in options.items() if value != default]
    if passed:
        raise PlanError(
            f"{', '.join(f'{n}=' for n in passed)} only steer the planner, and {given} fixes the split without it, "
            f"so they would be ignored. Drop them, or drop {given} and let the planner split under them."
        )


def _check_count(requested: int | None, actual: int, what: str) -> None:
    if requested is not None and requested != actual:
        raise PlanError(f"num_stages={requested} but {what} {actual} stages; drop num_stages or make them agree.")
