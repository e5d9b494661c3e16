"""The ``pipesplit`` command line: ``pipesplit demo`` and friends."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import traceback

import torch

from pipesplit.errors import PipesplitError


def _demo(args: argparse.Namespace) -> int:
    import pipesplit
    from pipesplit.models import gpt

    torch.manual_seed(0)
    model = gpt(layers=args.layers, dim=args.dim, vocab=1024, seq=64)
    idx = torch.randint(0, 1024, (4, 64))
    print(f"pipesplit demo: a built-in GPT ({args.layers} blocks, width {args.dim}, tied embeddings) "
          f"into {args.stages} stages\n")
    prog = pipesplit.compile(model, idx, num_stages=args.stages)
    print(prog.report())
    batch = torch.randint(0, 1024, (3, 64))
    diff = (prog(batch) - model(batch)).abs().max().item()
    print(f"\nmax |split - original| on a batch of 3: {diff:.2e}")
    t = prog.timings
    print(f"compile: export {t['export']:.2f}s, annotate {t['annotate'] * 1e3:.1f} ms, "
          f"plan {t['plan'] * 1e3:.1f} ms, split {t['split'] * 1e3:.1f} ms")
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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipesplit", description="Split PyTorch models into pipeline stages.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="split a built-in GPT, print the report, write DOT/SVG")
    demo.add_argument("--stages", type=int, default=4, help="number of pipeline stages (default 4)")
    demo.add_argument("--layers", type=int, default=12, help="transformer blocks (default 12)")
    demo.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    demo.add_argument("--out", default="demo_out", help="folder for split.dot, split.svg, plan.json")
    # also accepted after the command; SUPPRESS keeps a `--debug` given before it
    demo.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks on errors")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        return int(args.run(args))
    except PipesplitError as e:
        if args.debug:
            traceback.print_exc()
        print(f"pipesplit: error: {e}", file=sys.stderr)
        if not args.debug:
            print("hint: run with --debug for the full traceback", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
