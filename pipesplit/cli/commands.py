"""``pipesplit split``, ``pipesplit bench`` and ``pipesplit schedule``."""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any, Callable

import torch

from pipesplit.checks import file_target, folder_target
from pipesplit.cli.factory import CLIError, check_fits, default_int_high, load_model, make_inputs, parse_kwargs
from pipesplit.devices import device_name, machine_devices
from pipesplit.passes.plan.planner import cost_function
from pipesplit.schedules.timeline import TEXT_LEGEND
from pipesplit.units import phase_times


def int_list(text: str) -> list[int]:
    """argparse type: ``"2,4"`` -> ``[2, 4]``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def name_list(text: str) -> list[str]:
    """argparse type: ``"gpipe,1f1b"`` -> ``["gpipe", "1f1b"]``."""
    return [v.strip() for v in text.split(",") if v.strip()]


def device_list(text: str) -> list[str]:
    """argparse type: ``"cuda,cpu"`` -> ``["cuda:0", "cpu"]`` (an accelerator without an index is the current one)."""
    names = []
    for v in name_list(text):
        try:
            names.append(device_name(v))
        except RuntimeError:  # torch's message lists every device type it knows, not what is here
            raise argparse.ArgumentTypeError(
                f"{v!r} is not a device; this machine has {', '.join(machine_devices())}") from None
    return names


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODULE:FACTORY",
                   help="an importable factory returning an nn.Module, e.g. pipesplit.models:gpt or my_net.py:build")
    p.add_argument("--input-shape", action="append", required=True, metavar="SHAPE",
                   help="(required) shape of one positional input, e.g. 8x64 or 8x64:int64 (repeat for "
                        "several inputs); the first dimension is the batch")
    p.add_argument("--int-high", type=positive_int, default=None, metavar="N",
                   help="integer inputs are drawn from [0, N) (default: the smallest num_embeddings of the "
                        "model's nn.Embedding modules, i.e. its vocabulary)")
    p.add_argument("--kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory (repeatable), e.g. --kwarg layers=4")
    p.add_argument("--seed", type=int, default=0, help="random seed for the weights and inputs (default 0)")
    p.add_argument("--devices", type=device_list, default=None, metavar="D[,D...]",
                   help="devices, one per stage or cycled (default: where the factory put the model)")


def _model_and_inputs(args: argparse.Namespace) -> tuple[Any, tuple[torch.Tensor, ...]]:
    torch.manual_seed(args.seed)
    model = load_model(args.model, parse_kwargs(args.kwarg))
    high = default_int_high(model, args.input_shape) if args.int_high is None else args.int_high
    inputs = make_inputs(args.input_shape, high, args.seed)
    check_fits(model, inputs, args.input_shape)
    return model, inputs


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _write(path: str, fn: Callable[[str], Any]) -> None:
    file_target(path, path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fn(path)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------- split
def run_split(args: argparse.Namespace) -> int:
    import pipesplit

    cost_function(args.cost)  # unknown names fail before the model is built
    for flag, path in (("--dot", args.dot), ("--svg", args.svg), ("--plan-out", args.plan_out)):
        if path:
            file_target(flag, path)  # before the (slow) compile
    if args.schedule is not None:
        pipesplit.schedules.schedule_info(args.schedule)
    model, inputs = _model_and_inputs(args)
    devices = None if args.devices is None else [args.devices[s % len(args.devices)] for s in range(args.stages)]
    prog = pipesplit.compile(model, inputs, num_stages=args.stages, cost=args.cost, devices=devices,
                             schedule=args.schedule, num_microbatches=args.microbatches, plan=args.plan)
    print(prog.report())
    print(f"\ncompile: {phase_times(prog.timings)}")
    if args.dot:
        _write(args.dot, lambda p: _write_text(p, prog.to_dot(detail=args.detail)))
    if args.svg:
        if not shutil.which("dot"):
            raise CLIError(f"cannot write {args.svg}: graphviz's `dot` program is not installed",
                           "apt-get install graphviz, or write DOT text with --dot")
        _write(args.svg, lambda p: prog.render(p, detail=args.detail))
    if args.plan_out:
        _write(args.plan_out, prog.plan.save)
    return 0


def add_split(sub: Any, debug: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("split", help="compile a model into pipeline stages and print the per-stage report",
                       description="Compile MODULE:FACTORY into pipeline stages; print the report, write DOT/SVG/plan.")
    add_model_arguments(p)
    p.add_argument("--stages", type=positive_int, default=2, help="number of pipeline stages (default 2)")
    p.add_argument("--cost", default="flops",
                   help="cost model: flops (default), params, profile, hybrid or uniform")
    p.add_argument("--schedule", default=None, help="plan for this schedule's simulated step time (e.g. 1f1b)")
    p.add_argument("--microbatches", type=positive_int, default=None, help="microbatches per step for --schedule")
    p.add_argument("--plan", default=None, metavar="F", help="reuse a saved plan (JSON) instead of planning")
    p.add_argument("--dot", metavar="F", help="write the split graph as DOT text (no graphviz needed)")
    p.add_argument("--svg", metavar="F", help="render the split graph as SVG (needs graphviz's `dot`)")
    p.add_argument("--detail", choices=["module", "node"], default="module", help="graph detail (default module)")
    p.add_argument("--plan-out", metavar="F", help="save the plan as JSON (edit it, reuse with --plan)")
    debug(p)
    p.set_defaults(run=run_split)


# ---------------------------------------------------------------------------- bench
def run_bench(args: argparse.Namespace) -> int:
    import pipesplit

    folder_target("--out", args.out)  # before the (slow) benchmark
    model, inputs = _model_and_inputs(args)
    res = pipesplit.benchmark(model, inputs, num_stages=args.stages, schedules=args.schedules,
                              num_microbatches=args.microbatches, cost=args.cost, devices=args.devices,
                              warmup=args.warmup, repeats=args.repeats, progress=False if args.no_progress else None)
    print(res)
    out = args.out
    os.makedirs(out, exist_ok=True)
    _write(os.path.join(out, "bench.csv"), res.to_csv)
    _write(os.path.join(out, "bench.md"), lambda p: _write_text(p, res.to_markdown() + "\n"))
    _write(os.path.join(out, "bench.png"), res.plot)
    _write(os.path.join(out, "balance.png"), res.plot_balance)
    _write(os.path.join(out, "timeline.png"), res.plot_timeline)
    _write(os.path.join(out, "trace.json"), res.to_chrome_trace)
    _write(os.path.join(out, "split.dot"), res.render_split)
    return 0


def add_bench(sub: Any, debug: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "bench", help="benchmark splits, schedules and microbatch counts; write CSV, Markdown and PNGs",
        description="Time every combination of --stages, --schedules, --microbatches and --cost on MODULE:FACTORY "
                    "(trained on the mean of its outputs), against the cost model's prediction. Writes bench.csv, "
                    "bench.md, bench.png (step times, bubbles), balance.png, timeline.png (predicted vs measured "
                    "Gantt of the fastest configuration), trace.json (Chrome/Perfetto) and split.dot to --out.")
    add_model_arguments(p)
    p.add_argument("--stages", type=int_list, default=[2], metavar="N[,N...]", help="stage counts (default 2)")
    p.add_argument("--schedules", type=name_list, default=["gpipe", "1f1b"], metavar="S[,S...]",
                   help="schedules (default gpipe,1f1b); `pipesplit schedule` lists them")
    p.add_argument("--microbatches", type=int_list, default=[4], metavar="M[,M...]",
                   help="microbatches per step (default 4); each must divide the batch")
    p.add_argument("--cost", type=name_list, default=["flops"], metavar="C[,C...]",
                   help="cost models to plan with (default flops; also params, profile, hybrid, uniform)")
    p.add_argument("--warmup", type=count, default=2, help="untimed steps per configuration (default 2)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed steps per configuration (default 5)")
    p.add_argument("--out", default="bench_out", help="folder for the results (default bench_out)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar (shown only when stderr is a terminal)")
    debug(p)
    p.set_defaults(run=run_bench)


# ------------------------------------------------------------------------- schedule
def run_schedule(args: argparse.Namespace) -> int:
    from pipesplit.schedules import resolve_schedule
    from pipesplit.schedules import StageCost, list_schedules, schedule_info, simulate

    if args.name is None:
        for name in list_schedules():
            print(f"{name:18} {' '.join(schedule_info(name).description.split())}")
        return 0
    schedule_info(args.name)
    if args.stages is None:
        raise CLIError("--stages is required to show a schedule",
                       f"e.g. pipesplit schedule {args.name} --stages 4 --microbatches 8")
    sched = resolve_schedule(args.name, args.stages, args.ranks, args.microbatches)
    i = args.forward if args.backward_input is None else args.backward_input
    timeline = simulate(sched, StageCost(args.forward, i, i if args.backward_weight is None else args.backward_weight))
    print(timeline.to_text(width=args.width))
    print(TEXT_LEGEND)
    w = i if args.backward_weight is None else args.backward_weight
    print(f"time units: those of --forward {args.forward:g}, --backward-input {i:g}, --backward-weight {w:g}")
    print(f"simulated bubble: {100 * timeline.bubble_fraction:.1f}% of rank time idle; "
          f"peak activations per rank: {list(timeline.peak_activations)}")
    if args.png:
        _write(args.png, timeline.plot)
    return 0


def add_schedule(sub: Any, debug: Callable[..., None]) -> None:
    p = sub.add_parser("schedule", help="show a schedule's timeline and simulated bubble (no NAME: list them)",
                       description="Simulate a pipeline schedule with equal stage costs and print its timeline: "
                                   + TEXT_LEGEND + ".")
    p.add_argument("name", nargs="?", metavar="NAME", help="schedule name; leave out to list the schedules")
    p.add_argument("--stages", type=int, help="pipeline stages (required with NAME)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument("--ranks", type=int, default=None, help="ranks for multi-stage-per-rank schedules")
    p.add_argument("--forward", type=float, default=1.0, help="forward time of every stage (default 1)")
    p.add_argument("--backward-input", type=float, default=None,
                   help="input-gradient time (default: equal to --forward; full backward = I + W)")
    p.add_argument("--backward-weight", type=float, default=None, help="weight-gradient time (default: = I)")
    p.add_argument("--width", type=int, default=80, help="columns of the text chart (default 80)")
    p.add_argument("--png", metavar="F", help="also save the Gantt chart as a PNG")
    debug(p, compiles=False)
    p.set_defaults(run=run_schedule)
