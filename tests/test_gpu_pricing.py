"""Pricing where a GPU runs: ops whose launch overlaps the device's work, element-wise rates
measured as slopes (small tensors on a GPU time the launch), and stages sharing one GPU.

Issue 24 measured on an H100: GPT 12x768 at seq 512, 2 stages: predicted backward 62 ms a
stage, measured 12 (GELU's backward on 32K elements read 2e-9 s per element: the launch); 4
stages on the one GPU ran each stage 1.5-2x its time alone, which the simulator ignored.
These run on CPU with a GPU's rates written out; the measurements themselves run in the GPU
check (tests marked cuda).
"""

from __future__ import annotations

import types

import pytest
import torch

import importlib
from pipesplit.meta import NodeCost
from pipesplit.passes.annotate import gpu_rates
from pipesplit.passes.annotate.rates import DeviceRates
from pipesplit.schedules import get_schedule, simulate
from pipesplit.schedules.shared import simulate_shared

predict_mod = importlib.import_module("pipesplit.bench.predict")  # the module: pipesplit.bench re-exports predict()
RATES = dict(forward_op_s=20e-6, backward_op_s=40e-6, flops_per_s=50e12, bytes_per_s=3e12)


def test_a_gpu_op_costs_the_longer_of_launch_and_work_a_cpu_op_their_sum():
    gpu, cpu = DeviceRates("cuda:0", **RATES), DeviceRates("cpu", **RATES)
    tiny = NodeCost(fwd_flops=1000, igrad_flops=2000, requires_grad=True)
    big = NodeCost(fwd_flops=int(5e9), igrad_flops=int(1e10), requires_grad=True)
    assert gpu.forward(tiny, 64) == pytest.approx(20e-6), "host-bound: the launch"
    assert gpu.input_grad(tiny, 64) == pytest.approx(40e-6)
    assert gpu.forward(big, 0) == pytest.approx(1e-4), "device-bound: 5 GFLOP at 50 TFLOP/s, the launch hidden"
    assert gpu.input_grad(big, 0) == pytest.approx(2e-4)
    assert cpu.forward(big, 0) == pytest.approx(1e-4 + 20e-6), "a CPU does both in turn"
    assert cpu.forward(tiny, 64) > gpu.forward(tiny, 64)


def test_a_slope_cancels_every_fixed_cost():
    assert gpu_rates._slope(lambda n: 35e-6 + 3e-12 * n) == pytest.approx(3e-12)
    assert gpu_rates._slope(lambda n: 35e-6) == 0.0, "no growth with size: nothing per element"
    assert gpu_rates._slope(lambda n: 1e-3 - 1e-12 * n) == 0.0, "noise that falls never prices below 0"


def test_the_slopes_run_and_give_rates_in_range():
    """The same functions the GPU uses, on this CPU: positive, finite, and a bandwidth in GB/s."""
    timed = lambda fn: min(_time(fn) for _ in range(2))  # noqa: E731
    (act_f, act_b), (norm_f, norm_b) = gpu_rates.gpu_per_element(torch.device("cpu"), timed)
    assert 0 < act_f < 1e-7 and 0 < norm_f < 1e-7 and act_b >= 0 and norm_b >= 0
    assert 1e8 < gpu_rates.gpu_bandwidth(torch.device("cpu"), timed) < 1e13


def _time(fn):
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prog(devices):
    stages = [types.SimpleNamespace(index=i, device=torch.device(d)) for i, d in enumerate(devices)]
    return types.SimpleNamespace(stages=stages)


def test_stages_on_one_gpu_form_a_sharing_group_per_gpu(monkeypatch):
    monkeypatch.setattr(predict_mod, "gpu_slowdown", lambda device, n: {"cuda:0": 1.8, "cuda:1": 1.5}[device] * n / 2)
    monkeypatch.setattr(predict_mod, "concurrent_slowdown", lambda n: 1.2)
    monkeypatch.setattr(predict_mod, "_stage_nodes", lambda prog: [[] for _ in prog.stages])
    monkeypatch.setattr(predict_mod, "device_rates", lambda dev, largest=None: None)
    monkeypatch.setattr(predict_mod, "device_share", lambda nodes, rates, scale: 0.8)
    s = get_schedule("1f1b", num_ranks=4, num_microbatches=4)
    groups = predict_mod.sharing_groups(_prog(["cuda:0", "cuda:0", "cuda:1", "cuda:1"]), s)
    assert [(ranks, slow(2)) for ranks, slow in groups] == [({0, 1}, pytest.approx(1.44)), ({2, 3}, pytest.approx(1.2))]
    assert groups[1][1](4) == pytest.approx(2.4), "the device's share of the measured slowdown"
    assert predict_mod.sharing_groups(_prog(["cuda:0", "cuda:1", "cuda:2", "cuda:3"]), s) == [], "a GPU each"
    mixed = predict_mod.sharing_groups(_prog(["cpu", "cpu", "cuda:0", "cuda:1"]), s)
    assert [(ranks, slow(2)) for ranks, slow in mixed] == [({0, 1}, 1.2)]


def test_two_sharing_groups_slow_their_own_ranks_only():
    s = get_schedule("gpipe", num_ranks=4, num_microbatches=4)
    alone = simulate(s, 1.0).step_time
    per_rank = simulate_shared(s, 1.0, groups=[({0, 1}, float), ({2, 3}, float)])
    one_group = simulate_shared(s, 1.0, slowdown=float, shared={0, 1, 2, 3})
    assert alone < per_rank.step_time < one_group.step_time
    same = simulate_shared(s, 1.0, groups=[({0, 1}, float)])
    assert same.step_time == pytest.approx(simulate_shared(s, 1.0, slowdown=float, shared={0, 1}).step_time)
    with pytest.raises(Exception, match="two sharing groups"):
        simulate_shared(s, 1.0, groups=[({0, 1}, float), ({1, 2}, float)])
    with pytest.raises(Exception, match="give slowdown"):
        simulate_shared(s, 1.0)


def test_four_stages_sharing_one_gpu_take_about_the_work_of_all_of_them():
    """With the GPU's slowdown ~n (kernels that fill it), 4 stages on one GPU step in about the
    sum of every stage's work, as the H100 measured (152 ms at 2 stages, 140 at 4); apart they
    would take a quarter of it plus the bubble."""
    s = get_schedule("1f1b", num_ranks=4, num_microbatches=8)
    shared = simulate_shared(s, 1.0, groups=[({0, 1, 2, 3}, float)]).step_time
    work = 4 * 8 * (1.0 + 2.0)  # every stage's F and B (B = 2 F by default), all on one device
    assert shared == pytest.approx(work, rel=0.15) and simulate(s, 1.0).step_time < 0.5 * work


@pytest.mark.cuda
def test_streams_on_one_gpu_slow_each_other():
    f = gpu_rates.gpu_slowdown("cuda:0", 2)
    assert 1.0 <= f <= 2.5 and gpu_rates.gpu_slowdown("cuda:0", 1) == 1.0


def test_a_stage_of_launches_shares_a_gpu_freely_one_of_multiplies_does_not():
    """device_share: small ops are host-bound (their launch hides the device's work), large
    multiplies device-bound; sharing slows stages by their share of the measured slowdown only."""
    from pipesplit.capture import capture
    from pipesplit.passes.annotate.costs import annotate_costs
    from pipesplit.models import gpt

    gpu = DeviceRates("cuda:0", **RATES)
    tiny = annotate_costs(capture(gpt(layers=1, dim=8, vocab=16, seq=4, heads=2), torch.randint(0, 16, (2, 4)),
                                  dynamic=False).gm)
    nodes = [n for n in tiny.graph.nodes if n.op == "call_function"]
    assert predict_mod.device_share(nodes, gpu, 1.0) < 0.05, "a tiny GPT: launches"
    assert predict_mod.device_share(nodes, gpu, 1e6) > 0.9, "the same ops a million times larger: work"
    assert predict_mod._shared_gpu.__name__ and max(1.0, 1.9 * 0.02) == 1.0
