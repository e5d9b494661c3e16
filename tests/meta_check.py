"""Run under torchrun (4 ranks): a model built on the meta device is compiled on every rank, and each
rank gives storage only to its own stage, initialises it with the model's own reset_parameters,
and trains. Prints each rank's peak host memory growth against the full model's size."""

from __future__ import annotations

import os
import resource
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.models import GPT, GPTConfig  # noqa: E402
from tests.training import dot_loss  # noqa: E402
from tests.launch import end_rank  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=256, dim=1024, layers=8, heads=8, seq=16)
    with torch.device("meta"):
        model = GPT(cfg)
    full = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    before = peak_mib()
    prog = pipesplit.compile(model, torch.randint(0, 256, (2, 16)), num_stages=world, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum", timeout=120)
    pipe.init_weights(model)
    own = sum(p.numel() * p.element_size() for p in pipe.parameters()) / 2**20
    grown = peak_mib() - before
    assert not any(p.is_meta for p in pipe.parameters())
    # no process ever holds the whole model: its share, plus what capturing costs (~30 MiB here)
    assert full >= 3 * own, (full, own)
    assert grown < 1.25 * own + 64, f"rank {rank}: host memory grew {grown:.0f} MiB for a {own:.0f} MiB share"
    loss = pipe.step(torch.randint(0, 256, (4, 16)), target=torch.randn(4, 16, 256))
    assert torch.isfinite(loss), loss
    print(f"rank {rank}: ok meta full {full:.1f} MiB own {own:.1f} MiB peak growth {grown:.1f} MiB", flush=True)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
