"""Run under torchrun: one process per rank trains a split program and checks it against the model.

Every rank builds the same model (same seed), runs the unsplit model on the full
batch itself as the reference, and compares the loss and the gradients of the
parameters it holds; after optimizer steps, it compares the updated parameters.
Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.runtime.comm.exchange import RankComm  # noqa: E402
from tests.close import assert_close  # noqa: E402
from tests.zoo import CASE_BY_NAME  # noqa: E402
from tests.launch import end_rank  # noqa: E402

ORIGINAL_BATCH = dist.batch_isend_irecv
ORIGINAL_RELEASE = RankComm.release


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt_tied")
    p.add_argument("--schedule", default="1f1b", help="comma-separated schedule names, run one after another")
    p.add_argument("--stages", type=int, default=0, help="default: one per rank (two for multi-stage schedules)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--die-rank", type=int, default=-1, help="this rank exits before the step (failure test)")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    case = CASE_BY_NAME[args.model]
    model = case.build()
    for schedule in args.schedule.split(","):
        check(model, case, schedule, args, rank, world)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0


def check(model, case, schedule, args, rank, world) -> None:
    ex_args, ex_kwargs = case.inputs(2)
    multi = schedule in ("interleaved_1f1b", "looped_bfs", "zb_v")
    stages = args.stages or (2 * world if multi else world)
    prog = pipesplit.compile(model, ex_args, example_kwargs=ex_kwargs, num_stages=stages, progress=False)

    if args.model == "gpt_tied":
        def loss_fn(out, y):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        reduction = "mean"
    else:
        def loss_fn(out, y):
            return (out * y).sum()
        reduction = "sum"
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=args.microbatches, loss_fn=loss_fn,
                              loss_reduction=reduction, timeout=args.timeout)
    alive = track_sends(pipe)
    ref = copy.deepcopy(model)
    # A summed loss has gradients ~128 times (8 x 16 elements) those of a mean. At lr 0.1 it sends
    # long_skip's loss 0.19 -> 4.4 -> 2310 -> -2e4 in three steps: saturated tanh, a function so
    # ill-conditioned that the same float32 computation summed in another order differs by ~1e-4
    # (float64: 1e-14). lr 1e-3 trains it without blowing up (per-step gradient error stays ~3e-7).
    lr = 0.1 if reduction == "mean" else 1e-3
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    held = dict(pipe.named_parameters())
    assert held, f"rank {rank} holds no parameters"
    ref_params = dict(ref.named_parameters())
    for step in range(args.steps):
        # Every step compares the gradients at the pipeline's parameters (all ranks' ones): a
        # reference following its own trajectory parts from the pipeline by rounding amplified by
        # each step, and the next step would compare gradients at two different points.
        take_the_pipelines_parameters(ref_params, held, world)
        torch.manual_seed(100 + step)
        bargs, bkwargs = case.inputs(8)
        target = torch.randint(0, 64, (8, 16)) if args.model == "gpt_tied" else torch.randn(8, 16)
        if rank == args.die_rank:
            os._exit(3)
        loss = pipe.step(*(a.clone() for a in bargs), target=target, **bkwargs)  # a model may write its input
        want = loss_fn(ref(*bargs, **bkwargs), target)
        want.backward()
        assert_close(loss.float(), want.detach(), name=f"rank {rank} step {step}: loss")
        for name, p in held.items():
            assert p.grad is not None, f"rank {rank} step {step}: no gradient for {name}"
            assert_close(p.grad, ref_params[name].grad, name=f"rank {rank} step {step}: gradient of {name}")
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        # Both moved from the same point, so they differ by lr times the gradients' difference:
        # relative to p, at most the gradients' error where the step is all of p (a bias that
        # started at zero), less elsewhere. Measured over 5 steps, 2 and 4 ranks, gpipe, 1f1b and
        # zb_h1: <= 3e-8 (long_skip, late_kwarg), <= 3e-7 (gpt_tied); gradients <= 6e-7.
        for name, p in held.items():
            assert_close(p, ref_params[name], name=f"rank {rank}: {name} after step {step}")
    print(f"rank {rank}/{world}: {len(held)} parameters match over {args.steps} steps ({schedule})", flush=True)
    assert all(r() is None for r in alive["refs"]), f"rank {rank}: sent tensors outlive the step ({schedule})"
    print(f"rank {rank}/{world}: {alive['sent']} tensors sent, {alive['held']} held after their send completed, "
          f"at most {alive['max']} in flight after an action ({schedule})", flush=True)


def take_the_pipelines_parameters(ref_params: dict, held: dict, world: int) -> None:
    """Copy every rank's parameters into this rank's reference model (a tied one from any holder)."""
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {name: p.detach().clone() for name, p in held.items()})
    first: dict = {}
    with torch.no_grad():
        for params in gathered:
            for name, p in params.items():
                # a tied weight held by several ranks: every copy took the same steps
                assert torch.equal(first.setdefault(name, p), p), f"the ranks' copies of {name} differ"
                ref_params[name].copy_(p)
    missing = set(ref_params) - set(first)
    assert not missing, f"no rank holds {sorted(missing)[:5]}"


def track_sends(pipe) -> dict:
    """Count what this rank sends, and check at every release of finished sends (after each action)
    that every batch already complete before it is let go: a sender drops a sent tensor once its send
    completes, not when the step ends. Also the most sent tensors alive after an action (in flight)."""
    refs: list = []
    alive = {"sent": 0, "max": 0, "held": 0, "refs": refs}
    batch = ORIGINAL_BATCH  # not an earlier schedule's wrapper

    def recording(ops):
        refs.extend(weakref.ref(op.tensor) for op in ops if op.op is dist.isend)
        alive["sent"] += sum(op.op is dist.isend for op in ops)
        return batch(ops)

    dist.batch_isend_irecv = recording
    release = ORIGINAL_RELEASE  # not an earlier schedule's wrapper

    def checked(comm):
        done = [i for i, (handle, _) in comm._in_flight.items() if comm.transport.done(handle)]
        release(comm)
        alive["held"] += sum(i in comm._in_flight for i in done)
        refs[:] = [r for r in refs if r() is not None]
        alive["max"] = max(alive["max"], len(refs))

    RankComm.release = checked
    return alive


if __name__ == "__main__":
    end_rank(main())
