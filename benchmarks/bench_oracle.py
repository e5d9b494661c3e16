"""Is the planner's split the fastest one when measured? Every module-boundary split, timed.

For each model, every split into 2 stages at a top-level module boundary (before each
block, before the final norm, before the head) is compiled with ``split_points=`` and its
bottleneck stage timed: forward + fused backward of one microbatch, CPU time
(``measure_stage_costs(..., clock="cpu")``), min of 3 per round, median over interleaved
rounds (every candidate once per round, so a change in load hits all alike). The splits
that ``pipesplit.compile`` chooses with the default cost, with the cost priced at measured
device rates (``pipesplit.passes.annotate.rates``; what the default would become), and with
``cost="profile"`` are located among the candidates (or timed too when they cut inside a
block). Reported: how much slower each choice's bottleneck is than the best measured split,
against the noise floor (the best split's spread over the rounds).

Prints markdown (paste into benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, markdown_table  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from pipesplit.passes.annotate.rates import device_rates, priced  # noqa: E402
from pipesplit.runtime.engine.measure import measure_stage_costs  # noqa: E402


def models(quick: bool) -> list[tuple[str, torch.nn.Module, torch.Tensor]]:
    vocab, seq = 8192, 64
    out = [(f"GPT 8 blocks, width 256, head {vocab}", gpt(layers=8, dim=256, vocab=vocab, seq=seq),
            torch.randint(0, vocab, (8, seq)))]
    if not quick:
        out.append((f"GPT 12 blocks, width 192, head {vocab}", gpt(layers=12, dim=192, vocab=vocab, seq=seq),
                    torch.randint(0, vocab, (8, seq))))
        out.append(("GPT 6 blocks, width 384, head 32000", gpt(layers=6, dim=384, vocab=32000, seq=32),
                    torch.randint(0, 32000, (8, 32))))
    return out


def boundaries(model: torch.nn.Module) -> list[str]:
    """Top-level module boundaries a 2-stage split can start its second stage at."""
    names = [f"blocks.{i}" for i in range(1, len(model.blocks))]  # type: ignore[arg-type]
    return names + ["ln_f", "head"]


def bottleneck(prog: pipesplit.SplitProgram, x: torch.Tensor, m: int, clock: str = "cpu") -> float:
    costs = measure_stage_costs(prog, x, num_microbatches=m, repeats=3, warmup=1, reduce="min", backward="fused",
                                clock=clock)
    return max(c.forward + c.backward_input + c.backward_weight for c in costs)


def oracle(model: torch.nn.Module, x: torch.Tensor, microbatches: int, rounds: int, chosen_costs: dict[str, object],
           devices: list[str] | None = None, clock: str = "cpu") -> dict[str, Any]:
    """Every 2-stage module-boundary split of ``model`` and the planner's choices (one per cost in
    ``chosen_costs``, label -> ``cost=``), bottlenecks timed in interleaved rounds. Returns the
    medians per split (seconds), where each choice landed, the best split and its spread."""
    mb = x[: x.shape[0] // microbatches]
    opts = dict(progress=False, devices=devices)
    candidates = {f"at {b}": pipesplit.compile(model, mb, split_points=[b], **opts) for b in boundaries(model)}
    chosen = {label: pipesplit.compile(model, mb, num_stages=2, cost=cost, **opts) for label, cost in chosen_costs.items()}
    by_sig = {signature(prog): label for label, prog in candidates.items()}
    timed = dict(candidates)
    where = {}
    for label, prog in chosen.items():
        where[label] = by_sig.get(signature(prog))
        if where[label] is None:  # cuts inside a block: time it as a candidate of its own
            where[label] = f"{label}: {signature(prog)} nodes"
            timed[where[label]] = prog
    samples: dict[str, list[float]] = {k: [] for k in timed}
    for r in range(rounds):
        order = list(timed) if r % 2 == 0 else list(reversed(timed))
        for k in order:
            samples[k].append(bottleneck(timed[k], x, microbatches, clock))
    med = {k: statistics.median(v) for k, v in samples.items()}
    best = min(med, key=med.get)  # type: ignore[arg-type]
    b = samples[best]
    return {"median_s": med, "where": where, "best": best, "noise": (max(b) - min(b)) / 2 / med[best]}


def signature(prog: pipesplit.SplitProgram) -> tuple[int, ...]:
    return tuple(len(s) for s in prog.plan.stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="one model, 3 rounds")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rounds = 3 if args.quick else args.rounds
    rates = device_rates("cpu")
    rows = []
    for name, model, x in models(args.quick):
        costs = {"default (FLOPs)": "flops", "measured rates": lambda n: sum(priced(n, rates)), "profile": "profile"}
        found = oracle(model, x, args.microbatches, rounds, costs)
        med, where, best, noise = found["median_s"], found["where"], found["best"], found["noise"]
        for label in costs:
            k = where[label]
            rows.append([name, label, k, f"{med[k] * 1e3:.1f}", best, f"{med[best] * 1e3:.1f}",
                         f"{(med[k] / med[best] - 1) * 100:+.1f}%", f"±{noise * 100:.1f}%"])
        emit(f"  {name}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(med.items(), key=lambda kv: kv[1])))
    emit(header("Splits that are best when measured", notes=[
        f"{rounds} interleaved rounds, {args.microbatches} microbatches, bottleneck stage forward + backward of one "
        "microbatch, CPU time, min of 3 per round, median over rounds",
        f"measured rates: {rates.describe()}"]))
    emit()
    emit(markdown_table(["model", "planner cost", "its split", "bottleneck ms", "best measured split", "best ms",
                         "slower than best", "noise (best's spread)"], rows, align="lllrlrrr"))


if __name__ == "__main__":
    main()
