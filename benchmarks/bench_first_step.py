"""The first step of ``Pipeline(..., compile=True)`` against ``torch.compile(model)``'s (issue 36, item 1).

Each measurement runs in a fresh process, with Inductor's cache (FX graph cache and AOT autograd
cache, both on by default in torch 2.13) in a folder of its own: "cold" is the first run with an
empty cache; "warm" is a second process on the same cache folder, as a user's second run of the same
program is. A step is forward and backward over the batch (m microbatches for the pipeline, the
whole batch at once for ``torch.compile(model)``); "later step" is the third step, compiled code
only. "graphs" counts what pipesplit compiled in the first step (its first calls); AOT autograd
compiles each backward graph at its first call inside the step, so it is in the step's time.

    python benchmarks/bench_first_step.py                              # every schedule (minutes on a CPU)
    python benchmarks/bench_first_step.py --schedules 1f1b,zb_h1        # a few
    python benchmarks/bench_first_step.py --layers 2 --dim 32 --seq 16 --vocab 128   # a smaller model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, markdown_table  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v", "dualpipe_v"]
V_SHAPED = {"interleaved_1f1b", "looped_bfs", "zb_v", "dualpipe_v"}  # 2 stages per rank: 4 stages on 2 ranks
LAYERS, DIM, SEQ, VOCAB, BATCH, MICRO = 4, 64, 32, 512, 8, 4
SIZES = ("layers", "dim", "seq", "vocab")


def _one(what: str, layers: int = LAYERS, dim: int = DIM, seq: int = SEQ, vocab: int = VOCAB) -> dict[str, float]:
    """In this process: three steps of ``what`` (a schedule or "torch.compile"), timed."""
    import warnings

    import torch
    import torch.nn.functional as F

    import pipesplit
    from pipesplit.models import gpt

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq)
    tokens = torch.randint(0, vocab, (BATCH, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    graphs = 0.0
    if what == "torch.compile":
        compiled = torch.compile(model)

        def step() -> None:
            loss_fn(compiled(x), y).backward()
    else:
        stages, ranks = (4, 2) if what in V_SHAPED else (2, None)
        prog = pipesplit.compile(model, x[: BATCH // MICRO], num_stages=stages, progress=False)  # one microbatch
        pipe = pipesplit.Pipeline(prog, what, num_microbatches=MICRO, num_ranks=ranks, loss_fn=loss_fn, compile=True,
                                  progress=False)

        def step() -> None:
            pipe.step(x, target=y)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if what != "torch.compile":
        graphs = float(len(pipe.compiler._timed)) if pipe.compiler is not None else 0.0  # first calls compiled
    return {"first": times[0], "later": times[2], "graphs": graphs}


def _run(what: str, cache: str, sizes: list[str]) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", what, *sizes], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--one", help=argparse.SUPPRESS)
    for size, default in zip(SIZES, (LAYERS, DIM, SEQ, VOCAB)):
        p.add_argument(f"--{size}", type=int, default=default, help=f"the GPT's {size} (default {default})")
    args = p.parse_args()
    given = {size: getattr(args, size) for size in SIZES}
    sizes = [item for size in SIZES for item in (f"--{size}", str(given[size]))]
    if args.one:
        print(json.dumps(_one(args.one, **given)))
        return
    whats = ["torch.compile"] + [s for s in args.schedules.split(",") if s]
    emit(header("First step under compile=True against torch.compile(model)", notes=[
        f"model: pipesplit.models.gpt({', '.join(f'{k}={v}' for k, v in given.items())}); batch {BATCH}, "
        f"{MICRO} microbatches; 2 stages (4 on 2 ranks for {', '.join(sorted(V_SHAPED))}), compiled on one microbatch",
        "cold: a fresh process and an empty Inductor cache folder; warm: a second fresh process on that folder",
    ]))
    rows, base_cold = [], None
    for what in whats:
        with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
            cold = _run(what, cache, sizes)
            warm = _run(what, cache, sizes)
        base = "" if what == "torch.compile" else f"{int(cold['graphs'])}"
        base_cold = cold["first"] if what == "torch.compile" else base_cold
        ratio = f"{cold['first'] / base_cold:.2f}x" if base_cold else ""
        rows.append([what, base, f"{cold['first']:.1f} s", f"{warm['first']:.1f} s", ratio,
                     f"{1e3 * cold['later']:.0f} ms"])
        emit(f"  {what}: first step {cold['first']:.1f} s cold, {warm['first']:.1f} s warm")
    emit("")
    emit(markdown_table(["", "graphs compiled", "first step, cold cache", "first step, warm cache",
                         "cold / torch.compile's cold", "later step"], rows))


if __name__ == "__main__":
    main()
