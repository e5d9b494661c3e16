"""The benchmark API on the built-in GPT: predicted against measured, per configuration.

Runs ``pipesplit.benchmark`` on ``gpt(layers=8, dim=128, vocab=1024, seq=64)`` trained
with next-token cross-entropy on one batch, over stage counts x schedules x microbatch
counts x cost models, and prints the ``## Benchmark API`` section of
benchmarks/RESULTS.md: the machine and date, the table, and the pictures it writes to
``--plots`` (step times and bubbles, stage balance, the predicted vs measured Gantt of
the fastest configuration, and its Chrome trace).

The baseline each row is read against is the cost model's own prediction for that
split and schedule (the ``meas/pred`` column), plus the plain model's training step on
the same batch, timed in the same run (the ``vs plain`` figure under the table).

The prediction simulates rank threads that share this host's cores action by action
(processor sharing: while n ranks compute, each runs at the slowdown measured for n threads).
Its baseline, computed from the same rows against the same measured steps, is the model it
replaced: every CPU stage slowed by the slowdown of all the ranks at once ("all busy").

One intra-op thread by default (``--torch-threads``): the local executor runs one
thread per rank, and on a shared 2-core VM OpenMP's spin-waiting makes two-thread
timings swing by up to 5x.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, markdown_table  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.bench.predict import cpu_ranks  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from pipesplit.passes.annotate.rates import concurrent_slowdown  # noqa: E402
from pipesplit.schedules import StageCost, simulate  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def plain_step_s(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, warmup: int, repeats: int) -> float:
    """Median wall time of one forward + backward of the unsplit model on the full batch."""
    times = []
    for k in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_fn(model(x), y).backward()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def all_busy_step_s(detail: Any) -> float:
    """The replaced model's step: every CPU stage slowed by the slowdown of all its ranks at once."""
    prog, schedule, pred = detail.program, detail.trace.schedule, detail.prediction
    f = concurrent_slowdown(len(cpu_ranks(prog, schedule)))
    costs = [StageCost(c.forward * f, c.backward_input * f, c.backward_weight * f) if s.device.type == "cpu" else c
             for c, s in zip(pred.costs, prog.stages)]
    return simulate(schedule, costs, comm_cost=pred.comm if pred.comm else 0.0).step_time


def spread(ratios: list[float]) -> str:
    """Range and median |log| of meas/pred ratios: how far the predictions are, either way."""
    far = statistics.median(abs(math.log(r)) for r in ratios)
    return f"{min(ratios):.2f}–{max(ratios):.2f}, median {math.exp(far):.2f}× off"


def csv_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def csv_names(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="GPT blocks (default 8)")
    ap.add_argument("--dim", type=int, default=128, help="GPT width (default 128)")
    ap.add_argument("--batch", type=int, default=16, help="sequences of 64 tokens per step (default 16)")
    ap.add_argument("--stages", type=csv_ints, default=[2, 4], help="stage counts (default 2,4)")
    ap.add_argument("--schedules", type=csv_names, default=["gpipe", "1f1b", "zb_h1"],
                    help="schedules (default gpipe,1f1b,zb_h1)")
    ap.add_argument("--microbatches", type=csv_ints, default=[4, 8], help="microbatch counts (default 4,8)")
    ap.add_argument("--cost", type=csv_names, default=["flops", "profile"], help="cost models (default flops,profile)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--devices", type=csv_names, default=None, help="stage devices, cycled (default cpu)")
    ap.add_argument("--plots", default=os.path.join(HERE, "plots"), help="folder for the pictures")
    ap.add_argument("--prefix", default="api", help="file name prefix of the pictures (default api)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    model = gpt(layers=args.layers, dim=args.dim, vocab=1024, seq=64)
    tokens = torch.randint(0, 1024, (args.batch, 65))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if args.devices:
        model = model.to(args.devices[0])
        x, y = x.to(args.devices[0]), y.to(args.devices[0])
    plain = plain_step_s(model, x, y, args.warmup, args.repeats)
    res = pipesplit.benchmark(model, x, loss_fn=loss_fn, target=y, num_stages=args.stages, schedules=args.schedules,
                              num_microbatches=args.microbatches, cost=args.cost, devices=args.devices,
                              warmup=args.warmup, repeats=args.repeats)
    os.makedirs(args.plots, exist_ok=True)
    files = {
        "overview": res.plot(os.path.join(args.plots, f"{args.prefix}_overview.png")),
        "balance": res.plot_balance(os.path.join(args.plots, f"{args.prefix}_balance.png")),
        "timeline": res.plot_timeline(os.path.join(args.plots, f"{args.prefix}_timeline.png")),
        "trace": res.to_chrome_trace(os.path.join(args.plots, f"{args.prefix}_trace.json")),
    }
    rel = {k: os.path.relpath(v, HERE) for k, v in files.items()}
    best = res.best()
    emit(header("Benchmark API", notes=[
        f"model: `gpt(layers={args.layers}, dim={args.dim}, vocab=1024, seq=64)`, batch {args.batch} x 64 tokens, "
        f"next-token cross-entropy; torch threads: {args.torch_threads}; local executor (one thread per rank)",
        f"timing: {args.warmup} untimed then {args.repeats} timed steps per configuration; step times are medians "
        "± half the range; per-stage times are medians of the traced actions' compute (receive waits excluded)",
        f"baseline: the plain model's forward + backward on the same batch, {plain * 1e3:.1f} ms (median)",
    ]))
    emit()
    emit(res.to_markdown(per_stage=False))
    emit()
    emit(f"Fastest: {best.label}, {best.measured_step_s * 1e3:.1f} ms per step = "
         f"{best.measured_step_s / plain:.2f}x the plain model's step, {best.throughput:.4g} samples/s.")
    for what, why in res.skipped:
        emit(f"Skipped {what}: {why}")
    for warning in res.warnings:
        emit(f"**Warning:** {warning}")
    emit()
    emit("Prediction models against the same measured steps (meas/pred):")
    emit()
    rows = []
    for k in sorted({r.num_stages for r in res.rows}):
        for cost in args.cost:
            mine = [(r, d) for r, d in zip(res.rows, res.details) if r.num_stages == k and r.cost == cost]
            if mine:
                shared = [r.measured_step_s / r.predicted_step_s for r, _ in mine]
                busy = [r.measured_step_s / all_busy_step_s(d) for r, d in mine]
                rows.append([k, cost, len(mine), spread(shared), spread(busy)])
    emit(markdown_table(["stages", "cost", "rows", "processor sharing (the prediction)", "all busy (replaced)"],
                        rows, "llrll"))
    emit()
    emit(f"![step times and bubbles]({rel['overview']})")
    emit()
    emit(f"![stage balance]({rel['balance']})")
    emit()
    emit(f"![predicted vs measured timeline of the fastest configuration]({rel['timeline']})")
    emit()
    emit(f"Chrome / Perfetto trace of the fastest configuration's measured steps: [`{rel['trace']}`]({rel['trace']}).")
    emit()
    emit("Per-stage forward / backward times (ms per microbatch):")
    emit()

    def ms(xs: tuple[float, ...]) -> str:
        return " / ".join(f"{v * 1e3:.3g}" for v in xs)

    emit(markdown_table(
        ["stages", "schedule", "m", "cost", "pred F", "meas F", "pred B", "meas B"],
        [[r.num_stages, r.schedule, r.num_microbatches, r.cost, ms(r.predicted_fwd_s), ms(r.measured_fwd_s),
          ms(r.predicted_bwd_s), ms(r.measured_bwd_s)] for r in res.rows],
        "llll" + "r" * 4,
    ))


if __name__ == "__main__":
    main()
