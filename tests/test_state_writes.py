"""A parameter written in place inside the forward (a weight clamp): trained exactly where its stage runs
one microbatch at a time, refused by name elsewhere (pipesplit.runtime.state.state_writes; issue 22, defect 15)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.errors import PipesplitError
from pipesplit.runtime.state.state_writes import overlapping_stages
from pipesplit.schedules import resolve_schedule
from tests.training import check_training, dot_loss


class Shrink(nn.Module):
    """Scales its weight down in place on every forward: each microbatch's forward sees the weight as
    the previous microbatches' forwards left it, and its backward the weight its own forward used."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.w.mul_(0.9)
        return h @ self.w


class Model(nn.Module):
    def __init__(self, last: bool, d: int = 8):
        super().__init__()
        self.a, self.b = (nn.Linear(d, d), Shrink(d)) if last else (Shrink(d), nn.Linear(d, d))
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _prog(model: nn.Module) -> pipesplit.SplitProgram:
    return pipesplit.compile(model, torch.randn(2, 8), split_points=["b"], progress=False)


def test_one_microbatch_at_a_time_per_stage():
    one_f_one_b = resolve_schedule("1f1b", 2, None, 4)
    assert set(overlapping_stages(one_f_one_b)) == {0}  # the last stage runs F0 B0 F1 B1 ...
    assert set(overlapping_stages(resolve_schedule("gpipe", 2, None, 4))) == {0, 1}
    assert overlapping_stages(resolve_schedule("gpipe", 2, None, 1)) == {}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_parameter_written_in_forward_with_microbatches_in_flight_is_refused(schedule):
    torch.manual_seed(0)
    prog = _prog(Model(last=False))
    with pytest.raises(PipesplitError) as err:
        pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss)
    msg = str(err.value)
    for part in ("'a.w'", "'mul_'", "stage 0", f"{schedule!r}", "num_microbatches=1", "after the optimizer step"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize("schedule,m,last", [("1f1b", 4, True), ("zb_v", 4, True), ("interleaved_1f1b", 4, True),
                                             ("gpipe", 1, False), ("zb_h1", 1, False)])
def test_a_parameter_written_in_forward_trains_where_its_stage_holds_one_microbatch(schedule, m, last):
    torch.manual_seed(0)
    model = Model(last=last)
    prog = _prog(model)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=m, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randn(8, 8),), {})], m=m, steps=3)


def test_the_refusal_lists_schedules_that_train():
    prog = _prog(Model(last=True))
    with pytest.raises(PipesplitError) as err:
        pipesplit.Pipeline(prog, "gpipe", num_microbatches=4, loss_fn=dot_loss)
    listed = str(err.value).split("one microbatch at a time (at their default rank count): ")[1].split(".")[0]
    assert "1f1b" in listed.split(", ") and "gpipe" not in listed


class Codebook(nn.Module):
    """A VQ-VAE codebook kept as a frozen Parameter and updated in place (an EMA) in the forward; its
    lookup's backward never reads it, so any schedule trains it as accumulation does."""

    def __init__(self, k: int = 6, d: int = 8):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(k, d), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            idx = torch.cdist(h, self.embed).argmin(-1)
            self.embed.mul_(0.9).add_(0.1 * h.mean(0))
        q = torch.nn.functional.embedding(idx, self.embed)
        return h + (q - h).detach()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_frozen_parameter_written_in_the_forward_trains_under_any_schedule(schedule):
    """A review of defect 15's check: it refused a frozen parameter written in place (no backward reads
    its value), which trained exactly before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Codebook(), nn.Linear(8, 8))
    prog = pipesplit.compile(model, torch.randn(8, 8), split_points=["2"], progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randn(8, 8),), {})], m=4)


class FrozenClamp(nn.Module):
    """A frozen weight clamped in the forward and read by a linear whose input needs a gradient: the
    linear's backward reads the weight, so overlapping microbatches would see each other's clamp."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.l2.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        with torch.no_grad():
            self.l2.weight.clamp_(-0.3, 0.3)
        return self.l2(h)


def test_a_frozen_parameter_a_backward_reads_is_refused_where_microbatches_overlap():
    """The fuzzer found it: skipping every frozen parameter let autograd's raw in-place error through."""
    torch.manual_seed(0)
    model = FrozenClamp()
    prog = pipesplit.compile(model, torch.randn(8, 8), num_stages=1, progress=False)
    with pytest.raises(PipesplitError, match=r"'l2\.weight' is written in place"):
        pipesplit.Pipeline(prog, "gpipe", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=1, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randn(8, 8),), {})], m=1)


def _shuffled_forwards(num_stages, num_ranks, num_microbatches):
    """A valid schedule that runs each stage's forwards in the order 1, 0, 3, 2, then the backwards."""
    order = [1, 0, 3, 2]
    return [[f"{s}F{m}" for m in order] + [f"{s}B{m}" for m in order] for s in range(num_stages)]


def test_a_schedule_with_forwards_out_of_order_is_refused_where_a_stage_writes_its_statistics():
    """BatchNorm's running statistics came out in the schedule's forward order, not accumulation's
    (running_mean 0.058 off), with the loss and gradients right: silent."""
    from pipesplit.schedules import register_schedule, unregister_schedule

    register_schedule("shuffled_forwards")(_shuffled_forwards)
    try:
        torch.manual_seed(0)
        with_bn = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        prog = pipesplit.compile(with_bn, torch.randn(2, 4), num_stages=2, split_points=["2"])
        with pytest.raises(pipesplit.ScheduleError, match=r"stage 0's forwards in the order \[1, 0, 3, 2\]"):
            pipesplit.Pipeline(prog, "shuffled_forwards", num_microbatches=4, loss_fn=lambda o, t: (o - t).pow(2).mean())
        plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))  # nothing written: the order is free
        prog = pipesplit.compile(plain, torch.randn(2, 4), num_stages=2, split_points=["1"])
        pipe = pipesplit.Pipeline(prog, "shuffled_forwards", num_microbatches=4, loss_fn=lambda o, t: (o - t).pow(2).mean())
        assert torch.isfinite(pipe.step(torch.randn(8, 4), target=torch.randn(8, 1)))
    finally:
        unregister_schedule("shuffled_forwards")
