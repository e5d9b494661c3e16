"""Runtime speed of the local executor (``Pipeline(..., executor="local")``) on one CPU.

Two tables, each against a baseline measured in the same run:

(a) Overhead: the built-in GPT trained one step (loss + backward) by the plain model on
    the full batch, against pipesplit's Pipeline (1F1B) with 1, 2 and 4 stages all on the
    CPU, 1 and 4 microbatches. Reported: step time / plain step time. A second baseline,
    the plain model accumulating gradients over 4 microbatches, separates what smaller
    microbatches cost from what the runtime costs.
(b) Simulator fidelity: every shipped schedule on 4 stages, 8 microbatches. The
    prediction is ``simulate(schedule, measure_stage_costs(...)).step_time``; the
    measurement is ``Pipeline.step`` wall time. Also the "serial prediction", the sum of
    all stage work (8 microbatches x sum over stages of F + I + W): on one CPU the
    local executor's worker threads share the same cores, so stages cannot really run
    side by side and the measurement tracks the serial figure, not the pipelined one.

Step times are medians of ``--repeats`` after ``--warmup`` untimed steps (stage costs: the
median over 3 rounds of the minimum over 5 repeats, the undisturbed work); all variants of a
table are timed round-robin (one step of each per round, rotating the order) so machine
noise hits all alike. torch runs one intra-op thread by default (``--torch-threads``): on
a shared 2-core VM, OpenMP's spin-waiting made two-thread timings swing by up to 5x.
Prints markdown (paste into the ``## Runtime`` section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, load_average, markdown_table, round_robin, usable_cores  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from pipesplit.runtime.engine.measure import measure_stage_costs  # noqa: E402
from pipesplit.schedules import ActionKind, StageCost, simulate  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v"]
SERIAL = "serial run"
COST_ROUNDS = 3
COST_FIELDS = ("forward", "backward_input", "backward_weight")


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def r3(x: float) -> str:
    """A ratio to three decimals (they sit near 1; three significant figures would hide 1.00 vs 1.004)."""
    return f"{x:.3f}"


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num[r] / den[r] (robust to slow drifts in machine load)."""
    return statistics.median(a / b for a, b in zip(num, den))


def spread(xs: list[float]) -> str:
    """Interquartile range relative to the median, as a noise indicator."""
    if len(xs) < 4:
        return "n/a"
    q = statistics.quantiles(xs, n=4)
    return f"±{(q[2] - q[0]) / 2 / statistics.median(xs) * 100:.0f}%"


# ------------------------------------------------------------------------ (a) overhead
def bench_overhead(model: Any, progs: dict[int, Any], x: torch.Tensor, y: torch.Tensor, repeats: int,
                   warmup: int) -> tuple[str, dict]:
    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    def accumulate(n: int = 4) -> None:  # what microbatching costs without any pipeline runtime
        model.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(n), y.chunk(n)):
            (loss_fn(model(xs), ys) / n).backward()

    fns: dict[str, Callable[[], Any]] = {"plain model": plain, "plain model, 4 microbatches (grad. accumulation)": accumulate}
    pipes: dict[str, Any] = {}
    for stages, prog in progs.items():
        for mbs in (1, 4):
            pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=mbs, loss_fn=loss_fn, executor="local")
            name = f"{stages} stage{'s' * (stages > 1)}, {mbs} microbatch{'es' * (mbs > 1)}"
            pipes[name] = pipe

            def step(pipe: Any = pipe) -> Any:
                pipe.zero_grad(set_to_none=True)
                return pipe.step(x, target=y)

            fns[name] = step
    # Exactness check (not timed): every variant's loss equals the plain model's.
    want = loss_fn(model(x), y).item()
    worst = max(abs(float(p.step(x, target=y)) - want) for p in pipes.values())
    times = round_robin(fns, repeats, warmup)
    base = times["plain model"]
    rows = []
    for name, ts in times.items():
        rows.append([name, r3(statistics.median(ts) / statistics.median(base)), r3(paired_ratio(ts, base)), spread(ts)])
    table = markdown_table(["run", "step time / plain", "median of paired ratios", "noise (IQR/2)"], rows, "lrrr")
    return table, {"plain_ms": statistics.median(base) * 1e3, "loss_diff": worst, "times": times}


# ---------------------------------------------------------------------- (b) simulator
def splits_backward(schedule: Any) -> bool:
    return any(a.kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT) for rank in schedule.actions for a in rank)


def bench_simulator(prog: Any, x: torch.Tensor, y: torch.Tensor, repeats: int, warmup: int,
                    schedules: list[str], n_mb: int) -> tuple[str, dict]:
    start = time.perf_counter()
    # Two cost models (see pipesplit/runtime/engine/measure.py): I and W as separate passes, for the
    # zero-bubble schedules; I + W = the one-pass full backward, for schedules with B actions.
    # The minimum over repeats is the stage's work on an undisturbed machine; three rounds,
    # alternating the two kinds, and the median over rounds, so that a burst of load from other
    # jobs during one round of measuring cannot skew the predictions.
    rounds = [{kind: measure_stage_costs(prog, x, num_microbatches=n_mb, repeats=5, warmup=1, reduce="min",
                                         backward=kind, loss_fn=loss_fn, target=y)
               for kind in ("split", "fused")} for _ in range(COST_ROUNDS)]
    costs = {kind: [StageCost(*(statistics.median(getattr(r[kind][i], f) for r in rounds) for f in COST_FIELDS))
                    for i in range(prog.num_stages)]
             for kind in ("split", "fused")}
    measure_s = time.perf_counter() - start
    serial = {kind: n_mb * sum(c.forward + c.backward for c in cs) for kind, cs in costs.items()}
    pipes = {s: pipesplit.Pipeline(prog, s, num_microbatches=n_mb, loss_fn=loss_fn, executor="local") for s in schedules}

    def stepper(pipe: Any) -> Callable[[], Any]:
        def step() -> Any:
            pipe.zero_grad(set_to_none=True)
            return pipe.step(x, target=y)
        return step

    def serial_reference() -> None:  # the same program and microbatches, stage after stage in this thread
        prog.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(n_mb), y.chunk(n_mb)):
            (loss_fn(prog(xs), ys) / n_mb).backward()

    fns = {s: stepper(p) for s, p in pipes.items()}
    fns[SERIAL] = serial_reference
    times = round_robin(fns, repeats, warmup)
    serial_measured = times.pop(SERIAL)
    cores = usable_cores()
    rows, tracks = [], []
    for s, pipe in pipes.items():
        kind = "split" if splits_backward(pipe.schedule) else "fused"
        tl = simulate(pipe.schedule, costs[kind])
        measured = statistics.median(times[s])
        bound = max(tl.step_time, serial[kind] / min(cores, pipe.schedule.num_ranks))
        rows.append([
            f"`{s}`", pipe.schedule.num_ranks, kind, f"{tl.bubble_fraction:.3f}", r3(serial[kind] / tl.step_time),
            r3(measured / tl.step_time), r3(measured / bound), r3(measured / serial[kind]),
            r3(paired_ratio(times[s], serial_measured)), spread(times[s]),
        ])
        refs = {"the pipelined prediction": tl.step_time, f"the {cores}-core bound": bound, "the serial figure": serial[kind]}
        tracks.append(min(refs, key=lambda k: abs(math.log(measured / refs[k]))))
    table = markdown_table(
        ["schedule", "ranks (threads)", "costs", "simulated bubble", "serial / predicted",
         "measured / predicted", f"measured / {cores}-core bound", "measured / serial", "measured / serial run",
         "noise (IQR/2)"],
        rows, "lrlrrrrrrr",
    )
    split, fused = costs["split"], costs["fused"]
    cost_rows = [[i, f"{a.forward * 1e3:.2f}", f"{a.backward_input * 1e3:.2f}", f"{a.backward_weight * 1e3:.2f}",
                  f"{b.backward * 1e3:.2f}", r3(a.backward / b.backward)]
                 for i, (a, b) in enumerate(zip(split, fused))]
    cost_table = markdown_table(["stage", "F (ms)", "I (ms)", "W (ms)", "fused B (ms)", "(I + W) / fused B"],
                                cost_rows, "rrrrrr")
    return table, {"cost_table": cost_table, "serial_ms": {k: v * 1e3 for k, v in serial.items()},
                   "serial_run_vs_costs": statistics.median(serial_measured) / serial["fused"],
                   "measure_s": measure_s, "nearest": tracks, "cores": cores}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a smaller model (~30 s)")
    ap.add_argument("--repeats", type=int, help="timed steps per variant (default 15, quick 3)")
    ap.add_argument("--warmup", type=int, help="untimed steps per variant first (default 2, quick 1)")
    ap.add_argument("--layers", type=int, help="GPT blocks (default 8, quick 4)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (a multiple of 8)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch.set_num_threads (default 1; 0 keeps torch's default, one per core)")
    ap.add_argument("--only", choices=["overhead", "simulator"], help="run one table")
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    layers = args.layers or (4 if args.quick else 8)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    vocab, seq = 512, 64

    torch.manual_seed(0)
    model = gpt(layers=layers, dim=args.dim, vocab=vocab, seq=seq)
    x = torch.randint(0, vocab, (args.batch, seq))
    y = torch.randint(0, vocab, (args.batch, seq))

    emit(header("Runtime: local executor").replace("## ", "### ", 1))
    emit(f"- model: `gpt(layers={layers}, dim={args.dim}, vocab={vocab}, seq={seq})` (tied embeddings), "
         f"batch {args.batch}, cross-entropy loss; {warmup} warm-up + {repeats} timed steps per variant, round-robin")
    emit()
    start = time.perf_counter()
    progs = {k: pipesplit.compile(model, x[:2], num_stages=k, progress=False)
             for k in ((1, 2, 4) if args.only != "simulator" else (4,))}
    emit(f"(compiled into {', '.join(map(str, progs))} stages in {time.perf_counter() - start:.0f} s, not timed)\n")
    if args.only in (None, "overhead"):
        table, info = bench_overhead(model, progs, x, y, repeats, warmup)
        emit("#### (a) Local executor vs the plain model (1F1B, all stages on the CPU)\n")
        emit(f"Baseline: the plain model, forward + loss + backward on the full batch: "
             f"{info['plain_ms']:.0f} ms per step (median). Ratios > 1 mean slower than the plain model.\n")
        emit(table)
        emit(f"\n(largest |loss - plain loss| over the variants: {info['loss_diff']:.1e})\n")
    if args.only in (None, "simulator"):
        n_mb = 8
        table, info = bench_simulator(progs[4], x, y, repeats, warmup, SCHEDULES, n_mb)
        emit(f"#### (b) Measured step time vs the simulator, 4 stages, {n_mb} microbatches\n")
        emit("Stage costs from `measure_stage_costs` (one microbatch; the median over 3 rounds of the minimum of 5 "
             "repeats; `backward=\"split\"` "
             "and `\"fused\"`; "
             f"took {info['measure_s']:.1f} s):\n")
        emit(info["cost_table"])
        emit()
        emit("`costs`: `split` (I and W timed as the separate passes the runtime runs for zero-bubble schedules) "
             "or `fused` (I + W = the one-pass full backward the runtime runs for B actions). "
             "`predicted` = `simulate(schedule, costs).step_time` (ranks run in parallel, one device each); "
             f"`serial` = the sum of all stage work, {n_mb} x Σ(F + I + W) = {info['serial_ms']['split']:.0f} ms "
             f"(split) or {info['serial_ms']['fused']:.0f} ms (fused), one core doing everything; "
             f"`{info['cores']}-core bound` = max(predicted, serial / min(cores, ranks)), the best "
             "this machine could do. `serial / predicted` is the speed-up the schedule would give with one device "
             "per rank. `serial run`: the same 4-stage program run stage after stage in the main thread over the "
             "same 8 microbatches (gradient accumulation), timed in the same round-robin as the schedules, so "
             "`measured / serial run` is the pipeline's gain or loss on this machine, immune to load drifts "
             f"(the serial run took {info['serial_run_vs_costs']:.3f} x the fused serial figure).\n")
        emit(table)
        counts = {k: info["nearest"].count(k) for k in dict.fromkeys(info["nearest"])}
        emit("\nNearest to the measurement: " + ", ".join(f"{k} for {v} of {len(info['nearest'])} schedules"
                                                       for k, v in counts.items()) + ".\n")
    emit(f"(load average at end (1/5/15 min): {load_average()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
