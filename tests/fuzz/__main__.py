"""``python -m tests.fuzz --minutes N --seed S``: fuzz for N minutes, print what ran and every failure's repro."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

from tests.fuzz.check import STEERED, FuzzFailure, Stats, cases, run
from tests.fuzz import configs
from tests.fuzz.configs import KNOWN


def fuzz(minutes: float, seed: int, include_known: bool = False, max_layers: int = 8,
         out_dir: str | None = None) -> Stats:
    """Rounds of hypothesis runs, a seed each, until the time is up; a failure is shrunk, its
    repro kept (one per distinct first line), and the next round goes on."""
    stats, deadline = Stats(), time.monotonic() + 60 * minutes
    round_ = 0
    while time.monotonic() < deadline:
        round_ += 1

        @hseed(seed * 1000 + round_)
        @settings(max_examples=10_000, deadline=None, database=None, print_blob=False, report_multiple_bugs=False,
                  suppress_health_check=list(HealthCheck),
                  phases=[Phase.generate, Phase.target, Phase.shrink])
        @given(cases(max_layers=max_layers, include_known=include_known))
        def one(case):
            if time.monotonic() >= deadline:
                return
            run(*case, stats=stats, include_known=include_known)

        try:
            one()
        except FuzzFailure as e:
            first, _, rest = str(e).partition("\n")
            print(f"FAILURE (shrunk): {first}\n{rest.split('---- repro')[0]}", flush=True)
            stats.failures.setdefault(first, rest.split("---- repro (python repro.py) ----\n", 1)[1])
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                path = os.path.join(out_dir, f"repro_seed{seed}_round{round_}.py")
                with open(path, "w") as f:
                    f.write(rest.split("---- repro (python repro.py) ----\n", 1)[1])
                print(f"repro written to {path}", flush=True)
        except BaseException as e:  # e.g. an ExceptionGroup of several failures: keep going
            if isinstance(e, KeyboardInterrupt):
                raise
            print(f"round {round_}: {type(e).__name__}: {str(e)[:500]}", flush=True)
        print(f"round {round_} done: {stats.ran} cases so far", flush=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--include-known", action="store_true", help="draw the KNOWN defects' combinations too")
    p.add_argument("--max-layers", type=int, default=8)
    p.add_argument("--compile-share", type=int, default=configs.COMPILE_SHARE,
                   help="one case in N runs compiled stages (compile=aot_eager); 1: every case")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "pipesplit-fuzz"),
                   help="folder for the repro scripts of failures")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    configs.COMPILE_SHARE = args.compile_share
    stats = fuzz(args.minutes, args.seed, args.include_known, args.max_layers, args.out)
    print("\n" + stats.summary())
    print(f"\nKNOWN table ({len(KNOWN)} entries{', drawn anyway' if args.include_known else ', steered around'}); "
          "draws steered off, by entry:")
    for why in KNOWN.values():
        print(f"  {STEERED[why]:6d}  {why}")
    for i, (first, text) in enumerate(stats.failures.items()):
        print(f"\n==== failure {i}: {first}\n{text}")
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
