"""``pipesplit demo``: split a built-in GPT, report, draw it, train a few pipeline steps, benchmark."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pipesplit.cli.commands import name_list
from pipesplit.units import human_seconds, phase_times


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def training_times(seconds: list[float]) -> str:
    """The training steps' times, the first apart: it starts the stage workers and runs every stage
    for the first time, which the benchmark's untimed warm-up step leaves out of its table."""
    first = f"step 1 (warm-up: first run of every stage) {human_seconds(seconds[0])}"
    if len(seconds) == 1:
        return first + ", optimizer included"
    rest = sorted(seconds[1:])
    middle = rest[len(rest) // 2] if len(rest) % 2 else (rest[len(rest) // 2 - 1] + rest[len(rest) // 2]) / 2
    which = "step 2" if len(seconds) == 2 else f"steps 2-{len(seconds)} median"
    return f"{first}, {which} {human_seconds(middle)}, optimizer included"


def run_demo(args: argparse.Namespace) -> int:
    import pipesplit
    from pipesplit.models import gpt

    if args.batch % args.microbatches:
        raise pipesplit.InputError(
            f"--batch {args.batch} does not split into --microbatches {args.microbatches} equal microbatches; "
            "make the batch a multiple of the microbatch count."
        )
    torch.manual_seed(0)
    vocab, seq = 1024, 64
    model = gpt(layers=args.layers, dim=args.dim, vocab=vocab, seq=seq)
    idx = torch.randint(0, vocab, (4, seq))
    print(f"pipesplit demo: a built-in GPT ({args.layers} blocks, width {args.dim}, tied embeddings) "
          f"into {args.stages} stages\n")
    prog = pipesplit.compile(model, idx, num_stages=args.stages)
    print(prog.report())
    print(f"compile: {phase_times(prog.timings)}")
    os.makedirs(args.out, exist_ok=True)  # the pictures of the program the report describes, before a new batch size
    dot_path = os.path.join(args.out, "split.dot")
    with open(dot_path, "w") as f:
        f.write(prog.to_dot())
    plan_path = os.path.join(args.out, "plan.json")
    prog.plan.save(plan_path)
    print(f"wrote {dot_path} and {plan_path}")
    if shutil.which("dot"):
        print(f"wrote {prog.render(os.path.join(args.out, 'split.svg'))}")
    else:
        print("graphviz's `dot` is not installed: skipped split.svg (apt-get install graphviz)")
    batch = torch.randint(0, vocab, (3, seq))
    diff = (prog(batch) - model(batch)).abs().max().item()
    print(f"\nmax |split - original| on a batch of 3 (compiled at 4, so captured once more with a dynamic batch): "
          f"{diff:.2e}")

    # a few training steps as a pipeline: the next-token loss on a fixed batch goes down
    tokens = torch.randint(0, vocab, (args.batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if args.steps > 0:
        pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=args.microbatches, loss_fn=_loss)
        opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
        losses, seconds = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            losses.append(float(pipe.step(x, target=y)))  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad()
            seconds.append(time.perf_counter() - start)
        print(f"\npipeline training (1f1b, {args.microbatches} microbatches of {args.batch // args.microbatches}): "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps; {training_times(seconds)}")

    if args.bench:
        print(f"\nbenchmark (batch {args.batch}, {args.microbatches} microbatches): each row times 2 steps after "
              "1 untimed warm-up step, without the optimizer; 'meas step ms' is their median, '± half their range'; "
              "time balance: the slowest stage's forward + backward time over the mean stage's")
        res = pipesplit.benchmark(prog, x, loss_fn=_loss, target=y, schedules=args.bench,
                                  num_microbatches=args.microbatches, warmup=1, repeats=2, progress=False)
        print(res.to_markdown(per_stage=False))
        best = res.best()
        print(f"fastest: {best.label}, {best.throughput:.4g} samples/s")
        for warning in res.warnings:
            print(f"note: {warning}")
        files: list[tuple[str, Callable[[str], Any]]] = [
            ("bench.csv", res.to_csv), ("timeline.png", res.plot_timeline), ("trace.json", res.to_chrome_trace)]
        for name, write in files:
            write(os.path.join(args.out, name))
        print(f"wrote {', '.join(os.path.join(args.out, n) for n, _ in files)} "
              "(predicted vs measured Gantt of the fastest; open trace.json in https://ui.perfetto.dev)")
    return 0


def add_demo(sub: Any, debug: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("demo", help="split a built-in GPT, print the report, write DOT/SVG, train and benchmark",
                       description="Split a built-in GPT-style model, print the per-stage report, write DOT/SVG and "
                                   "the plan, train a few pipeline steps and print a short benchmark table.")
    p.add_argument("--stages", type=int, default=4, help="number of pipeline stages (default 4)")
    p.add_argument("--layers", type=int, default=12, help="transformer blocks (default 12)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--batch", type=int, default=8, help="training batch, sequences of 64 tokens (default 8)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--steps", type=int, default=3, help="pipeline training steps (default 3; 0 skips)")
    p.add_argument("--bench", type=name_list, default=["gpipe", "1f1b", "zb_h1"], metavar="S[,S...]",
                   help="schedules to benchmark (default gpipe,1f1b,zb_h1; '' skips)")
    p.add_argument("--out", default="demo_out", help="folder for split.dot, split.svg, plan.json and the benchmark")
    debug(p)
    p.set_defaults(run=run_demo)
