"""Run under torchrun: batches whose sequence length changes train exactly on 2 ranks (issue 34).

A GPT and a tiny Llama, compiled once at length 32, step at lengths 32, 17, 48, 64, 17 under each
schedule given (and with compiled stages with ``--compile``): every rank captures the model again,
once, at the first new size, derives each microbatch's boundary shapes from its own inputs before
posting a receive, and holds the gradients gradient accumulation gives its own parameters; in eval
mode the last rank's ``pipe(x)`` equals the model at a further length.

Prints one "rank R: ok (...)" line per check; exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from tests.close import assert_close  # noqa: E402
from tests.launch import end_rank  # noqa: E402
from tests.training import accumulate, dot_loss, make_target  # noqa: E402
from tests.zoo import logits_of, tiny_llama  # noqa: E402

LENGTHS = (32, 17, 48, 64, 17)
MULTI = {"interleaved_1f1b", "looped_bfs", "zb_v", "dualpipe_v"}




def lengths(name: str, schedule: str, rank: int, world: int, compile: dict | None) -> None:
    torch.manual_seed(0)
    model = gpt(layers=2, dim=16, vocab=64, seq=64, heads=2) if name == "gpt" else tiny_llama()
    tokens = torch.randint(0, 64, (8, 64))
    stages = 2 * world if schedule in MULTI else world
    prog = pipesplit.compile(model, tokens[:, :32], num_stages=stages, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=lambda o, t: dot_loss(logits_of(o), t),
                              loss_reduction="sum", timeout=60, compile=compile or False)
    rtol = 1e-3 if compile else None
    for length in LENGTHS:
        x = tokens[:, :length]
        ref = copy.deepcopy(model)
        with torch.no_grad():
            target = make_target(logits_of(ref(x)))
        want = accumulate(ref, (x,), {}, target, 4, loss_fn=lambda o, t: dot_loss(logits_of(o), t))
        got = pipe.step(x, target=target)
        assert_close(got, want, name=f"rank {rank}: loss at length {length}", rtol=rtol)
        grads = dict(ref.named_parameters())
        for n, p in pipe.named_parameters():
            assert_close(p.grad, grads[n].grad, name=f"rank {rank}: gradient of {n} at length {length}", rtol=rtol)
        pipe.zero_grad()
    assert prog.every_dim, f"rank {rank}: the program was not captured with every dimension dynamic"
    model.eval()
    pipe.eval()
    with torch.no_grad():
        out = pipe(tokens[:, :40])
        if out is not None:
            assert_close(logits_of(out), logits_of(model(tokens[:, :40])), name=f"rank {rank}: eval at length 40",
                         rtol=rtol)
    print(f"rank {rank}: ok (lengths {name}, {schedule}{', compiled' if compile else ''})", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", default="1f1b,zb_v")
    p.add_argument("--models", default="gpt,hf_llama")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--compile", help="a torch.compile backend: the stages compiled")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in args.models.split(","):
        for schedule in args.schedule.split(","):
            lengths(name, schedule, rank, world, None)
    if args.compile:
        lengths("gpt", args.schedule.split(",")[0], rank, world, {"backend": args.compile})
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
