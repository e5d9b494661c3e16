"""Train a small GPT on a pipeline x data-parallel mesh, save a checkpoint, and resume from it.

    torchrun --nproc-per-node 4 examples/train_mesh.py              # 2 pipeline stages x 2 replicas
    torchrun --nproc-per-node 4 examples/train_mesh.py --pp 4       # 4 stages, no data parallelism
    torchrun --nproc-per-node 4 examples/train_mesh.py --resume ckpt --pp 4   # resume in another layout

Every rank builds the same model and compiles the same split, keeps its own stage's
parameters, and feeds its replica's share of each global batch. Checkpoints are saved with
torch.distributed.checkpoint under the model's own parameter names, so any layout, or the
plain model, can load them.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import pipesplit
from pipesplit.models import gpt


def batch(n: int, seq: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (the rest of the ranks replicate them)")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=2, help="per replica")
    parser.add_argument("--save", default="", help="checkpoint folder to write at the end")
    parser.add_argument("--resume", default="", help="checkpoint folder to start from")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # torchrun sets RANK, WORLD_SIZE and the rendezvous for each process
        parser.error(f"start it with torchrun, one process per rank: torchrun --nproc-per-node 4 {__file__}")

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world = dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"{world} ranks do not split into pipelines of {args.pp}; use --pp among "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}.")
    mesh = init_device_mesh("cpu", (world // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
    torch.manual_seed(0)  # the same model on every rank
    vocab, seq = 64, 32
    model = gpt(layers=4, dim=64, vocab=vocab, seq=seq, heads=4)
    prog = pipesplit.compile(model, torch.randint(0, vocab, (2, seq)), num_stages=args.pp, progress=False)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    pipe = pipesplit.Pipeline(prog, args.schedule, num_microbatches=args.microbatches, loss_fn=loss_fn, mesh=mesh)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    if args.resume:
        pipe.load(args.resume, opt)
    gen = torch.Generator().manual_seed(1)  # the same global batches on every rank
    rank = dist.get_rank()
    for step in range(args.steps):
        x, y = batch(16, seq, vocab, gen)  # the global batch: each replica takes its share
        loss = pipe.step(x, target=y)
        norm = pipe.clip_grad_norm_(1.0)  # the norm over every stage and replica
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {float(loss):.4f}  grad norm {float(norm):.3f}", flush=True)
    if args.save:
        pipe.save(args.save, opt)
        if rank == 0:
            print(f"saved {args.save}", flush=True)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
