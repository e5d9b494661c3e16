"""Run under torchrun: each rank's peak memory during a pipeline step against the planner's estimate.

Every tensor storage created on this rank while a step runs (activations kept for the
backward, gradients, receive buffers posted ahead, sent tensors not yet let go, scratch)
is counted from its creation until it is freed; the peak of that sum is compared with
what the planner predicts for the stage beyond its weights and optimizer state (the
activations of every microbatch the schedule keeps in flight, what it receives, and the
gradients). A runtime that kept activations past their backward, or sent tensors past their
send, would exceed it; a model that counted far more than a step holds would fall under
``LOW``. Prints one line per rank; exits non-zero if a stage is out of that band.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.bench.stage_memory import new_storages  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from tests.launch import end_rank  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.RLock()  # a storage freed while counting calls _free on this thread

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for storage in new_storages(out, (args, kwargs)):  # a parameter's view is no new storage
            self._count(storage)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if size == 0 or key in self._refs:
                return
            self._refs[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
            self.live += size
            self.peak = max(self.peak, self.live)

    def _free(self, key: int, size: int) -> None:
        with self._lock:
            if self._refs.pop(key, None) is not None:
                self.live -= size


# measured / predicted per rank: the figure is an upper bound, and tight (this tiny GPT: 0.77-0.98;
# 0.45-0.72 under the former budget, which counted every output and a whole microbatch per backward)
LOW = 0.75


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256, help="4096 at --dim 32: logits dominate the last stage")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = gpt(layers=4, dim=args.dim, vocab=args.vocab, seq=32, heads=2)
    ok = True
    for schedule in args.schedule.split(","):
        ok &= check(model, schedule, args.microbatches, args.microbatch_size, rank, world, args.vocab)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0 if ok else 1


def check(model, schedule: str, m: int, mb: int, rank: int, world: int, vocab: int = 256) -> bool:
    example = torch.randint(0, vocab, (mb, 32))  # the planner's figures are per microbatch
    memory = pipesplit.MemoryModel()
    prog = pipesplit.compile(model, example, num_stages=world, schedule=schedule, num_microbatches=m,
                             memory=memory, progress=False)
    estimate = prog.plan.stage_memory[rank]

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=m, loss_fn=loss_fn, timeout=60)
    weights = sum(p.numel() * p.element_size() for p in pipe.parameters())
    budget = estimate - weights * (1 + memory.optimizer_factor)  # what a step may add: activations, gradients
    peaks = []
    for _ in range(3):
        x, y = torch.randint(0, vocab, (m * mb, 32)), torch.randint(0, vocab, (m * mb, 32))
        for p in pipe.parameters():
            p.grad = None
        with LiveBytes() as live:
            pipe.step(x, target=y)
        peaks.append(live.peak)
    peak = max(peaks[1:])  # the first step also makes one-off caches
    ok = LOW * budget <= peak <= budget
    print(f"rank {rank}/{world}: {schedule} peak {peak / 2**20:.2f} MiB, planner budget {budget / 2**20:.2f} MiB "
          f"(estimate {estimate / 2**20:.2f} MiB less weights and optimizer state), "
          f"ratio {peak / budget:.2f}: {'ok' if ok else 'OVER' if peak > budget else 'UNDER'}", flush=True)
    return ok


if __name__ == "__main__":
    end_rank(main())
