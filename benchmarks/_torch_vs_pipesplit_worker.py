"""Run under torchrun (gloo, CPU): one split, one schedule, two runtimes, alternating steps.

Launched by ``benchmarks/bench_vs_torch.py``. For every model and schedule, each rank
builds the same model (same seed), compiles it into one stage per rank, and trains it
step by step with pipesplit's distributed executor (``pipesplit.Pipeline``) and with
``torch.distributed.pipelining`` running the same stages (``pipesplit.interop.to_pipeline_stage``),
alternating which runtime goes first. Each step is timed on rank 0 between two barriers,
so the time covers the whole pipeline. Rank 0 prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.interop import to_pipeline_stage  # noqa: E402
from pipesplit.models import gpt  # noqa: E402

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class ResidualMLP(nn.Module):
    """A deep residual MLP (pre-norm blocks), no tied weights."""

    def __init__(self, depth: int, width: int, hidden: int):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.up = nn.ModuleList(nn.Linear(width, hidden) for _ in range(depth))
        self.down = nn.ModuleList(nn.Linear(hidden, width) for _ in range(depth))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for norm, up, down in zip(self.norms, self.up, self.down):
            x = x + down(F.gelu(up(norm(x))))
        return self.out(x)


def untied_gpt(layers: int, dim: int, vocab: int, seq: int) -> nn.Module:
    """The built-in GPT with its output head given its own weight (PyTorch's stages cannot share one)."""
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq)
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    return model


def build(name: str, quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[[Any, Any], torch.Tensor], str]:
    """Model, a batch, its target, the loss and a description."""
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        depth, width, hidden, batch = (8, 256, 512, 64) if quick else (16, 512, 1024, 128)
        model = ResidualMLP(depth, width, hidden)
        x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
        desc = f"residual MLP, {depth} blocks, width {width}, hidden {hidden}, batch {batch}, MSE loss"
        return model, x, y, lambda out, t: F.mse_loss(out, t), desc
    if name == "gpt":
        layers, dim, vocab, seq, batch = (2, 128, 512, 64, 8) if quick else (4, 128, 512, 64, 16)
        model = untied_gpt(layers, dim, vocab, seq)
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        desc = f"GPT without weight tying, {layers} blocks, dim {dim}, vocab {vocab}, seq {seq}, batch {batch}, cross-entropy"
        return model, x, y, lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1)), desc
    raise SystemExit(f"unknown model {name!r}")


def timed(fn: Callable[[], Any]) -> float:
    """Wall time of ``fn`` on this rank, between barriers (so rank 0 sees the whole pipeline)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def bench_model(name: str, schedules: list[str], n_mb: int, warmup: int, steps: int, quick: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, x, y, loss_fn, desc = build(name, quick)
    example = x[:2]
    # Two copies of the same split: pipesplit's distributed Pipeline drops the other ranks'
    # stages from the program it runs, and each runtime must own its parameters.
    prog_torch = pipesplit.compile(model, example, num_stages=world, progress=False)
    prog_ps = pipesplit.compile(model, example, num_stages=world, plan=prog_torch.plan, progress=False)
    out: dict[str, Any] = {"model": name, "description": desc, "schedules": {}}
    for schedule in schedules:
        pipe = pipesplit.Pipeline(prog_ps, schedule, num_microbatches=n_mb, loss_fn=loss_fn, executor="distributed")
        stage = to_pipeline_stage(prog_torch, rank, device="cpu")
        sched = TORCH_SCHEDULES[schedule](stage, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=True)
        flat = prog_torch.flat_tensor_inputs(x)
        torch_losses: list[torch.Tensor] = []
        ps_loss: list[float] = []

        def run_pipesplit() -> None:
            pipe.zero_grad(set_to_none=True)
            ps_loss.append(float(pipe.step(x, target=y).detach()))

        def run_torch() -> None:
            for p in stage.submod.parameters():
                p.grad = None
            torch_losses.clear()
            if rank == 0:
                sched.step(*flat)
            elif rank == world - 1:
                sched.step(target=y, losses=torch_losses)
            else:
                sched.step()

        runs = {"pipesplit": run_pipesplit, "torch": run_torch}
        for _ in range(warmup):
            for fn in runs.values():
                fn()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(steps):
            order = ["pipesplit", "torch"] if r % 2 == 0 else ["torch", "pipesplit"]
            for k in order:
                times[k].append(timed(runs[k]))
        # Same loss from both runtimes (the last rank has torch's microbatch losses).
        diff = torch.zeros((), dtype=torch.float64)
        if rank == world - 1 and torch_losses:
            diff.fill_(abs(sum(float(v.detach()) for v in torch_losses) / n_mb - ps_loss[-1]))
        dist.broadcast(diff, src=world - 1)
        out["schedules"][schedule] = {"times": times, "loss_diff": float(diff)}
        if rank == 0:
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            print(f"  {name} {schedule}: pipesplit {med['pipesplit'] * 1e3:.1f} ms, torch {med['torch'] * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--schedules", default="1f1b,gpipe")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = {
        "world": dist.get_world_size(),
        "torch_threads": torch.get_num_threads(),
        "microbatches": args.microbatches,
        "warmup": args.warmup,
        "steps": args.steps,
        "models": [bench_model(m, args.schedules.split(","), args.microbatches, args.warmup, args.steps, args.quick)
                   for m in args.models.split(",")],
    }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
