"""Run under torchrun (2 ranks): PyTorch's own schedules run pipesplit's split, exactly."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.interop import to_pipeline_stage  # noqa: E402
from tests.close import assert_close  # noqa: E402
from tests.zoo import CASE_BY_NAME  # noqa: E402
from tests.launch import end_rank  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    case = CASE_BY_NAME[os.environ.get("MODEL", "long_skip")]
    model = case.build()
    prog = pipesplit.compile(model, case.inputs(2)[0], example_kwargs=case.inputs(2)[1], num_stages=world)
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        stage = to_pipeline_stage(prog, rank, device="cpu")
        sched = schedule_cls(stage, n_microbatches=4, loss_fn=lambda out, y: (out * y).sum(), scale_grads=False)
        for p in stage.submod.parameters():
            p.grad = None
        torch.manual_seed(1)
        args, kwargs = case.inputs(8)
        target = torch.randn(8, 16)
        flat = prog.flat_tensor_inputs(*args, **kwargs)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(*flat)
        elif rank == world - 1:
            sched.step(target=target, losses=losses)
        else:
            sched.step()
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
        print(f"rank {rank}: {checked} gradients match under torch {schedule_cls.__name__}", flush=True)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
