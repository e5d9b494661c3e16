"""Under torchrun (gloo): inputs that require grad end every step with the plain model's accumulated
gradient on every rank, on a pipeline of 2 ranks and on a 2x2 (dp, pp) mesh (issue 22, defect 2)."""

from __future__ import annotations

import copy
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import pipesplit
from tests.launch import end_rank
from tests.test_training import TwoInputs
from tests.training import accumulate, dot_loss, make_target


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    for schedule in ["1f1b", "zb_h1"]:
        torch.manual_seed(0)  # every rank: the same model and data
        model = TwoInputs()
        ref = copy.deepcopy(model)
        prog = pipesplit.compile(model, torch.randn(2, 8), example_kwargs={"scale": torch.randn(2, 8)},
                                 num_stages=2, progress=False)
        pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum",
                                  mesh=mesh, timeout=60)
        m = 2 * (2 if mesh is not None else 1)  # microbatches of the global batch
        x = torch.randn(8, 8, requires_grad=True)
        base = torch.randn(8, 8, requires_grad=True)
        x_ref, base_ref = x.detach().clone().requires_grad_(), base.detach().clone().requires_grad_()
        for step in range(2):  # no zero_grad: input gradients accumulate
            target = make_target(ref(x_ref, base_ref + 1))
            accumulate(ref, (x_ref,), {"scale": base_ref + 1}, target, m)
            pipe.step(x, scale=base + 1, target=target)
            for name, got, want in [("x", x.grad, x_ref.grad), ("base", base.grad, base_ref.grad)]:
                if got is None or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                    print(f"rank {rank}/{world}: input {name} differs at step {step} ({schedule})", flush=True)
                    return 1
        print(f"rank {rank}/{world}: input gradients match over 2 steps ({schedule})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
