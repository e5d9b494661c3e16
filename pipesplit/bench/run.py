"""``pipesplit.benchmark``: compile, predict and measure a sweep of pipeline configurations."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import itertools
import logging
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pipesplit.api import check_devices_exist, compile as compile_model
from pipesplit.checks import keywords_of
from pipesplit.bench.lengths import at_length, program_mix, stage_costs_at
from pipesplit.bench.load import load_summary, machine_load
from pipesplit.bench.predict import Prediction, boundary_bytes_per_step, predict
from pipesplit.bench.result import BenchmarkResult, BenchRow, RunDetail, ms_text
from pipesplit.capture import as_args
from pipesplit.compat import pytree
from pipesplit.devices import device_name
from pipesplit.errors import InputError, PipesplitError, ScheduleError
from pipesplit.passes.plan.lengths import LengthMix
from pipesplit.passes.plan.planner import BUILTIN_COSTS, cost_function
from pipesplit.passes.split.program import SplitProgram
from pipesplit.runtime.engine.microbatch import batch_size
from pipesplit.runtime.engine.pipeline import Pipeline
from pipesplit.runtime.engine.trace import Trace
from pipesplit.schedules import schedule_info
from pipesplit.deprecation import num_keywords

log = logging.getLogger(__name__)


def mean_output_loss(out: Any, target: Any = None) -> torch.Tensor:
    """The loss used when none is given: the sum of the means of every floating-point output."""
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise PipesplitError("the model returns no floating-point tensor to train on; pass loss_fn=.")
    return sum(x.float().mean() for x in leaves)  # type: ignore[return-value]


def _as_list(value: Any, what: str) -> list[Any]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise PipesplitError(f"benchmark: {what} is empty; give at least one value.")
    return items


def _devices_for(devices: Sequence[str | torch.device] | None, k: int) -> list[str] | None:
    """Stage s runs on devices[s % len(devices)] (None: the model's device)."""
    if devices is None:
        return None
    check_devices_exist(devices, k)
    devs = [device_name(d) for d in devices]
    if not devs:
        raise PipesplitError("benchmark: devices is empty; pass None for the model's device or a list of devices.")
    return [devs[s % len(devs)] for s in range(k)]


def _example_batch(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> int | None:
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.dim() > batch_dim:
            return int(x.shape[batch_dim])
    return None


def _check(schedules: list[Any], costs: list[Any], stages: list[Any], micro: list[Any], batch: int | None,
           warmup: int, repeats: int) -> None:
    """Fail on bad names and sizes before any (slow) compile."""
    for name in schedules:
        if not isinstance(name, str):
            raise ScheduleError(f"benchmark: schedules are names such as '1f1b', got {type(name).__name__}.")
        schedule_info(name)  # unknown names raise with the known ones listed
    for c in costs:
        cost_function(c)
    for what, values in (("num_stages", stages), ("num_microbatches", micro)):
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise PipesplitError(f"benchmark: {what} must be integers >= 1, got {bad}.")
    if batch is not None:
        uneven = [m for m in micro if batch % m]
        if uneven:
            raise InputError(
                f"benchmark: a batch of {batch} does not split into {uneven} equal microbatches; use "
                f"num_microbatches among {[d for d in range(1, batch + 1) if batch % d == 0]} or another batch."
            )
    if repeats < 1 or warmup < 0:
        raise PipesplitError(f"benchmark: need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")


def _measure(pipe: Pipeline, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
             warmup: int, repeats: int) -> tuple[list[float], Trace, list[float] | None]:
    """Step times of ``repeats`` traced steps after ``warmup`` untraced ones, and CUDA peaks per stage."""
    cuda = sorted({s.device for s in pipe.prog.stages if s.device.type == "cuda"}, key=str)
    for _ in range(warmup):
        pipe.step(*args, target=target, **kwargs)
        pipe.zero_grad()
    for d in cuda:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    times = []
    with pipe.trace() as tr:
        for _ in range(repeats):
            start = time.perf_counter()
            pipe.step(*args, target=target, **kwargs)
            times.append(time.perf_counter() - start)
            pipe.zero_grad()
    peaks = None
    if cuda:
        peaks = [float(torch.cuda.max_memory_allocated(s.device)) if s.device.type == "cuda" else 0.0
                 for s in pipe.prog.stages]
    return times, tr, peaks


def _balance(stage_s: Sequence[float]) -> tuple[int, float]:
    top = max(range(len(stage_s)), key=stage_s.__getitem__)
    mean = sum(stage_s) / len(stage_s)
    return top, (stage_s[top] / mean if mean > 0 else 1.0)


def _row(prog: SplitProgram, pipe: Pipeline, cost_name: str, batch: int, pred: Prediction,
         times: list[float], tr: Trace, peaks: list[float] | None) -> tuple[BenchRow, int]:
    k, sched = prog.num_stages, pipe.schedule
    measured = tr.stage_costs()
    fwd, bwd = [c.forward for c in measured], [c.backward for c in measured]
    ran = pred.timeline.stage_costs()  # as the simulated step ran them, ranks sharing cores
    pf = [c.forward for c in ran]
    pb = [c.backward for c in ran]
    top, balance = _balance([f + b for f, b in zip(fwd, bwd)])
    ptop, pbalance = _balance([f + b for f, b in zip(pf, pb)])
    step = statistics.median(times)
    median_step = min(range(len(times)), key=lambda i: abs(times[i] - step))
    predicted_step = pred.timeline.step_time
    row = BenchRow(
        num_stages=k, schedule=sched.name, num_microbatches=sched.num_microbatches, cost=cost_name,
        num_ranks=sched.num_ranks, devices=",".join(sorted({str(s.device) for s in prog.stages})), batch=batch,
        predicted_fwd_s=tuple(pf), predicted_bwd_s=tuple(pb), measured_fwd_s=tuple(fwd), measured_bwd_s=tuple(bwd),
        bottleneck_stage=top, predicted_bottleneck_stage=ptop, balance=balance, predicted_balance=pbalance,
        boundary_bytes=boundary_bytes_per_step(prog, batch, sched.num_microbatches),
        predicted_step_s=predicted_step, measured_step_s=step,
        measured_step_spread_s=(max(times) - min(times)) / 2,
        step_ratio=step / predicted_step if predicted_step > 0 else float("inf"),
        predicted_bubble=pred.timeline.bubble_fraction, measured_bubble=tr.timeline(median_step).bubble_fraction,
        peak_memory_bytes=tuple(peaks if peaks is not None else pred.memory),
        memory_source="measured" if peaks is not None else "estimated",
        throughput=batch / step if step > 0 else float("inf"), repeats=len(times),
    )
    return row, median_step


def _at_lengths(row: BenchRow, prog: SplitProgram, pipe: Pipeline, mix: LengthMix, cost: Any, batch: int,
                data: tuple[Any, Any, Any], warmup: int, repeats: int) -> BenchRow:
    """``row`` with the step predicted and measured at each of ``mix``'s lengths (the example cut or repeated)."""
    predicted, measured = [], []
    for length in mix.weights:
        args, kwargs, target = at_length(data, mix, length)
        times, _, _ = _measure(pipe, args, kwargs, target, warmup, repeats)
        with stage_costs_at(prog, mix, length):
            predicted.append(predict(prog, pipe.schedule, cost, batch).timeline.step_time)
        measured.append(statistics.median(times))
    return dataclasses.replace(row, lengths=tuple(mix.weights), length_weights=tuple(mix.weights.values()),
                               predicted_length_s=tuple(predicted), measured_length_s=tuple(measured))


def _keywords() -> list[str]:
    """What ``benchmark`` takes by name: its own keywords and, passed on, ``compile``'s."""
    own = [p.name for p in inspect.signature(benchmark).parameters.values() if p.kind is not p.VAR_KEYWORD]
    return own + [p.name for p in inspect.signature(compile_model).parameters.values()]


@num_keywords
@keywords_of("benchmark", [], extra=_keywords)
def benchmark(
    model: nn.Module | SplitProgram,
    example_input: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    num_stages: int | Sequence[int] | None = None,
    schedules: str | Sequence[str] = "1f1b",
    num_microbatches: int | Sequence[int] = 4,
    cost: Any = None,
    devices: Sequence[str | torch.device] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    progress: bool | None = None,
    **compile_options: Any,
) -> BenchmarkResult:
    """Compile, predict and time every combination of the given options; one row each.

    Args:
        model: an ``nn.Module`` (compiled once per stage count and cost), or a compiled
            :class:`SplitProgram` (then ``num_stages`` and ``cost`` come from it).
        example_input, example_kwargs: one full training batch; every step trains on it.
        loss_fn, target: the loss ``loss_fn(output, target)``; default: the mean of every
            floating-point output (target ignored).
        num_stages, schedules, num_microbatches, cost: a value or a list of values each
            (defaults 2, ``"1f1b"``, 4, ``"flops"``); the sweep is their product.
            Configurations a schedule cannot run (e.g. ``zb_v`` with an odd stage
            count) are skipped and listed in ``res.skipped``.
        devices: stage ``s`` runs on ``devices[s % len(devices)]``; default the model's.
        warmup, repeats: untimed then timed (and traced) steps per configuration; step
            times are medians, with the spread of the repeats.
        progress: a progress bar over the configurations: True always, False never, None
            (default) only when stderr is a terminal.
        compile_options: passed on to :func:`pipesplit.compile` (e.g. ``slack``). With ``plan_lengths``
            (and ``dynamic_dims``) the split is planned for the expected step over those lengths (under
            ``schedule=``, default the sweep's first schedule and microbatch count), and each row also
            predicts and measures every length (the example's tensors of the example's length cut to it, or
            repeated along it and cut): ``row.predicted_length_s``, ``row.measured_length_s`` and their
            weighted means ``row.expected_predicted_s``, ``row.expected_measured_s``.

    Each stage count and cost gets one split (the balanced plan ``pipesplit.compile``
    makes), which then runs under every schedule and microbatch count; it is captured with a
    dynamic batch (``dynamic_batch=True`` unless given), so that running microbatches of any
    size captures nothing more.
    Predicted times come from the cost model the split was planned with, scaled from
    the example batch to one microbatch; measured times come from the pipelined steps
    (each stage's compute, waits excluded). Memory is the CUDA allocator's peak per
    stage device, or on CPU the cost model's estimate (parameters, gradients,
    activations of the microbatches in flight).

    >>> import torch, pipesplit
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    >>> res = pipesplit.benchmark(model, torch.randn(8, 16), num_stages=2, schedules=["gpipe", "1f1b"],
    ...                           num_microbatches=4, warmup=1, repeats=2, progress=False)
    >>> [(r.schedule, r.num_stages) for r in res.rows]
    [('gpipe', 2), ('1f1b', 2)]
    """
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    args = as_args(example_input)
    kwargs = dict(example_kwargs or {})
    given = model if isinstance(model, SplitProgram) else None  # a compiled program: run as it is
    is_prog = given is not None
    if given is not None and (num_stages is not None or cost is not None):
        raise PipesplitError(
            f"benchmark: a compiled program fixes num_stages ({given.num_stages}) and cost ({given.plan.cost_name!r}); "
            "drop num_stages=/cost=, or pass the nn.Module to sweep them."
        )
    stage_counts = ([given.num_stages] if given is not None
                    else _as_list(2 if num_stages is None else num_stages, "num_stages"))
    costs = [given.plan.cost_name] if given is not None else _as_list("flops" if cost is None else cost, "cost")
    scheds = _as_list(schedules, "schedules")
    micro = _as_list(num_microbatches, "num_microbatches")
    dim = given.batch_dim if given is not None else int(compile_options.get("batch_dim", 0))
    _check(scheds, [] if is_prog else costs, stage_counts, micro, _example_batch(args, kwargs, dim), warmup, repeats)
    configs = list(itertools.product(stage_counts, costs, scheds, micro))
    if given is None and compile_options.get("plan_lengths") is not None and "schedule" not in compile_options:
        # the expected step over the lengths is a schedule's: plan for the sweep's first
        compile_options = {**compile_options, "schedule": scheds[0], "num_microbatches": micro[0]}
    if given is None and "dynamic_batch" not in compile_options and any(m > 1 for m in micro):
        # the steps run microbatches, not the example's batch: capture the batch dynamic once, not the
        # example's shapes first and then once more at the microbatch size, for every stage count
        compile_options = {**compile_options, "dynamic_batch": True}
    rows, details, skipped = [], [], []
    load_before = machine_load()
    bar = tqdm(total=len(configs), desc="pipesplit benchmark", unit="config",
               disable=None if progress is None else not progress, leave=False)
    # log lines printed while the bar is drawn go through tqdm.write, above it, not into it
    redirect = contextlib.ExitStack()
    if not bar.disable:
        redirect.enter_context(logging_redirect_tqdm())
    try:
        for (k, c), group in itertools.groupby(configs, key=lambda x: x[:2]):
            cost_name = cost_function(c)[0] if not is_prog else str(c)
            bar.set_postfix_str(f"compiling {k} stages ({cost_name})")
            prog = given if given is not None else compile_model(
                model, args, example_kwargs=kwargs, num_stages=k, cost=c, devices=_devices_for(devices, k),
                progress=False, **compile_options)
            flat = prog.flatten_inputs(args, kwargs)
            batch = batch_size(flat, prog.inputs, prog.batch_dim)
            tgt = target
            last = prog.stages[-1].device
            if isinstance(target, torch.Tensor) and target.device != last:
                tgt = target.to(last)
            for _, _, name, m in group:
                what = f"{k} stages, {name}, m={m}, cost {cost_name}"
                bar.set_postfix_str(what)
                try:
                    pipe = Pipeline(prog, name, m, loss_fn or mean_output_loss, executor="local")
                except ScheduleError as e:
                    skipped.append((what, str(e)))
                    log.info("pipesplit benchmark: skipped %s: %s", what, e)
                    bar.update()
                    continue
                times, tr, peaks = _measure(pipe, args, kwargs, tgt, warmup, repeats)
                pred = predict(prog, pipe.schedule, c if not is_prog or c in BUILTIN_COSTS else "flops", batch)
                row, median_step = _row(prog, pipe, cost_name, batch, pred, times, tr, peaks)
                mix = program_mix(prog)
                if mix is not None:  # planned for several lengths: each measured and predicted too
                    row = _at_lengths(row, prog, pipe, mix, c if not is_prog or c in BUILTIN_COSTS else "flops",
                                      batch, (args, kwargs, tgt), warmup, repeats)
                rows.append(row)
                details.append(RunDetail(prog, pred, tr, median_step))
                # in the table's unit (it said "0.1379s per step" above a table of "138" ms)
                log.info("pipesplit benchmark: %s: %s ms per step", what, ms_text(row.measured_step_s))
                bar.update()
    finally:
        redirect.close()
        bar.close()
    if not rows:
        raise ScheduleError("benchmark: no configuration could run:\n" + "\n".join(f"  {w}: {e}" for w, e in skipped))
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(), "warmup": warmup, "repeats": repeats,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load": load_summary(load_before, machine_load()),
    }
    return BenchmarkResult(rows, details, skipped, meta)
