"""Run under torchrun with 4 ranks: a 2 (pp) x 2 (dp) DeviceMesh.

A step equals gradient accumulation of the whole global batch on the plain model (loss, every
gradient), for several steps with AdamW and global-norm clipping; tied weights stay one
parameter. Then a checkpoint saved on this mesh resumes on 4 pipeline stages without data
parallelism (another stage count and another data-parallel degree) with the same losses."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from tests.close import assert_close  # noqa: E402
from tests.zoo import CASE_BY_NAME  # noqa: E402
from tests.launch import end_rank  # noqa: E402
from tests.training import ce  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", default="1f1b,zb_h1")
    p.add_argument("--die", choices=["step", "save"], help="failure test: a rank exits at this point")
    p.add_argument("--die-rank", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if args.die:
        return die(args)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    try:
        code = run(args, rank, mesh)
        dist.barrier()  # no rank closes its connections while a peer still reads from them
        return code
    finally:
        dist.destroy_process_group()


def die(args) -> int:
    """Rank ``--die-rank`` exits before a training step's data-parallel sum or a save; the others must
    raise a RuntimeCommError within the timeout, not hang."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    torch.manual_seed(0)
    prog = pipesplit.compile(CASE_BY_NAME["gpt_tied"].build(), torch.randint(0, 64, (2, 16)), num_stages=2,
                             progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=ce, mesh=mesh, timeout=15)
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    if args.die == "save":
        pipe.step(x, target=y)
    if rank == args.die_rank:
        os._exit(3)
    if args.die == "step":
        pipe.step(x, target=y)
    else:
        pipe.save(tempfile.mkdtemp(prefix=f"pipesplit-die-{rank}-"))
    return 0


def run(args, rank, mesh) -> int:
    for schedule in args.schedule.split(","):
        torch.manual_seed(0)
        model = CASE_BY_NAME["gpt_tied"].build()
        prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=2, progress=False)
        m = 2
        pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=m, loss_fn=ce, mesh=mesh, timeout=60)
        ref = copy.deepcopy(model)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        held = dict(pipe.named_parameters())
        gen = torch.Generator().manual_seed(3)
        for step in range(3):
            x, y = torch.randint(0, 64, (8, 16), generator=gen), torch.randint(0, 64, (8, 16), generator=gen)
            loss = pipe.step(x, target=y)
            n = 2 * m  # the global batch in dp x m microbatches, accumulated on the plain model
            want = sum(ce(ref(xm), ym) / n for xm, ym in zip(x.chunk(n), y.chunk(n)))
            want.backward()
            assert_close(loss.float(), want.detach(), name=f"rank {rank} loss at step {step}")
            ref_params = dict(ref.named_parameters())
            for name, q in held.items():
                assert_close(q.grad, ref_params[name].grad, name=f"rank {rank} step {step}: gradient of {name}")
            norm = pipe.clip_grad_norm_(0.5)
            assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), name="global norm")
            opt.step(), opt_ref.step()
            opt.zero_grad(), opt_ref.zero_grad()
        print(f"rank {rank}: ok mesh 2x2 ({schedule}, {len(held)} parameters, dp rank {pipe.dp_rank})", flush=True)
        if schedule == "1f1b":
            resume(pipe, opt, gen, rank)
    return 0


def train(pipe, opt, batches):
    out = []
    for x, y in batches:
        out.append(float(pipe.step(x, target=y)))
        pipe.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    return out


def resume(pipe, opt, gen, rank):
    path = [tempfile.mkdtemp(prefix="pipesplit-mesh-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    pipe.save(path[0], opt)
    batches = [(torch.randint(0, 64, (8, 16), generator=gen), torch.randint(0, 64, (8, 16), generator=gen))
               for _ in range(2)]
    straight = train(pipe, opt, batches)
    torch.manual_seed(1)
    other = pipesplit.Pipeline(
        pipesplit.compile(CASE_BY_NAME["gpt_tied"].build(), torch.randint(0, 64, (2, 16)), num_stages=4,
                          progress=False),
        "1f1b", num_microbatches=4, loss_fn=ce, timeout=60,
    )
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other.load(path[0], opt2)
    resumed = train(other, opt2, batches)
    for a, b in zip(straight, resumed):
        assert abs(a - b) <= 1e-5 * abs(a) + 1e-6, (straight, resumed)
    print(f"rank {rank}: ok resume 2x2 -> 4x1 ({straight} == {resumed})", flush=True)


if __name__ == "__main__":
    end_rank(main())
