"""Run under torchrun (2+ ranks): processes whose measured costs differ still split alike.

Each rank plans with a cost that depends on its rank, as clocks do under load (the cause of
the 4-rank hang of 2026-11-25: ranks cut the same GPT differently). Without agreement the
ranks' plans differ (checked, so this script can fail); ``pipesplit.compile`` gives every
rank global rank 0's plan, and a pipeline step over them runs. A rank waiting for a plan
rank 0 never publishes gets a PlanError naming rank 0, not a hang."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
import pipesplit.agree  # noqa: E402
import pipesplit.api  # noqa: E402
from pipesplit.errors import PlanError  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from pipesplit.plan import Plan  # noqa: E402
from tests.launch import end_rank  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = gpt(layers=4, dim=32, vocab=64, seq=16, heads=2)
    example = torch.randint(0, 64, (2, 16))

    def skewed(node) -> float:  # rank r > 0 finds the first half of the graph 10x dearer
        nodes = list(node.graph.nodes)
        return 10.0 if rank and nodes.index(node) < len(nodes) // 2 else 1.0

    own = pipesplit.api.agree_on_plan
    pipesplit.api.agree_on_plan = lambda gm, plan: plan  # each rank's own plan, as before the fix
    try:
        local = pipesplit.compile(model, example, num_stages=world, cost=skewed, progress=False).plan.stages
    finally:
        pipesplit.api.agree_on_plan = own
    locals_ = [None] * world
    dist.all_gather_object(locals_, local)
    assert any(p != locals_[0] for p in locals_), "the skewed cost should make the ranks' own plans differ"

    prog = pipesplit.compile(model, example, num_stages=world, cost=skewed, progress=False)
    agreed = [None] * world
    dist.all_gather_object(agreed, prog.plan.stages)
    assert all(p == locals_[0] for p in agreed), "every rank must take rank 0's plan"

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=loss_fn, timeout=60)
    loss = pipe.step(torch.randint(0, 64, (8, 16)), target=torch.randint(0, 64, (8, 16)))
    assert torch.isfinite(loss), loss

    if rank == 1:  # rank 0 never compiles this 3-stage split
        try:
            pipesplit.agree.agree_on_plan(_gm(model, example), Plan(stages=[[], [], []]), timeout=2)
        except PlanError as e:
            assert "rank 0" in str(e) and "2s" in str(e), e
        else:
            raise AssertionError("a plan rank 0 never published must raise PlanError")
    print(f"rank {rank}: ok plans differ locally, agree under compile: {[len(s) for s in locals_[0]]} nodes per stage",
          flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _gm(model, example):
    return torch.export.export(model, (example,)).graph_module


if __name__ == "__main__":
    end_rank(main())
