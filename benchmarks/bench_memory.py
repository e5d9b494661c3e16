"""Predicted against measured per-stage peak memory and step time, without, with some and with full checkpointing.

A built-in GPT (8 blocks, width 256, sequence 128, microbatches of 4) is compiled into 4 stages
under a schedule and ``checkpoint=False``, a partial list and ``True``; the plan's figures
(``prog.plan.stage_memory_bytes``, ``prog.plan.predicted_step_s``, priced by the default
``cost="flops"`` at this CPU's measured rates: what a user gets) are set against a real
training step of ``pipesplit.Pipeline`` with Adam (:mod:`pipesplit.bench.stage_memory`):

- memory: every storage each stage's thread allocates, live from creation to free (activations
  saved for the backward, gradients, a backward's scratch, received values copied into the
  receiver's own buffer as between devices), at its peak over the step, plus parameters and
  Adam's state; exact, not sampled;
- step: the planner assumes a device per stage, which a 2-core machine shared by others does
  not have, so each action's CPU seconds on its rank's thread (``time.thread_time``, one torch
  thread: preemption by other processes not counted) are measured, and their medians run
  through the schedule; the wall step of the local executor (its stages sharing this machine's
  cores) is shown too.

With ``--torchrun`` each configuration also runs under torchrun, one rank per stage on gloo, and
each rank's peak (every storage the process allocates during a step: receive buffers posted ahead,
sends not yet let go of; plus its parameters and Adam's state) is set against the same figure.

    python benchmarks/bench_memory.py                  # 1f1b and gpipe, ~5 minutes on 2 busy cores
    python benchmarks/bench_memory.py --schedules zb_h1 --torchrun
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.bench.stage_memory import measure_pipeline, measure_rank, measured_step  # noqa: E402
from pipesplit.models import gpt  # noqa: E402

MODES: list[tuple[str, Any]] = [("none", False), ("partial [0, 1]", [0, 1]), ("first blocks {0: 1, 1: 1}", {0: 1, 1: 1}),
                                ("full", True)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def build(schedule: str, mode: Any, a: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """The compiled GPT, its Pipeline, Adam and the step's batches for one configuration."""
    torch.manual_seed(0)
    model = gpt(layers=a.layers, dim=a.dim, vocab=a.vocab, seq=a.seq, heads=4)
    example = torch.randint(0, a.vocab, (a.microbatch, a.seq))  # one microbatch, as compile takes it
    prog = pipesplit.compile(model, example, num_stages=a.stages, schedule=schedule, num_microbatches=a.microbatches,
                             checkpoint=mode, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=a.microbatches, loss_fn=loss_fn, timeout=600)
    optimizer = torch.optim.Adam(pipe.parameters())
    rows = a.microbatches * a.microbatch

    def batch(i: int) -> tuple[tuple[Any, ...], Any]:
        g = torch.Generator().manual_seed(i)
        return (torch.randint(0, a.vocab, (rows, a.seq), generator=g),), torch.randint(0, a.vocab, (rows, a.seq),
                                                                                      generator=g)

    return prog, pipe, optimizer, batch


def rank_worker(schedule: str, mode: Any, a: argparse.Namespace) -> None:
    """Under torchrun: this rank's measured peak; rank 0 prints every rank's as one JSON line."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    _, pipe, optimizer, batch = build(schedule, mode, a)
    peak = measure_rank(pipe, batch, dist.get_rank(), optimizer=optimizer, memory_steps=a.memory_steps)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        print("RANK_PEAKS " + json.dumps(peaks), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def torchrun_peaks(schedule: str, mode: Any, argv: list[str], stages: int) -> list[int]:
    """Each rank's peak of this configuration, one rank per stage under torchrun (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}",
           os.path.abspath(__file__), *argv, "--rank-worker", schedule, json.dumps(mode)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    found = re.search(r"RANK_PEAKS (\[.*\])", out.stdout)
    if found is None:
        raise RuntimeError(f"torchrun run of {schedule} {mode} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    return [int(x) for x in json.loads(found.group(1))]


def run(schedule: str, mode: Any, a: argparse.Namespace, argv: list[str]) -> list[list[Any]]:
    prog, pipe, optimizer, batch = build(schedule, mode, a)

    got = measure_pipeline(pipe, batch, optimizer=optimizer, memory_steps=a.memory_steps, timed_steps=a.steps)
    predicted_step = prog.plan.predicted_step_s or 0.0
    step = measured_step(pipe, got)
    wall = statistics.median(got.wall_steps) if got.wall_steps else 0.0
    ranks = torchrun_peaks(schedule, mode, argv, a.stages) if a.torchrun else [0] * a.stages
    out = []
    for s, (pred, meas, rank) in enumerate(zip(prog.plan.stage_memory_bytes, got.peak, ranks)):
        first = s == 0
        head = prog.plan.checkpoint_partial.get(s) if prog.plan.checkpoint_partial else None
        out.append([
            schedule if first else "", describe(prog.plan.checkpoint, prog.plan.checkpoint_partial, a.stages) if first
            else "", s, "yes" if s in prog.plan.checkpoint else f"{head} nodes" if head else "",
            f"{pred / 2**20:.1f}", f"{meas / 2**20:.1f}", f"{meas / pred:.3f}",
            f"{rank / 2**20:.1f}" if a.torchrun else "", f"{rank / pred:.3f}" if a.torchrun else "",
            f"{predicted_step:.3f}" if first else "", f"{step:.3f}" if first else "",
            f"{predicted_step / step:.3f}" if first else "", f"{wall:.2f}" if first else "",
        ])
    return out


def describe(ckpt: list[int], partial: dict[int, int] | None, k: int) -> str:
    if partial:
        return "first blocks of " + ", ".join(f"stage {s}" for s in sorted(partial))
    return "none" if not ckpt else "full" if len(ckpt) == k else f"partial {ckpt}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedules", default="1f1b,gpipe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps (medians of their actions)")
    p.add_argument("--memory-steps", type=int, default=2)
    p.add_argument("--modes", default="none,partial,blocks,full", help="of none, partial, blocks, full")
    p.add_argument("--torchrun", action="store_true", help="also measure each rank under torchrun (gloo)")
    p.add_argument("--rank-worker", nargs=2, metavar=("SCHEDULE", "MODE"), help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.rank_worker:
        mode = json.loads(a.rank_worker[1])
        rank_worker(a.rank_worker[0], {int(k): v for k, v in mode.items()} if isinstance(mode, dict) else mode, a)
        sys.stdout.flush()
        os._exit(0)  # gloo may abort a rank at interpreter exit once all is done (see tests/launch.py)
    child = [x for x in argv if x != "--torchrun"]
    from benchmarks.common import header, markdown_table

    print(header("Predicted against measured stage memory and step (issue 32)", notes=[
        f"GPT {a.layers} blocks, width {a.dim}, vocab {a.vocab}, sequence {a.seq}; {a.stages} stages, "
        f"{a.microbatches} microbatches of {a.microbatch}; Adam; memory in MiB (exact: every storage a stage's "
        "thread allocates, plus parameters and Adam's state); step in s: predicted = plan.predicted_step_s, "
        "measured = the schedule run on the medians of each action's thread CPU time (a device per stage, "
        "as planned); wall = the local executor's step on this machine's shared cores"]))
    rows = []
    for schedule in a.schedules.split(","):
        for name, mode in MODES:
            if name.split()[0].replace("first", "blocks") not in a.modes.split(","):
                continue
            rows += run(schedule, mode, a, child)
            print(f"done {schedule} {mode}", file=sys.stderr, flush=True)
    print()
    print(markdown_table(["schedule", "checkpoint", "stage", "recomputes", "predicted MiB", "one process MiB",
                          "measured / predicted", "torchrun MiB", "measured / predicted", "predicted step",
                          "measured step", "predicted / measured", "wall step"], rows, "llrlrrrrrrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
