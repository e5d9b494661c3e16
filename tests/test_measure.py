"""measure_stage_costs: per-stage F / I / W times that the simulator can take."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipesplit
from pipesplit.runtime.engine.measure import measure_stage_costs
from pipesplit.schedules import StageCost, get_schedule, simulate


def block(dim: int, width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, dim))


class ThreeBlocks(nn.Module):
    """Stage 1 is twice as wide as stages 0 and 2 (about 2.5x their FLOPs)."""

    def __init__(self, dim: int = 256):
        super().__init__()
        self.a = block(dim, dim)
        self.b = block(dim, 2 * dim)
        self.c = block(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def compile_three(batch: int = 4) -> tuple[ThreeBlocks, pipesplit.SplitProgram]:
    torch.manual_seed(0)
    model = ThreeBlocks()
    return model, pipesplit.compile(model, torch.randn(batch, 256), split_points=["b", "c"])


def test_one_positive_cost_per_stage():
    _, prog = compile_three()
    costs = measure_stage_costs(prog, torch.randn(64, 256), num_microbatches=2, repeats=3, warmup=1)
    assert len(costs) == prog.num_stages == 3
    for i, c in enumerate(costs):
        assert isinstance(c, StageCost)
        assert c.forward > 0 and c.backward_weight > 0
        # stage 0 takes the program input, which needs no gradient: its I pass has nothing to do
        assert c.backward_input > 0 if i > 0 else c.backward_input >= 0
    assert simulate(get_schedule("1f1b", num_ranks=3, num_microbatches=2), costs).step_time > 0


@pytest.fixture
def one_thread():
    """One intra-op thread: on a loaded machine, OpenMP's spin-waiting swamps small ops with noise."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_twice_as_wide_stage_measures_slower(one_thread):
    _, prog = compile_three()
    x = torch.randn(1024, 256)  # 512-row microbatches: ~1 ms matmuls, compute-bound rather than overhead-bound
    # min over repeats: the least disturbed run, so a loaded machine does not flip the order
    costs = measure_stage_costs(prog, x, num_microbatches=2, repeats=7, warmup=2, reduce="min")
    total = [c.forward + c.backward for c in costs]
    assert total[1] > total[0] and total[1] > total[2], costs
    assert costs[1].forward > min(costs[0].forward, costs[2].forward), costs


def test_measuring_leaves_gradients_buffers_and_rng_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    prog = pipesplit.compile(model, torch.randn(4, 16), num_stages=2)
    before = {k: v.clone() for k, v in prog.state_dict().items()}
    torch.manual_seed(123)
    costs = measure_stage_costs(prog, torch.randn(8, 16), num_microbatches=2, repeats=2, warmup=1)
    after_rng = torch.rand(3)
    torch.manual_seed(123)
    torch.randn(8, 16)
    assert torch.equal(after_rng, torch.rand(3))  # measurement draws came from a forked RNG
    assert len(costs) == 2
    assert all(p.grad is None for p in prog.parameters())
    for k, v in prog.state_dict().items():
        assert torch.equal(v, before[k]), k  # BatchNorm running stats restored


def test_loss_fn_is_timed_on_the_last_stage():
    _, prog = compile_three()
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    costs = measure_stage_costs(prog, x, num_microbatches=4, repeats=2, warmup=1,
                                loss_fn=lambda out, t: F.mse_loss(out, t), target=y)
    assert len(costs) == 3 and all(c.forward > 0 for c in costs)


def test_fused_costs_make_i_plus_w_the_one_pass_backward():
    _, prog = compile_three()
    x = torch.randn(64, 256)
    split = measure_stage_costs(prog, x, num_microbatches=2, repeats=3, warmup=1)
    fused = measure_stage_costs(prog, x, num_microbatches=2, repeats=3, warmup=1, backward="fused")
    assert len(fused) == len(split) == 3
    for c in fused:
        assert c.forward > 0 and c.backward > 0 and c.backward_weight >= 0


def test_refuses_bad_arguments():
    _, prog = compile_three()
    with pytest.raises(pipesplit.PipesplitError):
        measure_stage_costs(prog, torch.randn(8, 256), repeats=0)
    with pytest.raises(pipesplit.PipesplitError):
        measure_stage_costs(prog, torch.randn(8, 256), reduce="mean")
    with pytest.raises(pipesplit.PipesplitError):
        measure_stage_costs(prog, torch.randn(8, 256), backward="both")


def test_cpu_clock_leaves_out_time_spent_waiting():
    """A stage that waits 50 ms (a sleeping hook, as if preempted) costs that in wall time, not CPU time."""
    _, prog = compile_three(batch=16)  # the stage graphs stay those captured (another batch would re-capture)
    x = torch.randn(16, 256)
    prog.stages[1].module.register_forward_hook(lambda *_: time.sleep(0.05))
    wall = measure_stage_costs(prog, x, repeats=2, warmup=0, reduce="min")
    cpu = measure_stage_costs(prog, x, repeats=2, warmup=0, reduce="min", clock="cpu")
    assert wall[1].forward >= 0.05
    assert cpu[1].forward < 0.05
    assert all(c.forward > 0 for c in cpu)
    with pytest.raises(pipesplit.PipesplitError, match="clock"):
        measure_stage_costs(prog, x, clock="thread")
