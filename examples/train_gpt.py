"""Train a small GPT-style model with pipeline parallelism on 2 ranks.

    torchrun --nproc-per-node 2 examples/train_gpt.py                 # a GPU per rank (NCCL) if CUDA is there, else CPU (gloo)
    torchrun --nproc-per-node 2 examples/train_gpt.py --device cpu    # CPU and gloo even with GPUs
    torchrun --nproc-per-node 2 examples/train_gpt.py --schedule zb_v # 2 stages per rank

Each rank picks its device before the process group starts: cuda:LOCAL_RANK with NCCL
when CUDA is available, else the CPU with gloo. Every rank builds the same model and
compiles the same split; each keeps only its own stage's parameters. The data is a
learnable toy language: each sequence counts up modulo the vocabulary from a random
start, so the loss should fall quickly.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipesplit
from pipesplit.models import gpt
from pipesplit.runtime.comm.distributed import init_device


def batch(n: int, seq: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: cuda:LOCAL_RANK with NCCL when CUDA is available, else cpu with gloo")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # torchrun sets RANK, WORLD_SIZE and the rendezvous for each process
        parser.error(f"start it with torchrun, one process per rank: torchrun --nproc-per-node 2 {__file__}")

    # cuda:LOCAL_RANK made current before the first collective (NCCL needs a GPU per rank), or cpu
    device = init_device({"auto": None, "cuda": "nccl", "cpu": "gloo"}[args.device])
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120),
                            device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same model on every rank
    vocab, seq = 64, 32
    model = gpt(layers=4, dim=64, vocab=vocab, seq=seq, heads=4)
    example = torch.randint(0, vocab, (2, seq))
    # stages per rank come from the schedule: 1 for gpipe/1f1b/zb_h1, 2 for V-shaped zb_v; interleaved
    # schedules take any whole number (None), two here
    per_rank = pipesplit.schedules.schedule_info(args.schedule).constraints.stages_per_rank or 2
    stages = per_rank * world
    prog = pipesplit.compile(model, example, num_stages=stages, devices=[device] * stages, progress=False)
    if rank == 0:
        print(f"{world} ranks on {backend}; rank 0 computes on {device}", flush=True)
        print(prog.report(), flush=True)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1).to(logits.device))

    pipe = pipesplit.Pipeline(prog, args.schedule, num_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)  # the same data on every rank
    for step in range(args.steps):
        x, y = batch(16, seq, vocab, gen)
        loss = pipe.step(x.to(device), target=y.to(device))
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {float(loss):.4f}", flush=True)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
