"""Train a small GPT on a pipeline x data-parallel mesh, save a checkpoint, and resume from it.

    torchrun --nproc-per-node 4 examples/train_mesh.py --save ckpt           # 2 pipeline stages x 2 replicas
    torchrun --nproc-per-node 4 examples/train_mesh.py --pp 4 --resume ckpt  # resume as 4 stages, no replicas

Every rank builds the same model and compiles the same split, keeps its own stage's
parameters, and feeds its replica's share of each global batch. Checkpoints are saved with
torch.distributed.checkpoint under the model's own parameter names, so any layout, or the
plain model, can load them. Rank 0 prints the layout (which ranks run each stage), what it
saved (and from which layout and step) and what it resumed from.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import pipesplit
from pipesplit.models import gpt


INFO = "train_mesh.json"  # beside the checkpoint's own files: the layout and step count that saved it


def batch(n: int, seq: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def describe_layout(mesh: Any, prog: Any, schedule: str, microbatches: int) -> str:
    """Which rank runs which stage of which replica, and what each stage holds."""
    grid = mesh.mesh.tolist()  # [replica][stage] -> rank
    dp, pp = len(grid), len(grid[0])
    lines = [f"layout: {dp * pp} ranks = {dp} replica(s) (dp) x {pp} pipeline stage(s) (pp), {schedule}, "
             f"{microbatches} microbatches per replica"]
    for s, stage in enumerate(prog.stages):
        params = sum(p.numel() for p in stage.module.parameters())
        ranks = ", ".join(str(grid[d][s]) for d in range(dp))
        lines.append(f"  stage {s}: {params:,} parameters, on rank(s) {ranks}")
    return "\n".join(lines)


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

    layout_text = describe_layout(mesh, prog, args.schedule, args.microbatches)  # before the Pipeline drops
    tensors = sum(1 for _ in prog.named_parameters())                           # the other ranks' stages
    pipe = pipesplit.Pipeline(prog, args.schedule, num_microbatches=args.microbatches, loss_fn=loss_fn, mesh=mesh)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    rank = dist.get_rank()
    if rank == 0:
        print(layout_text, flush=True)
    layout = {"pp": args.pp, "dp": world // args.pp, "schedule": args.schedule}
    first = 0
    if args.resume:
        pipe.load(args.resume, opt)
        info_path = os.path.join(args.resume, INFO)
        saved = {}
        if os.path.exists(info_path):
            with open(info_path) as f:
                saved = json.load(f)
        first = saved.get("steps", 0)
        if rank == 0:
            was = (f"{saved['pp']} stage(s) x {saved['dp']} replica(s), {saved['schedule']}, after step {first - 1}"
                   if saved else "a layout it does not record")
            print(f"resumed from {args.resume}: model and AdamW state saved by {was}; now {args.pp} stage(s) x "
                  f"{world // args.pp} replica(s), going on at step {first}", flush=True)
    gen = torch.Generator().manual_seed(1)  # the same global batches on every rank
    for _ in range(first):
        batch(16, seq, vocab, gen)  # the batches the saved run already trained on
    for step in range(first, first + args.steps):
        x, y = batch(16, seq, vocab, gen)  # the global batch: each replica takes its share
        loss = pipe.step(x, target=y)
        norm = pipe.clip_grad_norm_(1.0)  # the norm over every stage and replica
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step == first or step % 5 == 0 or step == first + args.steps - 1):
            print(f"step {step:3d}  loss {float(loss):.4f}  grad norm {float(norm):.3f}", flush=True)
    if args.save:
        pipe.save(args.save, opt)
        if rank == 0:
            with open(os.path.join(args.save, INFO), "w") as f:
                json.dump({**layout, "steps": first + args.steps}, f)
            print(f"saved {args.save}: {tensors} parameter tensors and their AdamW state under the model's own names, "
                  f"after step {first + args.steps - 1}, from {args.pp} stage(s) x {world // args.pp} replica(s); "
                  f"resume in any layout with --resume {args.save}", flush=True)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
