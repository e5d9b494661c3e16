"""Under torchrun: a sparse embedding tied to a dense head across ranks (its gradient summed over them), and
``prog(x)`` on a rank whose Pipeline kept only its own stages. Prints one line per rank when both hold."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

import pipesplit
from tests.close import assert_close
from tests.test_weight_grads import SparseTiedHead
from tests.training import chunk_tree, dot_loss


def main() -> int:
    dist.init_process_group("gloo")
    rank, schedule = dist.get_rank(), sys.argv[1]
    torch.manual_seed(0)
    model = SparseTiedHead()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randint(0, 16, (2, 5)), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    ids, target = torch.randint(0, 16, (4, 5)), torch.randn(4, 5, 16)
    for i, t in zip(ids.chunk(2), chunk_tree(target, 2)):
        dot_loss(ref(i), t).backward()
    pipe.step(ids, target=target)
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.grad is not None and p.grad.layout == ref_params[name].grad.layout, name
        assert_close(p.grad, ref_params[name].grad, name=f"rank {rank}: gradient of {name}")
    try:
        prog(ids)
    except pipesplit.PipesplitError as e:
        assert "pipe(x)" in str(e), e
    else:
        raise AssertionError("prog(x) ran on a rank holding one stage")
    print(f"rank {rank}: sparse tied gradient and prog(x) ok ({schedule})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
