"""Run under torchrun with 4 ranks: a 2 (dp) x 2 (pp) DeviceMesh, one check per launch (``--check``).

- ``tied_init``: a meta-built model initialised with ``pipe.init_weights`` (each rank seeded
  differently) holds one value per tensor: a tied weight agrees across the pipeline ranks holding
  it, and every tensor across the replicas; so does a model built with values, seeded apart, as
  soon as its Pipeline is built.
- ``frozen_tied``: a frozen tied weight stays put under AdamW's weight decay, its ``.grad`` None,
  every other parameter as on the plain model trained by accumulation.
- ``bn_stats``: BatchNorm running statistics on every replica equal accumulation over the global
  batch's microbatches, in order (1f1b, and zb_v with two stages per rank); a checkpoint holds them
  and loads them into the plain model and into a pipeline on the mesh.
- ``bn_refused``: a buffer written in place in a way pipesplit cannot combine across replicas is
  refused when the Pipeline is built.
- ``lengths``: a program compiled at length 32 steps at lengths 32, 17 and 48 (1f1b, and zb_v with
  two stages per rank), each step equal to gradient accumulation over the global batch (issue 34).
- ``gather``: ``pipe(x)`` and ``pipe.eval(x)`` return the whole global batch's output, as the
  plain model does; outputs without a batch dimension (a sum, max, mean, a cross-entropy with
  ignored labels) too.

Each prints ``rank R: ok <check>`` when every assertion of that check held on that rank.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from tests.close import assert_close  # noqa: E402
from tests.launch import end_rank  # noqa: E402
from tests.training import ce, mse  # noqa: E402
from tests.zoo import CASE_BY_NAME  # noqa: E402

M = 2  # microbatches per replica; the global batch is cut into DP * M


def everyone(value):
    """``value`` from every global rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def held(pipe):
    return {entry.name: t.detach().clone() for entry, t in pipe.prog.held_state()}


def agree(pipe, what):
    """Every tensor equal (bit for bit) on every rank holding it; returns name -> the ranks holding it."""
    where = {}
    for rank, state in enumerate(everyone(held(pipe))):
        for name, t in state.items():
            where.setdefault(name, []).append((rank, t))
    for name, copies in where.items():
        first_rank, first = copies[0]
        for rank, t in copies[1:]:
            diff = (t.double() - first.double()).abs().max().item()
            assert torch.equal(t, first), f"{what}: {name} differs between ranks {first_rank} and {rank} (max {diff:.3g})"
    return {name: [r for r, _ in copies] for name, copies in where.items()}


def tied_init(mesh):
    with torch.device("meta"):
        meta = CASE_BY_NAME["gpt_tied"].build()
    prog = pipesplit.compile(meta, torch.randint(0, 64, (2, 16)), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=M, loss_fn=ce, mesh=mesh, timeout=60)
    torch.manual_seed(100 + dist.get_rank())  # ranks seeded apart: the replicas must still agree
    pipe.init_weights(meta)
    holders = agree(pipe, "after init_weights")
    assert len(holders["tok.weight"]) == 4, holders["tok.weight"]  # tied: both pipeline ranks of both replicas
    assert all(torch.isfinite(t).all() for t in held(pipe).values())
    # A model built with its values on each rank, seeded apart (a script that forgets to seed): the
    # Pipeline starts the replicas and the tied copies equal, as DDP's broadcast at construction does.
    torch.manual_seed(200 + dist.get_rank())
    model = CASE_BY_NAME["gpt_tied"].build()
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=M, loss_fn=ce, mesh=mesh, timeout=60)
    holders = agree(pipe, "after construction")
    assert len(holders["tok.weight"]) == 4, holders["tok.weight"]


def frozen_tied(mesh):
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build()
    model.tok.weight.requires_grad_(False)  # frozen before compiling (freezing later is issue 22 #13)
    assert model.head.weight is model.tok.weight
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=M, loss_fn=ce, mesh=mesh, timeout=60)
    params = dict(pipe.named_parameters())
    assert not params["tok.weight"].requires_grad
    before = params["tok.weight"].detach().clone()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    ref_params = dict(ref.named_parameters())
    for step in range(2):
        x, y = torch.randint(0, 64, (8, 16), generator=gen), torch.randint(0, 64, (8, 16), generator=gen)
        pipe.step(x, target=y)
        n = 2 * M
        sum(ce(ref(xm), ym) / n for xm, ym in zip(x.chunk(n), y.chunk(n))).backward()
        assert params["tok.weight"].grad is None, "a frozen tied weight got a gradient"
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for name, p in params.items():
            assert_close(p, ref_params[name], name=f"step {step}: {name}")
    assert torch.equal(params["tok.weight"], before), "the frozen tied weight moved"


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16, momentum=0.3), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.b(self.a(x))


class Halving(nn.Module):
    """Writes its buffer in place in a way pipesplit cannot split per microbatch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("level", torch.ones(6))

    def forward(self, x):
        self.level.mul_(0.5).add_(x.detach().mean(0))
        return self.lin(x) * self.level


def bn_stats(mesh):
    for schedule, stages in (("1f1b", 2), ("zb_v", 4)):  # zb_v: two stages per rank, split backward
        bn_steps(mesh, schedule, stages)


def bn_steps(mesh, schedule, stages):
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randn(4, 6), num_stages=stages, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=M, loss_fn=mse, mesh=mesh, timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for step in range(2):
        x, y = torch.randn(16, 6, generator=gen) * (step + 1), torch.randn(16, 4, generator=gen)
        loss = pipe.step(x, target=y)
        n = 2 * M
        want = sum(mse(ref(xm), ym) / n for xm, ym in zip(x.chunk(n), y.chunk(n)))
        want.backward()
        assert_close(loss.float(), want.detach(), name=f"{schedule}: loss at step {step}")
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        ref_buffers = dict(ref.named_buffers())
        for name, t in pipe.prog.named_buffers():
            assert_close(t, ref_buffers[name], name=f"{schedule} step {step}: {name}")
        agree(pipe, f"{schedule}: after step {step}")
    x = torch.randn(16, 6, generator=gen)
    with torch.no_grad():  # a forward-only pass in training mode updates the statistics too
        got = pipe(x)
        want = torch.cat([ref(xm) for xm in x.chunk(2 * M)])
    if got is not None:
        assert_close(got, want, name=f"{schedule}: pipe(x) in training mode")
    ref_buffers = dict(ref.named_buffers())
    for name, t in pipe.prog.named_buffers():
        assert_close(t, ref_buffers[name], name=f"{schedule} after pipe(x): {name}")
    agree(pipe, f"{schedule}: after pipe(x)")
    path = [tempfile.mkdtemp(prefix="pipesplit-dp-bn-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    pipe.save(path[0])
    dist.barrier()
    if dist.get_rank() == 0:  # the plain model reads the statistics back under its own names
        import torch.distributed.checkpoint as dcp

        sd = BNNet().state_dict()
        dcp.load({"model": sd}, checkpoint_id=path[0], no_dist=True)
        for name, t in ref.state_dict().items():
            assert_close(sd[name], t, name=f"{schedule} checkpoint: {name}")
    dist.barrier()
    other = pipesplit.Pipeline(pipesplit.compile(BNNet(), torch.randn(4, 6), num_stages=2, progress=False),
                               "1f1b", num_microbatches=M, loss_fn=mse, mesh=mesh, timeout=60)
    other.load(path[0])  # and a pipeline on the mesh, every replica
    ref_state = ref.state_dict()
    for name, t in other.prog.named_buffers():
        assert_close(t, ref_state[name], name=f"{schedule} loaded: {name}")


def bn_refused(mesh):
    try:
        pipesplit.Pipeline(pipesplit.compile(nn.Sequential(nn.Linear(6, 6), Halving()), torch.randn(4, 6),
                                             num_stages=2, progress=False),
                           "1f1b", num_microbatches=1, loss_fn=mse, mesh=mesh, timeout=60)
    except pipesplit.PipesplitError as e:
        assert "level" in str(e) and "dp" in str(e), e
    else:
        raise AssertionError("a buffer pipesplit cannot combine across replicas was accepted on dp=2")


def gather(mesh):
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=M, loss_fn=ce, mesh=mesh, timeout=60)
    x = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = ref(x)
        got, got_eval = pipe(x), pipe.eval(x)
    if pipe.rank == pipe.schedule.stage_to_rank[-1]:
        assert_close(got, want, name="pipe(x)")
        assert_close(got_eval, ref.eval()(x), name="pipe.eval(x)")
    else:
        assert got is None and got_eval is None
    # outputs without a batch dimension: joined by their graph's rule over every replica's microbatches
    model = Pooled()
    prog = pipesplit.compile(model, (x[:2].float(), x[:2, 0]), num_stages=2, dynamic_batch=True, progress=False)
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=M, mesh=mesh, timeout=60)
    feats, labels = torch.randn(16, 16, generator=torch.Generator().manual_seed(3)), x[:, 0] % 5
    labels[:6] = -1  # replica 0 keeps 2 of its 8 labels, replica 1 all 8: a plain average is off
    got = pipe.eval(feats, labels)
    if pipe.rank == pipe.schedule.stage_to_rank[-1]:
        for name, a, b in zip(("h", "sum", "max", "mean", "cross_entropy"), got, model(feats, labels)):
            assert_close(a, b, name=f"pipe.eval(x) on a mesh: {name}")


def lengths(mesh):
    """Issue 34 on a mesh: compiled at length 32, steps at 32, 17, 48 equal accumulation over the global batch."""
    from pipesplit.models import gpt

    for schedule, stages in (("1f1b", 2), ("zb_v", 4)):
        torch.manual_seed(0)
        model = gpt(layers=2, dim=16, vocab=64, seq=64, heads=2)
        ref = copy.deepcopy(model)
        tokens = torch.randint(0, 64, (8, 65), generator=torch.Generator().manual_seed(4))
        prog = pipesplit.compile(model, tokens[:2, :32], num_stages=stages, progress=False)
        pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=M, loss_fn=ce, mesh=mesh, timeout=60)
        n = 2 * M  # microbatches of the global batch: DP replicas x M
        for length in (32, 17, 48):
            x, y = tokens[:, :length], tokens[:, 1:length + 1]
            loss = pipe.step(x, target=y)
            want = sum(ce(ref(xm), ym) / n for xm, ym in zip(x.chunk(n), y.chunk(n)))
            want.backward()
            assert_close(loss.float(), want.detach(), name=f"{schedule}: loss at length {length}")
            grads = dict(ref.named_parameters())
            for name, p in pipe.named_parameters():
                assert_close(p.grad, grads[name].grad, name=f"{schedule}: gradient of {name} at length {length}")
            pipe.zero_grad()
            ref.zero_grad()
        assert prog.every_dim, f"{schedule}: the program was not captured again with every dimension dynamic"
        agree(pipe, f"{schedule}: after the lengths")


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 5)

    def forward(self, x, y):
        h = self.b(torch.tanh(self.a(x)))
        return h, h.sum(), h.amax(), h.mean(), nn.functional.cross_entropy(h, y, ignore_index=-1)


CHECKS = {"tied_init": tied_init, "frozen_tied": frozen_tied, "bn_stats": bn_stats, "bn_refused": bn_refused,
          "gather": gather, "lengths": lengths}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--check", choices=sorted(CHECKS), required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    try:
        CHECKS[args.check](mesh)
        print(f"rank {dist.get_rank()}: ok {args.check}", flush=True)
        dist.barrier()  # no rank closes its connections while a peer still reads from them
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())
