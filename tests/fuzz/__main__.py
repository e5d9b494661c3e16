"""``python -m tests.fuzz --minutes N --seed S``: fuzz for N minutes, print what ran, the pairs of features
reached, and every failure's repro."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from tests.fuzz.check import STEERED, FuzzFailure, Stats, draw_case, run, shrink
from tests.fuzz.coverage import Coverage
from tests.fuzz import configs
from tests.fuzz.configs import KNOWN


def one_case(force: frozenset[str], case_seed: int, stats: Stats, coverage: Coverage | None = None,
             max_layers: int = 8, include_known: bool = False, shrink_s: float = 120.0) -> str:
    """One case drawn from a seeded random with the features ``force`` names; a failure is shrunk
    (check.shrink) and raised as a FuzzFailure with the smaller case's repro."""
    spec, cfg = draw_case(case_seed, force, max_layers)
    try:
        return run(spec, cfg, stats=stats, include_known=include_known, coverage=coverage,
                   label=f"case seed {case_seed} (forced {','.join(sorted(force)) or 'nothing'})")
    except FuzzFailure as e:
        first = str(e).partition("\n")[0]
        small = shrink(spec, cfg, first, shrink_s)
        try:
            run(*small, include_known=include_known)
        except FuzzFailure as again:
            raise again from e
        raise


def fuzz(minutes: float, seed: int, include_known: bool = False, max_layers: int = 8,
         out_dir: str | None = None, coverage: Coverage | None = None, first_failure: bool = False) -> Stats:
    """Cases until the time is up, each forced to have the pair of features least reached so far
    (tests/fuzz/coverage.py); a failure is shrunk, its repro kept (one per distinct first line), and
    the next case goes on."""
    stats, deadline = Stats(), time.monotonic() + 60 * minutes
    coverage = coverage if coverage is not None else Coverage(seed)
    case = 0
    while time.monotonic() < deadline:
        case += 1
        try:
            one_case(coverage.next_force(), seed * 100_000 + case, stats, coverage, max_layers, include_known,
                     shrink_s=0.0 if first_failure else 120.0)
        except FuzzFailure as e:
            first, _, rest = str(e).partition("\n")
            print(f"FAILURE (shrunk): {first}\n{rest.split('---- repro')[0]}", flush=True)
            stats.failures.setdefault(first, rest.split("---- repro (python repro.py) ----\n", 1)[1])
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                path = os.path.join(out_dir, f"repro_seed{seed}_case{case}.py")
                with open(path, "w") as f:
                    f.write(rest.split("---- repro (python repro.py) ----\n", 1)[1])
                print(f"repro written to {path}", flush=True)
            if first_failure:
                print(f"stopped at the first failure, case {case}, after {time.monotonic() - stats.started:.0f} s",
                      flush=True)
                break
        except BaseException as e:  # e.g. an ExceptionGroup of several failures: keep going
            if isinstance(e, KeyboardInterrupt):
                raise
            print(f"case {case}: {type(e).__name__}: {str(e)[:500]}", flush=True)
        if case % 20 == 0:
            print(f"{case} draws: {stats.ran} cases so far, {len(coverage.unreached())} pairs unreached", flush=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--include-known", action="store_true", help="draw the KNOWN defects' combinations too")
    p.add_argument("--max-layers", type=int, default=8)
    p.add_argument("--compile-share", type=int, default=configs.COMPILE_SHARE,
                   help="one free draw in N runs compiled stages (compile=aot_eager); 1: every case "
                        "(the forced draws compile where their pair asks for it)")
    p.add_argument("--first-failure", action="store_true",
                   help="stop at the first failure, unshrunk (tests/fuzz/mutants.py: time to kill)")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "pipesplit-fuzz"),
                   help="folder for the repro scripts of failures")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    configs.COMPILE_SHARE = args.compile_share
    coverage = Coverage(args.seed)
    stats = fuzz(args.minutes, args.seed, args.include_known, args.max_layers, args.out, coverage,
                 args.first_failure)
    print("\n" + stats.summary())
    if stats.largest[2] and args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"largest_error_seed{args.seed}.py")
        with open(path, "w") as f:
            f.write(stats.largest[2])
        print(f"the largest passing error's case, as a script: {path}")
    print(coverage.summary())
    print(f"\nKNOWN table ({len(KNOWN)} entries{', drawn anyway' if args.include_known else ', steered around'}); "
          "draws steered off, by entry:")
    for why in KNOWN.values():
        print(f"  {STEERED[why]:6d}  {why}")
    for i, (first, text) in enumerate(stats.failures.items()):
        print(f"\n==== failure {i}: {first}\n{text}")
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
