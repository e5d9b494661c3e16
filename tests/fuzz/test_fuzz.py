"""The differential fuzzer in the suite: a fixed-seed budget of random models and configurations
(about 3 minutes on 2 CPU cores), the torchrun legs (2 ranks; a 2 x 2 dp x pp mesh), and checks
that the fuzzer itself can fail."""

from __future__ import annotations

import time
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings

from tests import launch
from tests.fuzz import harness
from tests.fuzz.check import FuzzFailure, Stats, cases, repro, run
from tests.fuzz.configs import COMBOS, KNOWN, SCHEDULES, features, known
from tests.fuzz.models import Layer, ModelSpec, build, source

BUDGET_S = 150.0  # the drawing stops early on a slow machine; the draws themselves are fixed
STATS = Stats()


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_start: list[float] = []


@seed(22)
@settings(max_examples=600, deadline=None, database=None, derandomize=False, print_blob=False,
          report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate, Phase.shrink])
@given(case=cases(max_layers=6))
def _fuzz(case):
    if time.monotonic() - _start[0] > BUDGET_S:
        return  # out of budget: the remaining draws pass untested
    run(*case, stats=STATS)


def test_random_models_train_like_the_plain_model(one_thread):
    """Every drawn model and configuration trains, evaluates and steps its optimizer like a deep
    copy of the model trained by gradient accumulation (or is refused with a PipesplitError)."""
    _start[:] = [time.monotonic()]
    _fuzz()
    print("\n" + STATS.summary())
    assert STATS.ran >= 20, STATS.summary()
    assert len(STATS.by_schedule) == len(SCHEDULES), f"not every schedule ran: {STATS.summary()}"


def test_every_schedule_has_valid_combinations():
    assert {name for name, _, _ in COMBOS} == set(SCHEDULES)
    assert ("dualpipe_v", 4, 3) not in COMBOS and ("dualpipe_v", 4, 4) in COMBOS  # m >= stages


def test_known_entries_name_their_defect():
    for combo, why in KNOWN.items():
        assert combo and (why.startswith("issue 22 defect ") or why.startswith("new: ")), why


def test_the_repro_is_a_standalone_script(tmp_path):
    import subprocess
    import sys

    spec = ModelSpec((Layer("linear", 0, flag=True), Layer("relu_", 1), Layer("add", 2, 0)), outputs="tuple")
    cfg = {"seed": 3, "stages": 2, "schedule": "1f1b", "m": 2, "mb": 2, "example_batch": 2, "mb2": 2,
           "order": "auto", "recompute": "auto", "cost": "flops", "transport": "rendezvous", "checkpoint": False,
           "no_zero_grad": True, "opt": "adamw", "eval": "pipe", "eval_pipe": False, "freeze_mid": False}
    path = tmp_path / "repro.py"
    path.write_text(repro(spec, cfg))
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and "ok: pipesplit matches" in out.stdout, out.stderr[-3000:]
    assert "class Model" in source(spec) and "tests." not in path.read_text()


def test_a_wrong_gradient_is_caught(monkeypatch):
    """The fuzzer can fail: a pipeline whose gradients are scaled by 1.01 is reported with a repro."""
    import pipesplit

    step = pipesplit.Pipeline.step

    def skewed(self, *args, **kwargs):
        loss = step(self, *args, **kwargs)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(1.01)
        return loss

    monkeypatch.setattr(pipesplit.Pipeline, "step", skewed)
    spec = ModelSpec((Layer("linear", 0, flag=True), Layer("act", 1, 1)))
    cfg = dict(seed=1, stages=2, schedule="zb_h1", m=2, mb=2, example_batch=2, mb2=2, order="auto", recompute="auto",
               cost="flops", transport="auto", checkpoint=False, no_zero_grad=False, opt="sgd", eval="none",
               eval_pipe=False, freeze_mid=False)
    with pytest.raises(FuzzFailure, match="gradient of l1.*relative error") as info:
        run(spec, cfg)
    assert "run_case(Model, IO, CFG)" in str(info.value)


def test_known_defects_are_steered_around_and_drawn_on_request(monkeypatch):
    spec = ModelSpec((Layer("linear", 0),), input_grad=True)
    cfg = dict(seed=1, stages=1, schedule="gpipe", m=1, mb=2, example_batch=2, mb2=2, order="auto", recompute="auto",
               cost="flops", transport="auto", checkpoint=False, no_zero_grad=False, opt="sgd", eval="none",
               eval_pipe=False, freeze_mid=False)
    assert not known(features(spec, cfg)) and run(spec, cfg) == "ok"  # KNOWN holds no entry for it
    monkeypatch.setitem(KNOWN, frozenset({"input_grad"}), "new: an entry made for this test")
    assert known(features(spec, cfg)) and run(spec, cfg) == "known"
    assert run(spec, cfg, include_known=True) == "ok"
    assert isinstance(build(spec), torch.nn.Module) and harness.RTOL < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["pp", "mesh"])
def test_torchrun_legs(mesh):
    """2 ranks over gloo (one pipeline), and 4 ranks as a 2 (dp) x 2 (pp) mesh: a smaller budget."""
    nproc = 2 if mesh == "pp" else 4
    out = launch.torchrun("tests/fuzz/dist.py", nproc, "--mesh", mesh, "--cases", "6" if mesh == "pp" else "4",
                          "--seed", "22", timeout=900)
    assert "fuzz dist: 0 failures" in out.stdout, out.stdout[-4000:]


def _skew(monkeypatch, factor: Callable[[], float]) -> None:
    import pipesplit

    step = pipesplit.Pipeline.step

    def skewed(self, *args, **kwargs):
        loss = step(self, *args, **kwargs)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(factor())
        return loss

    monkeypatch.setattr(pipesplit.Pipeline, "step", skewed)


_CFG = dict(seed=1, stages=2, schedule="1f1b", m=2, mb=2, example_batch=2, mb2=2, order="auto", recompute="auto",
            cost="flops", transport="auto", checkpoint=False, no_zero_grad=False, opt="sgd", eval="none",
            eval_pipe=False, freeze_mid=False)
_SPEC = ModelSpec((Layer("linear", 0, flag=True), Layer("batchnorm", 1), Layer("act", 2, 1)))


def test_a_float32_only_difference_is_counted_as_rounding(monkeypatch):
    """A difference past RTOL in float32 that is gone in float64 is rounding: counted, not reported."""
    _skew(monkeypatch, lambda: 1.002 if torch.get_default_dtype() == torch.float32 else 1.0)
    stats = Stats()
    assert run(_SPEC, dict(_CFG), stats=stats) == "rounding"
    assert stats.rounding == 1 and stats.ran == 1 and "1 float32 differences" in stats.summary()
    assert torch.get_default_dtype() == torch.float32 and harness.RTOL == 5e-4  # restored


def test_a_difference_that_float64_keeps_is_a_failure(monkeypatch):
    """The float64 rerun is held to 1e-8: a gradient 1e-6 off there is still reported."""
    _skew(monkeypatch, lambda: 1.002 if torch.get_default_dtype() == torch.float32 else 1 + 1e-6)
    with pytest.raises(FuzzFailure, match="relative error"):
        run(_SPEC, dict(_CFG))
