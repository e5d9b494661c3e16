"""Planner vs references: pipesplit's split against DeepSpeed's, torchtitan's and PyTorch's.

For every model of ``planner_zoo.MODELS`` and 2, 4 and 8 stages, each method's split is
compiled by ``pipesplit.compile`` (the references through ``split_points=``, their layer
split turned into module paths by ``baselines.py``), so every method runs through the
same split program, runtime and measurement:

- measured bottleneck: ``max`` over stages of forward + backward (F + the fused B) of one
  microbatch, timed by ``pipesplit.runtime.engine.measure.measure_stage_costs``
  (``backward="fused"``, ``reduce="min"``) in several rounds; every round times every
  distinct split of the model once, in a rotating order, so that machine noise hits all
  methods alike; per stage the median over rounds is kept. On CPU the clock is the
  process's CPU time (``clock="cpu"``, one torch thread), which does not count the time
  the process sat preempted by other jobs on a shared machine. Methods that produce the
  same split share one program and one measurement.
- predicted step time for 1F1B and ZB-H1: ``simulate(get_schedule(...), measured stage
  costs, comm)`` with ``num_microbatches = 4 x stages``; ZB-H1's I and W are the measured
  input-gradient pass and fused B minus it. ``comm`` per cut is pipesplit's default
  ``CommModel`` (CPU-CPU: 50 us + bytes / 5 GB/s) on the bytes the program sends across it.
- peak stage memory: pipesplit's memory model applied alike to every split: parameters x
  (1 + gradient + 2 Adam moments) + buffers + one microbatch's activations x the
  microbatches 1F1B keeps in flight on that stage (``in_flight_per_stage``).

pipesplit plans with ``schedule="1f1b"`` (the simulated step time of its split is the
objective) with ``cost="profile"`` refined by 3 rounds of measured stage times (the row
compared with the references), and with ``cost="profile"`` and ``cost="hybrid"``
alone. Verdicts pair the methods round by round (the splits of one stage count are timed
seconds apart in every round): the median over rounds of the reference's bottleneck
divided by pipesplit's, with a 95% confidence interval. Prints markdown (paste
into the "Planner vs references" section of benchmarks/RESULTS.md) and writes one bar
chart per model under ``benchmarks/plots/``. Needs ``deepspeed`` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import BASELINES, deepspeed_version, split_points  # noqa: E402
from common import emit, header, load_average, markdown_table, reuse_freed_memory  # noqa: E402
from planner_zoo import MODEL_BY_NAME, MODELS, BenchModel  # noqa: E402
from planner_report import HERE, PIPESPLIT_COSTS, Row, emit_plots, emit_tables, render  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.capture import capture  # noqa: E402
from pipesplit.passes.plan.chain import build_chain, compute_nodes  # noqa: E402
from pipesplit.passes.annotate.costs import annotate_costs  # noqa: E402
from pipesplit.passes.plan.objective import CommModel, MemoryModel, in_flight_per_stage  # noqa: E402
from pipesplit.passes.plan.step_planner import figures_for  # noqa: E402
from pipesplit.runtime.engine.measure import measure_stage_costs  # noqa: E402
from pipesplit.schedules import StageCost, get_schedule, simulate  # noqa: E402

MICROBATCH = 2  # samples per microbatch: the example input, and what is timed
# The pipesplit row every reference is compared with: the profile corrected by measured
# stage times (compile(cost="profile", refine=REFINE_ROUNDS)), the setting pipesplit
# recommends when balance matters most, since it plans on times measured on the device.
PRIMARY_COST = "profile+refine"
REFINE_ROUNDS = 3


@dataclass
class Program:
    """One distinct split of a model, shared by every method that produced it."""

    prog: Any
    methods: list[str]
    rounds: list[list[tuple[float, float, float]]] = field(default_factory=list)  # per round, per stage: F, I, fused B


def describe_split(prog: Any, layers: list[Any]) -> str:
    """Where each stage after the first starts: the innermost module of its first operation, and the op."""
    starts = []
    for stage in prog.stages[1:]:
        first = next(n for n in stage.module.graph.nodes if n.name == stage.nodes[0])
        stack = [p for p, _ in (first.meta.get("nn_module_stack") or {}).values() if p]
        op = getattr(first.target, "__name__", str(first.target)).split(".")[0]
        starts.append(f"{stack[-1]} ({op})" if stack else first.name)
    return ", ".join(f"`{s}`" for s in starts)


def memory_figures(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The model's annotated graph, and the memory model the planner uses."""
    cap = capture(model, args, kwargs)
    requires = [isinstance(x, torch.Tensor) and x.requires_grad for x in cap.example_flat]
    return annotate_costs(cap.gm, requires), MemoryModel()


def peak_memory(gm: Any, mm: MemoryModel, prog: Any, k: int, n_mb: int) -> float:
    """The largest stage's memory under 1F1B, by pipesplit's memory model, for any method's split."""
    by_name = {n.name: n for n in compute_nodes(gm)}
    order = [by_name[name] for stage in prog.plan.stages for name in stage]  # the order the plan was cut in
    chain = build_chain(gm, lambda n: 1.0, state_factor=mm.state_factor, order=order)
    starts = list(np.cumsum([0] + [len(stage) for stage in prog.plan.stages[:-1]]))
    in_flight = in_flight_per_stage(get_schedule("1f1b", num_stages=k, num_ranks=k, num_microbatches=n_mb))
    fig = figures_for(chain, starts, np.zeros((chain.n, 3)), in_flight, mm, CommModel(), "cpu")
    return max(fig.memory)


def cut_seconds(prog: Any) -> list[float]:
    """Transfer time per cut (stage s -> s + 1) of everything the program sends across it."""
    comm = CommModel()
    k = prog.num_stages
    nbytes = [sum(b.nbytes for b in prog.boundaries if b.src <= c < b.dst) for c in range(k - 1)]
    return [comm.seconds(float(x), "cpu", "cpu") for x in nbytes]


def compile_methods(bm: BenchModel, model: torch.nn.Module, args: tuple, kwargs: dict, k: int,
                    costs: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str], dict[str, float]]:
    """Every method's program for ``k`` stages, and pipesplit's own predicted 1F1B steps."""
    progs: dict[str, Any] = {}
    planned: dict[str, float] = {}
    for method in costs:
        name = f"pipesplit ({method})"
        cost, _, refined = method.partition("+")
        prog = pipesplit.compile(model, args, example_kwargs=kwargs, num_stages=k, cost=cost, schedule="1f1b",
                                 num_microbatches=4 * k, refine=REFINE_ROUNDS if refined else 0, progress=False)
        progs[name] = prog
        planned[name] = float(prog.plan.predicted_step_s or 0.0)
    layers = bm.layers(model)
    points: dict[str, str] = {}
    by_points: dict[tuple[str, ...], Any] = {}
    for name, fn in BASELINES.items():
        sp = tuple(split_points(layers, fn(model, layers, k, bm.type_regex)))
        if sp not in by_points:
            by_points[sp] = pipesplit.compile(model, args, example_kwargs=kwargs, split_points=list(sp),
                                              progress=False)
        progs[name] = by_points[sp]
        points[name] = ", ".join(f"`{p}`" for p in sp)
    return progs, points, planned


def measure_round(programs: list[Program], args: tuple, kwargs: dict, rnd: int, repeats: int, warmup: int,
                  clock: str) -> None:
    """Time every program once (rotating the order each round), keeping each round's per-stage F, I and B."""
    order = programs[rnd % len(programs):] + programs[: rnd % len(programs)]
    for p in order:
        got = measure_stage_costs(p.prog, *args, num_microbatches=1, repeats=repeats, warmup=warmup, reduce="min",
                                  backward="fused", clock=clock, **kwargs)
        p.rounds.append([(c.forward, c.backward_input, c.backward) for c in got])


def stage_costs(p: Program, reduce: str) -> list[StageCost]:
    """F, I and W = fused B - I per stage: the median (or minimum) over rounds of each."""
    how = np.median if reduce == "median" else np.min
    per_stage = [np.array(samples) for samples in zip(*p.rounds)]  # stage -> (rounds, 3)
    out = []
    for a in per_stage:
        f, i, b = (float(how(a[:, j])) for j in range(3))
        out.append(StageCost(f, i, max(b - i, 0.0)))
    return out


def bottleneck_noise(p: Program) -> float:
    """Spread of the bottleneck stage's F + B over rounds: interquartile range / median."""
    per_stage = [np.array([f + b for f, _, b in samples]) for samples in zip(*p.rounds)]
    samples = max(per_stage, key=np.median)
    q1, q2, q3 = np.percentile(samples, [25, 50, 75])
    return float((q3 - q1) / q2)


def run_model(bm: BenchModel, ks: list[int], rounds: int, repeats: int, warmup: int,
              costs: tuple[str, ...], clock: str, reduce: str) -> tuple[list[Row], dict[str, Any]]:
    torch.manual_seed(0)
    model = bm.build()
    model.train()
    args, kwargs = bm.inputs(MICROBATCH)
    layers = bm.layers(model)
    t0 = time.perf_counter()
    gm, mm = memory_figures(model, args, kwargs)
    per_k: dict[int, tuple[dict[str, Any], dict[str, str], dict[str, float]]] = {}
    distinct: dict[int, Program] = {}
    for k in ks:
        progs, points, planned = compile_methods(bm, model, args, kwargs, k, costs)
        per_k[k] = (progs, points, planned)
        for name, prog in progs.items():
            key = id(prog)
            for other in distinct.values():  # the same split from another compile: one program
                if (other.prog.plan.stages == prog.plan.stages
                        and sorted(other.prog.plan.recompute) == sorted(prog.plan.recompute)):
                    key = id(other.prog)
                    break
            distinct.setdefault(key, Program(prog, []))
            distinct[key].methods.append(f"{k}:{name}")
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    programs = list(distinct.values())
    # The machine drifts between speed regimes lasting seconds to minutes; the splits that
    # are compared with each other (same stage count) are timed back to back in each round.
    groups = [[p for p in programs if p.methods[0].startswith(f"{k}:")] for k in ks]
    for rnd in range(rounds):
        for group in groups:
            measure_round(group, args, kwargs, rnd, repeats, warmup, clock)
    measure_s = time.perf_counter() - t0
    by_method = {m: p for p in programs for m in p.methods}
    rows = []
    for k in ks:
        progs, points, planned = per_k[k]
        n_mb = 4 * k
        s1 = get_schedule("1f1b", num_stages=k, num_ranks=k, num_microbatches=n_mb)
        zb = get_schedule("zb_h1", num_stages=k, num_ranks=k, num_microbatches=n_mb)
        for name, prog in progs.items():
            p = by_method[f"{k}:{name}"]
            costs = stage_costs(p, reduce)
            comm = cut_seconds(p.prog)
            stage_s = [c.forward + c.backward for c in costs]
            split = describe_split(p.prog, layers) if name.startswith("pipesplit") else points[name]
            rows.append(Row(
                bm.name, k, name, split, max(stage_s) * 1e3, [x * 1e3 for x in stage_s],
                simulate(s1, costs, comm_cost=comm or 0.0).step_time * 1e3,
                simulate(zb, costs, comm_cost=comm or 0.0).step_time * 1e3,
                peak_memory(gm, mm, p.prog, k, n_mb) / 2**20,
                planned.get(name, None) and planned[name] * 1e3,
                bottleneck_noise(p),
                [list(x) for x in p.prog.plan.stages],
                [max(f + b for f, _, b in stages) * 1e3 for stages in p.rounds],
            ))
    info = {"compile_s": compile_s, "measure_s": measure_s, "programs": len(programs)}
    return rows, info


# ------------------------------------------------------------------------------ cost models
def cost_accuracy(bm: BenchModel, costs: tuple[str, ...], rounds: int, clock: str, reduce: str) -> list[list[Any]]:
    """Per layer, each cost model's share of the model's F + B against the measured share.

    One program with a stage per layer is measured like the splits above; the cost
    models annotate a fresh capture exactly as ``compile`` does. Returns table rows.
    """
    from pipesplit.passes.annotate.calibrate import calibrate
    from pipesplit.passes.plan.objective import DEFAULT_FLOPS_PER_S
    from pipesplit.passes.plan.planner import cost_function
    from pipesplit.passes.annotate.profile import profile_nodes
    from pipesplit.passes.plan.step_planner import node_seconds

    torch.manual_seed(0)
    model = bm.build()
    args, kwargs = bm.inputs(MICROBATCH)
    layers = bm.layers(model)
    prog = pipesplit.compile(model, args, example_kwargs=kwargs, split_points=[x.paths[0] for x in layers[1:]],
                             progress=False)
    p = Program(prog, [])
    for rnd in range(rounds):
        measure_round([p], args, kwargs, rnd, 1, 1, clock)
    measured = np.array([c.forward + c.backward for c in stage_costs(p, reduce)])
    where = prog.plan.assignment()
    rows = []
    for cost in ("flops",) + tuple(c for c in costs if "+" not in c):
        cap = capture(model, args, kwargs)
        gm = annotate_costs(cap.gm, [isinstance(x, torch.Tensor) and x.requires_grad for x in cap.example_flat])
        if cost == "profile":
            profile_nodes(gm, cap.example_flat, "cpu", mutated_targets=cap.mutated_targets, progress=False)
        elif cost == "hybrid":
            calibrate(gm, cap.example_flat, "cpu", mutated_targets=cap.mutated_targets, progress=False)
        nodes = compute_nodes(gm)
        name, fn = cost_function(cost)
        per = np.zeros(len(layers))
        for n, sec in zip(nodes, node_seconds(nodes, name, fn, DEFAULT_FLOPS_PER_S["cpu"])):
            per[where[n.name]] += sec.sum()
        err = np.abs(per / per.sum() - measured / measured.sum())
        worst = int(np.argmax(err))
        rows.append([bm.name, cost, f"{err.sum() * 100:.1f}%", f"{err[worst] * 100:.1f}% ({layers[worst].paths[0]})"])
    return rows


# ------------------------------------------------------------------------------ report
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 and 4 stages, 3 measurement rounds (a few minutes)")
    ap.add_argument("--models", nargs="*", choices=list(MODEL_BY_NAME), help="default: all five")
    ap.add_argument("--stages", nargs="*", type=int, help="default 2 4 8 (quick: 2 4)")
    ap.add_argument("--rounds", type=int, help="measurement rounds (default 15, quick 3)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per stage per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per stage per round")
    ap.add_argument("--costs", nargs="*", default=list(PIPESPLIT_COSTS), choices=list(PIPESPLIT_COSTS),
                    help="pipesplit settings to run (profile+refine: cost='profile', refine=3); the first one listed "
                         "of profile+refine, profile, hybrid is the one compared")
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                    help="time CPU stages by the process's CPU time (default: not counting time preempted by other "
                         "processes) or by wall time")
    ap.add_argument("--reduce", default="median", choices=["median", "min"],
                    help="per stage, the median (default) or minimum over rounds")
    ap.add_argument("--malloc-defaults", action="store_true",
                    help="keep glibc's allocator defaults (by default the script re-runs itself with freed memory "
                         "kept for reuse; see common.MALLOC_ENV)")
    ap.add_argument("--from-json", help="only print the tables and plots of a run saved with --json")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the per-layer cost model accuracy table")
    ap.add_argument("--plots", default=os.path.join(HERE, "plots"), help="where the PNG charts go")
    args = ap.parse_args()
    if args.from_json:
        return render(args.from_json, args.plots)
    allocator = reuse_freed_memory(not args.malloc_defaults)
    torch.set_num_threads(1)
    ks = args.stages or ([2, 4] if args.quick else [2, 4, 8])
    rounds = args.rounds or (3 if args.quick else 15)
    repeats = args.repeats
    models = [MODEL_BY_NAME[m] for m in args.models] if args.models else MODELS
    costs = tuple(args.costs)
    primary = f"pipesplit ({PRIMARY_COST if PRIMARY_COST in costs else costs[0]})"
    ds = deepspeed_version()
    torch.set_num_threads(1)  # importing deepspeed must not change it

    emit(header("Planner vs references").replace("## ", "### ", 1))
    emit(f"- deepspeed {ds} (its `partition_uniform` / `partition_balanced`); microbatch of {MICROBATCH} samples; "
         f"{rounds} rounds x ({args.warmup} warm-up + {repeats} timed) runs per stage, {args.reduce} over rounds kept; "
         f"clock: {'process CPU time' if args.clock == 'cpu' else 'wall time'}; {allocator}")
    emit()
    start = time.perf_counter()
    rows: list[Row] = []
    for bm in models:
        got, info = run_model(bm, ks, rounds, repeats, args.warmup, costs, args.clock, args.reduce)
        rows += got
        emit(f"<!-- {bm.name}: {info['programs']} distinct splits, compile {info['compile_s']:.0f} s, "
             f"measure {info['measure_s']:.0f} s, load {load_average()} -->")
    emit(f"\nTotal {time.perf_counter() - start:.0f} s.\n")
    emit_tables(rows, primary)
    if not args.no_accuracy:
        emit("\n#### Cost models: predicted against measured share of each layer\n")
        acc = [row for bm in models for row in cost_accuracy(bm, costs, rounds, args.clock, args.reduce)]
        emit(markdown_table(["model", "cost", "sum over layers of |predicted - measured share|", "worst layer"],
                            acc, "llrl"))
    emit_plots(rows, args.plots)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
