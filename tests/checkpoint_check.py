"""Run under torchrun (2 ranks): clipping over every stage and rank, and a checkpoint saved by a
2-stage pipeline resumed by a 4-stage one (zb_v) and loaded into the plain model."""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from tests.close import assert_close  # noqa: E402
from tests.zoo import CASE_BY_NAME  # noqa: E402
from tests.launch import end_rank  # noqa: E402
from tests.training import ce  # noqa: E402


def pipe_for(stages, schedule, executor="auto", dtype=torch.float32):
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build().to(dtype)
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=stages, progress=False)
    return model, pipesplit.Pipeline(prog, schedule, num_microbatches=2, loss_fn=ce, timeout=60, executor=executor,
                                     num_ranks=2)


def batches(n):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen))
            for _ in range(n)]


def train(pipe, opt, data, clip=None):
    out = []
    for x, y in data:
        out.append(float(pipe.step(x, target=y)))
        if clip:
            pipe.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    return out


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, pipe = pipe_for(2, "1f1b")
    ref = copy.deepcopy(model)
    x, y = batches(1)[0]
    pipe.step(x, target=y)
    sum(ce(ref(xm), ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2))).backward()
    got = pipe.clip_grad_norm_(0.05)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert_close(got, want, name="total norm")
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.grad, ref_params[name].grad, name=f"rank {rank}: clipped gradient of {name}")
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    model64, pipe64 = pipe_for(2, "1f1b", dtype=torch.float64)  # the norm in the gradients' dtype, as torch's
    ref64 = copy.deepcopy(model64)
    pipe64.step(x, target=y)
    sum(ce(ref64(xm), ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2))).backward()
    got64, want64 = pipe64.clip_grad_norm_(0.05), torch.nn.utils.clip_grad_norm_(ref64.parameters(), 0.05)
    assert got64.dtype == want64.dtype == torch.float64, (got64.dtype, want64.dtype)
    assert_close(got64, want64, name="total norm in float64")
    print(f"rank {rank}: ok clip ({float(got):.4f})", flush=True)
    pipe.zero_grad()

    data = batches(4)
    path = [tempfile.mkdtemp(prefix="pipesplit-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    train(pipe, opt, data[:2], clip=1.0)
    pipe.save(path[0], opt)
    # a rank's state_dict is its own stages' (the rest trains elsewhere: a copy here would be stale)
    held = {alias for entry, _ in pipe.prog.held_state() for alias in entry.aliases}
    keys = set(pipe.prog.state_dict())
    assert keys == {k for k in model.state_dict() if k in held} and len(keys) < len(model.state_dict()), (rank, keys)
    straight = train(pipe, opt, data[2:], clip=1.0)
    _, other = pipe_for(4, "zb_v")  # 4 stages, 2 per rank
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other.load(path[0], opt2)
    resumed = train(other, opt2, data[2:], clip=1.0)
    for a, b in zip(straight, resumed):
        assert abs(a - b) <= 1e-5 * abs(a) + 1e-6, (straight, resumed)
    print(f"rank {rank}: ok resume ({straight} == {resumed})", flush=True)
    dist.barrier()
    if rank == 0:  # the plain model reads the same checkpoint under its own names
        import torch.distributed.checkpoint as dcp

        plain = CASE_BY_NAME["gpt_tied"].build()
        sd = plain.state_dict()
        dcp.load({"model": sd}, checkpoint_id=path[0], no_dist=True)
        plain.load_state_dict(sd)
        _, local = pipe_for(2, "1f1b", executor="local")
        local.load(path[0])
        assert_close(plain(x), local.prog(x), name="plain model from the checkpoint")
        print("rank 0: ok plain", flush=True)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
