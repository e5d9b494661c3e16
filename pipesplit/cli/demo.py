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
from pipesplit.units import phase_times


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


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
    batch = torch.randint(0, vocab, (3, seq))
    diff = (prog(batch) - model(batch)).abs().max().item()
    print(f"\nmax |split - original| on a batch of 3: {diff:.2e}")
    print(f"compile: {phase_times(prog.timings)}")
    os.makedirs(args.out, exist_ok=True)
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

    # a few training steps as a pipeline: the next-token loss on a fixed batch goes down
    tokens = torch.randint(0, vocab, (args.batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if args.steps > 0:
        pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=args.microbatches, loss_fn=_loss)
        opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
        losses, start = [], time.perf_counter()
        for _ in range(args.steps):
            losses.append(float(pipe.step(x, target=y)))  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad()
        per_step = (time.perf_counter() - start) / args.steps
        print(f"\npipeline training (1f1b, {args.microbatches} microbatches of {args.batch // args.microbatches}): "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps, {per_step * 1e3:.0f} ms/step")

    if args.bench:
        print(f"\nbenchmark (batch {args.batch}, {args.microbatches} microbatches; medians of 2 steps):")
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
