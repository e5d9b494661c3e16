"""torch's own pipelining schedules, built by their constructors on rank 0 of a fake process group.

torch's schedule classes need live ``PipelineStage`` objects, which need a process group: a
"fake" group (torch's test backend: every collective a no-op) of ``num_ranks`` gives rank 0 real
stages, so the class's constructor computes its order and its ``_load_csv`` lowers a file
exactly as on a cluster, on every torch release, with nothing of torch's built by hand.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # rank r holds stages r and 2p-1-r


def schedules_module() -> types.ModuleType:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for needed in ("_PipelineScheduleRuntime", "ScheduleDualPipeV", "ScheduleZBVZeroBubble", "ScheduleInterleaved1F1B"):
        if not hasattr(schedules, needed):
            pytest.skip(f"this torch has no {needed}")
    return schedules


@contextlib.contextmanager
def fake_group(num_ranks: int) -> Iterator[None]:
    """The default process group, as rank 0 of ``num_ranks``, for this block only."""
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    assert not dist.is_initialized(), "a process group is already up in this test process"
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=num_ranks)
    try:
        yield
    finally:
        dist.destroy_process_group()


def torch_schedule(cls_name: str, num_ranks: int, num_stages: int, m: int) -> Any:
    """torch's ``cls_name`` for ``num_ranks`` ranks, ``num_stages`` stages and ``m`` microbatches, as
    rank 0 builds it (its ``pipeline_order`` holds every rank's order)."""
    from torch.distributed.pipelining import PipelineStage

    cls = getattr(schedules_module(), cls_name)
    per_rank = num_stages // num_ranks
    if cls_name in V_SHAPED:
        mine = [0, num_stages - 1]
    else:
        mine = [k * num_ranks for k in range(per_rank)]
    with fake_group(num_ranks):
        stages = [PipelineStage(nn.Linear(2, 2), i, num_stages, torch.device("cpu")) for i in mine]
        return cls(stages, m, loss_fn=lambda out, target: out.sum())


def torch_loads(path: Path, num_ranks: int, num_stages: int, m: int, comm: bool) -> Any:
    """What torch's own loader (``_PipelineScheduleRuntime._load_csv``) makes of the file."""
    runtime = torch_schedule("_PipelineScheduleRuntime", num_ranks, num_stages, m)
    runtime._load_csv(str(path), format="compute_comms" if comm else "compute_only")
    return runtime
