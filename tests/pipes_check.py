"""Run under torchrun (2 ranks, gloo): a train and an eval Pipeline on one program; whichever meets a
new batch size first re-captures the model, and the other follows on every rank (issue 22 #12)."""

from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from tests.close import assert_close  # noqa: E402
from tests.launch import end_rank  # noqa: E402
from tests.test_semantics import ScaleByBatch  # noqa: E402
from tests.training import accumulate, dot_loss  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for first in ("train", "eval"):
        torch.manual_seed(0)
        model = ScaleByBatch()
        prog = pipesplit.compile(model, torch.randn(8, 8), split_points=["b"], progress=False)
        train = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum", timeout=60)
        evaluate = pipesplit.Pipeline(prog, "gpipe", num_microbatches=2, timeout=60)
        small, x, target = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)
        if first == "eval":
            out = evaluate.eval(small)
            if rank == 1:
                assert_close(out, torch.cat([model(c) for c in small.chunk(2)]).detach(), name="eval, re-captured")
        loss = train.step(small if first == "train" else x, target=target[:4] if first == "train" else target)
        ref = copy.deepcopy(model)
        want = accumulate(ref, (small,) if first == "train" else (x,), {}, target[:4] if first == "train" else target, 2)
        assert_close(loss, want, name=f"loss ({first} first)")
        out = evaluate.eval(x)
        if rank == 1:
            assert_close(out, torch.cat([model(c) for c in x.chunk(2)]).detach(), name=f"eval after ({first} first)")
        print(f"rank {rank}: ok pipes {first} first", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
