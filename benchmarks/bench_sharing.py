"""Rank threads sharing the CPU: how much slower an action runs beside others, and which
simulation of the sharing predicts the step.

Runs the built-in GPT as a pipeline on the local executor (one thread per rank), traces
some steps, and for every traced action measures the time-averaged number of other ranks
computing beside it. Each action's time is divided by its stage's time alone
(``measure_stage_costs``, the baseline measured in the same run) and grouped by that number,
next to ``concurrent_slowdown(n)``, the slowdown the prediction assumes. Then the measured
stage times alone are fed to two simulations of the step: processor sharing
(``simulate_shared``, what ``pipesplit.benchmark`` predicts with) and every action slowed by
all the ranks at once (the model it replaced); both are read against the measured step.

    python benchmarks/bench_sharing.py                       # 4 stages, gpipe and 1f1b, m = 8
    python benchmarks/bench_sharing.py --stages 2 --torch-threads 2
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, markdown_table  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from pipesplit.passes.annotate.rates import concurrent_slowdown  # noqa: E402
from pipesplit.runtime.engine.measure import measure_stage_costs  # noqa: E402
from pipesplit.schedules import StageCost, simulate  # noqa: E402
from pipesplit.schedules.shared import simulate_shared  # noqa: E402


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def beside(trace: pipesplit.runtime.engine.trace.Trace, alone: list[StageCost]) -> dict[int, list[float]]:
    """Per number of other ranks computing alongside (time-averaged, rounded): each action's time
    over its stage's time alone."""
    by_step = collections.defaultdict(list)
    for r in trace.records:
        if r.action.is_compute and r.end > r.ready:
            by_step[r.step].append(r)
    out: dict[int, list[float]] = collections.defaultdict(list)
    for records in by_step.values():
        for r in records:
            others = sum(max(0.0, min(r.end, o.end) - max(r.ready, o.ready))
                         for o in records if o.rank != r.rank) / (r.end - r.ready)
            c = alone[r.action.stage]
            base = c.forward if r.action.kind.name == "FORWARD" else c.backward
            if base > 0:
                out[round(others)].append((r.end - r.ready) / base)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="traced steps per schedule (default 6)")
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    model = gpt(layers=8, dim=128, vocab=1024, seq=64)
    tokens = torch.randint(0, 1024, (16, 65))
    x, y = tokens[:, :-1], tokens[:, 1:]
    prog = pipesplit.compile(model, x, num_stages=args.stages, progress=False)
    slowdowns = {n: concurrent_slowdown(n) for n in range(1, args.stages + 1)}
    rows, grouped = [], []
    for name in args.schedules.split(","):
        pipe = pipesplit.Pipeline(prog, name, num_microbatches=args.microbatches, loss_fn=loss_fn)
        for _ in range(3):
            pipe.step(x, target=y)
            pipe.zero_grad()
        alone = measure_stage_costs(prog, x, num_microbatches=args.microbatches, repeats=9, warmup=2,
                                    backward="fused", loss_fn=loss_fn, target=y)
        with pipe.trace() as tr:
            for _ in range(args.steps):
                pipe.step(x, target=y)
                pipe.zero_grad()
        for n, ratios in sorted(beside(tr, alone).items()):
            grouped.append([name, n, len(ratios), f"{statistics.median(ratios):.2f}",
                            f"{slowdowns.get(n + 1, float('nan')):.2f}"])
        s = pipe.schedule
        measured = statistics.median(tr.step_time(i) for i in range(tr.num_steps))
        shared = simulate_shared(s, alone, slowdown=concurrent_slowdown)
        f = slowdowns[s.num_ranks]
        busy = simulate(s, [StageCost(c.forward * f, c.backward_input * f, c.backward_weight * f) for c in alone])
        rows.append([name, f"{measured * 1e3:.1f}", f"{measured / shared.step_time:.2f}",
                     f"{measured / busy.step_time:.2f}",
                     f"{tr.timeline().bubble_fraction:.0%} / {shared.bubble_fraction:.0%} / {busy.bubble_fraction:.0%}"])
    emit(header("Rank threads sharing the CPU", "python benchmarks/bench_sharing.py", notes=[
        f"model: the built-in GPT (8 blocks, width 128), {args.stages} stages, m = {args.microbatches}, "
        f"batch 16 x 64 tokens; {args.torch_threads} torch thread(s) per rank; {args.steps} traced steps",
        "baseline: each stage's time alone, `measure_stage_costs(backward=\"fused\")`, median of 9, same run",
    ]))
    emit()
    emit(markdown_table(["schedule", "other ranks computing", "actions", "time / alone (median)",
                         "concurrent_slowdown(others + 1)"], grouped, "lrrrr"))
    emit()
    emit(markdown_table(["schedule", "measured step ms", "meas / processor sharing", "meas / all busy",
                         "bubble meas / sharing / all busy"], rows, "lrrrr"))


if __name__ == "__main__":
    main()
