"""Run under torchrun (2 ranks): PyTorch's own schedules run pipesplit's split, exactly.

The arguments name zoo models (default long_skip), run one after the other; a model with a weight tied across stages
(gpt_tied: the head is the token embedding) sums its shares with pipesplit.interop.sum_tied_grads."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.interop import sum_tied_grads, tied_across_stages, to_pipeline_stage  # noqa: E402
from tests.close import assert_close  # noqa: E402
from tests.zoo import CASE_BY_NAME  # noqa: E402
from tests.launch import end_rank  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo")
    for name in sys.argv[1:] or [os.environ.get("MODEL", "long_skip")]:
        check(name, dist.get_rank(), dist.get_world_size())
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0


def check(name: str, rank: int, world: int) -> None:
    """Both torch schedules on zoo model ``name``: the loss and every gradient of this rank's stage."""
    torch.manual_seed(0)
    case = CASE_BY_NAME[name]
    model = case.build()
    prog = pipesplit.compile(model, case.inputs(2)[0], example_kwargs=case.inputs(2)[1], num_stages=world)
    tied = bool(tied_across_stages(prog))
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        stage = to_pipeline_stage(prog, rank, device="cpu", tied_grads="sum" if tied else "refuse")
        sched = schedule_cls(stage, n_microbatches=4, loss_fn=lambda out, y: (out * y).sum(), scale_grads=False)
        for p in stage.submod.parameters():
            p.grad = None
        torch.manual_seed(1)
        args, kwargs = case.inputs(8)
        with torch.no_grad():
            target = torch.randn(copy.deepcopy(model)(*args, **kwargs).shape)
        flat = prog.flat_tensor_inputs(*args, **kwargs)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(*flat)
        elif rank == world - 1:
            sched.step(target=target, losses=losses)
        else:
            sched.step()
        if tied:
            sum_tied_grads(prog, [stage])
        ref = copy.deepcopy(model)
        want = (ref(*args, **kwargs) * target).sum()
        want.backward()
        if rank == world - 1:
            assert_close(sum(losses), want.detach(), name=f"loss under torch {schedule_cls.__name__}")
        ref_params = dict(ref.named_parameters())
        names = {id(t): prog.state_entry(i).name for i, t in prog.stage_entries[rank].items()}
        checked = 0
        for p in stage.submod.parameters():
            assert p.grad is not None, f"rank {rank}: no gradient for {names[id(p)]}"
            assert_close(p.grad, ref_params[names[id(p)]].grad, name=f"rank {rank}: gradient of {names[id(p)]}")
            checked += 1
        print(f"rank {rank}: {checked} gradients match under torch {schedule_cls.__name__}"
              + (" (tied)" if tied else ""), flush=True)


if __name__ == "__main__":
    end_rank(main())
