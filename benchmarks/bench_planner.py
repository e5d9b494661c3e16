"""Planner vs references: pipesplit's split against DeepSpeed's, torchtitan's and PyTorch's.

For every model of ``planner_zoo.MODELS`` and 2, 4 and 8 stages, each method's split is
compiled by ``pipesplit.compile`` (the references through ``split_points=``, their layer
split turned into module paths by ``baselines.py``), so every method runs through the
same split program, runtime and measurement:

- measured bottleneck: ``max`` over stages of forward + backward (F + the fused B) of one
  microbatch, timed by ``pipesplit.runtime.measure.measure_stage_costs``
  (``backward="fused"``, ``reduce="min"``) in several rounds; every round times every
  distinct split of the model once, in a rotating order, so that machine noise hits all
  methods alike; per stage the minimum over rounds is kept. Methods that produce the same
  split share one program and one measurement.
- predicted step time for 1F1B and ZB-H1: ``simulate(get_schedule(...), measured stage
  costs, comm)`` with ``n_microbatches = 4 x stages``; ZB-H1's I and W are the measured
  input-gradient pass and fused B minus it. ``comm`` per cut is pipesplit's default
  ``CommModel`` (CPU-CPU: 50 us + bytes / 5 GB/s) on the bytes the program sends across it.
- peak stage memory: pipesplit's memory model applied alike to every split: parameters x
  (1 + gradient + 2 Adam moments) + buffers + one microbatch's activations x the
  microbatches 1F1B keeps in flight on that stage (``in_flight_per_stage``).

pipesplit plans with ``schedule="1f1b"`` (the simulated step time of its split is the
objective) and each of ``cost="hybrid"`` and ``cost="profile"``. Prints markdown (paste
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
from common import emit, header, load_average, markdown_table  # noqa: E402
from planner_zoo import MODEL_BY_NAME, MODELS, BenchModel  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.capture import capture  # noqa: E402
from pipesplit.passes.chain import build_chain  # noqa: E402
from pipesplit.passes.costs import annotate_costs  # noqa: E402
from pipesplit.passes.objective import CommModel, MemoryModel, in_flight_per_stage  # noqa: E402
from pipesplit.passes.step_planner import figures_for  # noqa: E402
from pipesplit.runtime.measure import measure_stage_costs  # noqa: E402
from pipesplit.schedules import StageCost, get_schedule, simulate  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MICROBATCH = 2  # samples per microbatch: the example input, and what is timed
PIPESPLIT_COSTS = ("profile", "hybrid")
# The pipesplit row every reference is compared with. "profile" was chosen before the
# comparison was run, from how well each cost model predicted per-layer forward +
# backward times on these models (the "cost models" table), not from the comparison.
PRIMARY_COST = "profile"


@dataclass
class Program:
    """One distinct split of a model, shared by every method that produced it."""

    prog: Any
    methods: list[str]
    best: list[tuple[float, float, float]] | None = None  # per stage: minimum F, I, fused B over rounds
    rounds: list[list[float]] = field(default_factory=list)  # per round, per stage: F + fused B


@dataclass
class Row:
    model: str
    stages: int
    method: str
    split: str
    bottleneck_ms: float
    stage_ms: list[float]
    step_1f1b_ms: float
    step_zbh1_ms: float
    peak_mem_mb: float
    planned_1f1b_ms: float | None = None  # pipesplit's own prediction before any measurement
    noise: float = 0.0  # bottleneck stage: median over rounds / minimum - 1


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
    """A chain of the model's graph with training state counted as the planner counts it."""
    cap = capture(model, args, kwargs)
    requires = [isinstance(x, torch.Tensor) and x.requires_grad for x in cap.example_flat]
    gm = annotate_costs(cap.gm, requires)
    mm = MemoryModel()
    return build_chain(gm, lambda n: 1.0, state_factor=mm.state_factor), mm


def peak_memory(chain: Any, mm: MemoryModel, prog: Any, k: int, n_mb: int) -> float:
    pos = {n.name: i for i, n in enumerate(chain.nodes)}
    starts = []
    for stage in prog.stages:
        idx = sorted(pos[name] for name in stage.nodes)
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise RuntimeError(f"stage {stage.index} is not contiguous in graph order")
        starts.append(idx[0])
    in_flight = in_flight_per_stage(get_schedule("1f1b", n_stages=k, n_ranks=k, n_microbatches=n_mb))
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
    for cost in costs:
        name = f"pipesplit ({cost})"
        prog = pipesplit.compile(model, args, example_kwargs=kwargs, num_stages=k, cost=cost, schedule="1f1b",
                                 n_microbatches=4 * k, progress=False)
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


def measure_round(programs: list[Program], args: tuple, kwargs: dict, rnd: int, repeats: int, warmup: int) -> None:
    """Time every program once (rotating the order each round); keep per-stage minima of F, I and B."""
    order = programs[rnd % len(programs):] + programs[: rnd % len(programs)]
    for p in order:
        got = measure_stage_costs(p.prog, *args, n_microbatches=1, repeats=repeats, warmup=warmup, reduce="min",
                                  backward="fused", **kwargs)
        now = [(c.forward, c.backward_input, c.backward) for c in got]
        p.rounds.append([c.forward + c.backward for c in got])
        p.best = now if p.best is None else [tuple(map(min, a, b)) for a, b in zip(p.best, now)]


def stage_costs(p: Program) -> list[StageCost]:
    """F, I and W = fused B - I per stage, from the minima over rounds."""
    assert p.best is not None
    return [StageCost(f, i, max(b - i, 0.0)) for f, i, b in p.best]


def bottleneck_noise(p: Program) -> float:
    """How far the bottleneck stage's typical round sits above its best: median / minimum - 1."""
    per_stage = list(zip(*p.rounds))
    worst = max(range(len(per_stage)), key=lambda s: min(per_stage[s]))
    samples = per_stage[worst]
    return float(np.median(samples) / min(samples) - 1.0)


def run_model(bm: BenchModel, ks: list[int], rounds: int, repeats: int, warmup: int,
              costs: tuple[str, ...]) -> tuple[list[Row], dict[str, Any]]:
    torch.manual_seed(0)
    model = bm.build()
    model.train()
    args, kwargs = bm.inputs(MICROBATCH)
    layers = bm.layers(model)
    t0 = time.perf_counter()
    chain, mm = memory_figures(model, args, kwargs)
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
    for rnd in range(rounds):
        measure_round(programs, args, kwargs, rnd, repeats, warmup)
    measure_s = time.perf_counter() - t0
    by_method = {m: p for p in programs for m in p.methods}
    rows = []
    for k in ks:
        progs, points, planned = per_k[k]
        n_mb = 4 * k
        s1 = get_schedule("1f1b", n_stages=k, n_ranks=k, n_microbatches=n_mb)
        zb = get_schedule("zb_h1", n_stages=k, n_ranks=k, n_microbatches=n_mb)
        for name, prog in progs.items():
            p = by_method[f"{k}:{name}"]
            costs = stage_costs(p)
            comm = cut_seconds(p.prog)
            stage_s = [c.forward + c.backward for c in costs]
            split = describe_split(p.prog, layers) if name.startswith("pipesplit") else points[name]
            rows.append(Row(
                bm.name, k, name, split, max(stage_s) * 1e3, [x * 1e3 for x in stage_s],
                simulate(s1, costs, comm_cost=comm or 0.0).step_time * 1e3,
                simulate(zb, costs, comm_cost=comm or 0.0).step_time * 1e3,
                peak_memory(chain, mm, p.prog, k, n_mb) / 2**20,
                planned.get(name, None) and planned[name] * 1e3,
                bottleneck_noise(p),
            ))
    info = {"compile_s": compile_s, "measure_s": measure_s, "programs": len(programs)}
    return rows, info


# ------------------------------------------------------------------------------ cost models
def cost_accuracy(bm: BenchModel, costs: tuple[str, ...], rounds: int) -> list[list[Any]]:
    """Per layer, each cost model's share of the model's F + B against the measured share.

    One program with a stage per layer is measured like the splits above; the cost
    models annotate a fresh capture exactly as ``compile`` does. Returns table rows.
    """
    from pipesplit.passes.calibrate import calibrate
    from pipesplit.passes.chain import compute_nodes
    from pipesplit.passes.objective import DEFAULT_FLOPS_PER_S
    from pipesplit.passes.planner import cost_function
    from pipesplit.passes.profile import profile_nodes
    from pipesplit.passes.step_planner import node_seconds

    torch.manual_seed(0)
    model = bm.build()
    args, kwargs = bm.inputs(MICROBATCH)
    layers = bm.layers(model)
    prog = pipesplit.compile(model, args, example_kwargs=kwargs, split_points=[x.paths[0] for x in layers[1:]],
                             progress=False)
    p = Program(prog, [])
    for rnd in range(rounds):
        measure_round([p], args, kwargs, rnd, 1, 1)
    measured = np.array([c.forward + c.backward for c in stage_costs(p)])
    where = prog.plan.assignment()
    rows = []
    for cost in ("flops",) + costs:
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
def verdicts(rows: list[Row], primary: str) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for key in sorted({(r.model, r.stages) for r in rows}, key=lambda x: (x[0], x[1])):
        group = [r for r in rows if (r.model, r.stages) == key]
        mine = next(r for r in group if r.method == primary)
        refs = [r for r in group if not r.method.startswith("pipesplit")]
        best = min(refs, key=lambda r: r.bottleneck_ms)
        out[key] = {
            "mine": mine, "best": best,
            "gain": best.bottleneck_ms / mine.bottleneck_ms - 1.0,
            "no_worse": all(mine.bottleneck_ms <= r.bottleneck_ms for r in refs),
            # a loss smaller than either split's bottleneck noise (median vs best round) is a tie
            "within_noise": all(mine.bottleneck_ms <= r.bottleneck_ms * (1 + max(mine.noise, r.noise))
                                for r in refs),
            "no_worse_steps": all(mine.step_1f1b_ms <= r.step_1f1b_ms and mine.step_zbh1_ms <= r.step_zbh1_ms
                                  for r in refs),
            "no_worse_mem": all(mine.peak_mem_mb <= r.peak_mem_mb for r in refs),
        }
    return out


def tables(rows: list[Row], primary: str) -> str:
    out = []
    ver = verdicts(rows, primary)
    for model in dict.fromkeys(r.model for r in rows):
        out.append(f"#### {model}: {MODEL_BY_NAME[model].description}\n")
        body = []
        for r in (r for r in rows if r.model == model):
            mine = ver[(r.model, r.stages)]["mine"]
            rel = r.bottleneck_ms / mine.bottleneck_ms
            body.append([
                r.stages, r.method if r.method != primary else f"**{r.method}**", r.split,
                f"{r.bottleneck_ms:.1f}", f"{r.noise * 100:.0f}%", f"{rel:.2f}", f"{r.step_1f1b_ms:.0f}",
                f"{r.step_zbh1_ms:.0f}", f"{r.peak_mem_mb:.0f}",
            ])
        out.append(markdown_table(
            ["stages", "method", "stages start at", "bottleneck F+B ms", "noise", f"÷ {primary}", "1F1B step ms",
             "ZB-H1 step ms", "peak stage MiB"], body, "rllrrrrrr"))
        out.append("")
    return "\n".join(out)


def summary(rows: list[Row], primary: str) -> str:
    ver = verdicts(rows, primary)
    body = []
    for (model, k), v in ver.items():
        body.append([
            model, "yes" if MODEL_BY_NAME[model].heterogeneous else "no", k,
            f"{v['mine'].bottleneck_ms:.1f}", f"{v['best'].bottleneck_ms:.1f} ({v['best'].method})",
            f"{v['gain'] * 100:+.1f}%", f"{v['mine'].noise * 100:.0f}% / {v['best'].noise * 100:.0f}%",
            "yes" if v["no_worse"] else ("within noise" if v["within_noise"] else "**no**"),
            "yes" if v["no_worse_steps"] else "**no**", "yes" if v["no_worse_mem"] else "no",
        ])
    return markdown_table(
        ["model", "heterogeneous", "stages", f"{primary} bottleneck ms", "best reference ms",
         "reference / pipesplit - 1", "noise (pipesplit / best ref.)", "bottleneck no worse than every reference",
         "1F1B and ZB-H1 steps no worse", "peak memory no larger"], body, "llrrlrrlll")


def predicted_vs_measured(rows: list[Row]) -> str:
    body = []
    for r in rows:
        if r.planned_1f1b_ms:
            body.append([r.model, r.stages, r.method, f"{r.planned_1f1b_ms:.0f}", f"{r.step_1f1b_ms:.0f}",
                         f"{r.step_1f1b_ms / r.planned_1f1b_ms:.2f}"])
    return markdown_table(["model", "stages", "method", "planner's 1F1B step ms", "from measured stages ms",
                           "measured / planned"], body, "lrlrrr")


def plot(rows: list[Row], path_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(path_dir, exist_ok=True)
    paths = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        ks = sorted({r.stages for r in mine})
        methods = list(dict.fromkeys(r.method for r in mine))
        fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=90)
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            ys = [next(r.bottleneck_ms for r in mine if r.stages == k and r.method == m) for k in ks]
            ax.bar(np.arange(len(ks)) + (j - (len(methods) - 1) / 2) * width, ys, width, label=m,
                   edgecolor="black" if m.startswith("pipesplit") else None, linewidth=0.8)
        ax.set_xticks(np.arange(len(ks)), [f"{k} stages" for k in ks])
        ax.set_ylabel("bottleneck stage F+B (ms)")
        ax.set_title(f"{model}: measured bottleneck per method (lower is better)", fontsize=10)
        ax.legend(fontsize=7, ncol=4, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.1))
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = os.path.join(path_dir, f"planner_{model}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 and 4 stages, 3 measurement rounds (a few minutes)")
    ap.add_argument("--models", nargs="*", choices=list(MODEL_BY_NAME), help="default: all five")
    ap.add_argument("--stages", nargs="*", type=int, help="default 2 4 8 (quick: 2 4)")
    ap.add_argument("--rounds", type=int, help="measurement rounds (default 7, quick 3)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per stage per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per stage per round")
    ap.add_argument("--costs", nargs="*", default=list(PIPESPLIT_COSTS), choices=list(PIPESPLIT_COSTS),
                    help="pipesplit cost models to run (the first one listed of profile, hybrid is compared)")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the per-layer cost model accuracy table")
    ap.add_argument("--plots", default=os.path.join(HERE, "plots"), help="where the PNG charts go")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ks = args.stages or ([2, 4] if args.quick else [2, 4, 8])
    rounds = args.rounds or (3 if args.quick else 7)
    repeats = args.repeats
    models = [MODEL_BY_NAME[m] for m in args.models] if args.models else MODELS
    costs = tuple(args.costs)
    primary = f"pipesplit ({PRIMARY_COST if PRIMARY_COST in costs else costs[0]})"
    ds = deepspeed_version()
    torch.set_num_threads(1)  # importing deepspeed must not change it

    emit(header("Planner vs references").replace("## ", "### ", 1))
    emit(f"- deepspeed {ds} (its `partition_uniform` / `partition_balanced`); microbatch of {MICROBATCH} samples; "
         f"{rounds} rounds x ({args.warmup} warm-up + {repeats} timed) runs per stage, minimum kept")
    emit()
    start = time.perf_counter()
    rows: list[Row] = []
    for bm in models:
        got, info = run_model(bm, ks, rounds, repeats, args.warmup, costs)
        rows += got
        emit(f"<!-- {bm.name}: {info['programs']} distinct splits, compile {info['compile_s']:.0f} s, "
             f"measure {info['measure_s']:.0f} s, load {load_average()} -->")
    emit(f"\nTotal {time.perf_counter() - start:.0f} s.\n")
    emit("#### Summary\n")
    emit(summary(rows, primary))
    emit()
    emit(tables(rows, primary))
    emit("#### pipesplit's own prediction against the measured stages\n")
    emit(predicted_vs_measured(rows))
    if not args.no_accuracy:
        emit("\n#### Cost models: predicted against measured share of each layer\n")
        acc = [row for bm in models for row in cost_accuracy(bm, costs, rounds)]
        emit(markdown_table(["model", "cost", "sum over layers of |predicted - measured share|", "worst layer"],
                            acc, "llrl"))
    paths = plot(rows, args.plots)
    emit("\nPlots: " + ", ".join(f"`{os.path.relpath(p, os.path.dirname(HERE))}`" for p in paths))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
