"""Compiled stages against the anchors a user would use instead (issue 25, item 4).

One step of training (m microbatches, loss + backward) on one device, timed in interleaved
rounds, each variant against baselines measured in the same run:

- the plain model, eager, accumulating gradients over the same m microbatches;
- ``torch.compile(model)`` accumulating the same way (the anchor for compiled stages);
- pipesplit's Pipeline with eager stages, and with ``compile=True`` (each stage's forward and
  the backward AOT autograd derives from it compiled by ``torch.compile``), at 1 stage (1f1b)
  and 4 stages (gpipe, 1f1b, zb_h1; zb_h1's stages run as compiled F, I and W graphs, see
  ``pipesplit.runtime.graphs.stage_graphs``).

Models: a dispatch-bound GPT (12 blocks of width 8: the step is Python and dispatch) and a
12 x 768 GPT (the step is matrix multiplies). Every variant's loss is checked against the plain
model's before timing (the "loss rel. diff." column). Compile time is the first call's, per
variant (stages summed), and is not in the step times.

    python benchmarks/bench_compiled.py            # both models, Inductor (minutes of compiling on a CPU)
    python benchmarks/bench_compiled.py --quick    # small models, few rounds
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, markdown_table, round_robin  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.models import gpt  # noqa: E402

MODELS = {  # name: (layers, dim, heads, vocab, seq, batch)
    "dispatch": (12, 8, 2, 64, 16, 8),
    "gpt768": (12, 768, 12, 1024, 32, 8),
}
QUICK = {"dispatch": (4, 8, 2, 64, 16, 8), "gpt768": (2, 256, 4, 512, 32, 8)}
PIPES = [(1, "1f1b"), (4, "gpipe"), (4, "1f1b"), (4, "zb_h1")]


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def accumulate(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    net.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        loss = ce(net(xs), ys)
        loss.backward()
        total += loss.detach()
    return total


def bench_model(name: str, dims: tuple[int, ...], m: int, rounds: int, options: dict[str, Any],
                pipes: list[tuple[int, str]]) -> str:
    layers, dim, heads, vocab, seq, batch = dims
    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, heads=heads, vocab=vocab, seq=seq)
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    plain, anchor = copy.deepcopy(model), torch.compile(copy.deepcopy(model), **options)
    fns: dict[str, Callable[[], Any]] = {
        "plain model (eager)": lambda: accumulate(plain, x, y, m),
        "torch.compile(model)": lambda: accumulate(anchor, x, y, m),  # type: ignore[arg-type]
    }
    compile_s: dict[str, float] = {}
    start = time.perf_counter()
    fns["torch.compile(model)"]()
    compile_s["torch.compile(model)"] = time.perf_counter() - start
    progs = {k: pipesplit.compile(model, x[: batch // m], num_stages=k, progress=False) for k in sorted({k for k, _ in pipes})}
    for stages, schedule in pipes:
        for compiled in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # zb_h1's eager stages under compile=True
                pipe = pipesplit.Pipeline(progs[stages], schedule, num_microbatches=m, loss_fn=ce, loss_reduction="sum",
                                          compile=options if compiled else False)
            label = f"pipesplit {stages} stage{'s' * (stages > 1)}, {schedule}, {'compiled' if compiled else 'eager'}"

            def step(pipe: Any = pipe) -> Any:
                pipe.zero_grad(set_to_none=True)
                return pipe.step(x, target=y)

            start = time.perf_counter()
            step()
            if compiled:
                compile_s[label] = time.perf_counter() - start
            fns[label] = step
    want = accumulate(plain, x, y, m).item()
    diffs = {k: abs(float(fn()) - want) / abs(want) for k, fn in fns.items()}
    times = round_robin(fns, rounds, warmup=1)  # warm: every variant once more before timing
    med = {k: statistics.median(v) for k, v in times.items()}
    base, comp = med["plain model (eager)"], med["torch.compile(model)"]
    rows = [[k, f"{v * 1e3:.2f}", f"{v / base:.3f}", f"{v / comp:.3f}",
             f"{statistics.median(a / b for a, b in zip(times[k], times['torch.compile(model)'])):.3f}",
             f"{compile_s[k]:.1f}" if k in compile_s else "", f"{diffs[k]:.1e}"] for k, v in med.items()]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    title = (f"### {name}: GPT {layers} blocks x {dim}, vocab {vocab}, {batch} x {seq} tokens, {m} microbatches "
             f"({params:.2f} M parameters)")
    table = markdown_table(["step", "ms (median)", "x plain", "x torch.compile", "paired x torch.compile",
                            "compile s (first step)", "loss rel. diff."], rows, "lrrrrrr")
    return f"{title}\n\n{table}\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller models, 3 rounds")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, help="timed rounds (default 15, quick 3)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--pipes", default=",".join(f"{k}:{s}" for k, s in PIPES),
                    help="comma-separated stages:schedule (e.g. 1:1f1b with --microbatches 1: the host overhead)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor; aot_eager to test the script)")
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    rounds = args.rounds or (3 if args.quick else 15)
    options = {"backend": args.backend}
    emit(header("Compiled stages against the plain model and torch.compile (issue 25)", notes=[
        f"{rounds} interleaved rounds, medians; one device (CPU), torch threads {args.torch_threads}; "
        f"torch.compile options {options}; compile time is the first step's and not in the step times"]))
    emit()
    for name in args.models.split(","):
        pipes = [(int(k), sch) for k, sch in (p.split(":") for p in args.pipes.split(","))]
        emit(bench_model(name, (QUICK if args.quick else MODELS)[name], args.microbatches, rounds, options, pipes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
