"""The differential fuzzer in the suite: a fixed-seed budget of random models and configurations
(about 3 minutes on 2 CPU cores), the torchrun legs (2 ranks; a 2 x 2 dp x pp mesh), and checks
that the fuzzer itself can fail."""

from __future__ import annotations

import time
from typing import Callable

import pytest
import torch

from tests import launch
from tests.fuzz import harness
from tests.fuzz.__main__ import one_case
from tests.fuzz.check import FuzzFailure, Stats, repro, run
from tests.fuzz.coverage import IMPOSSIBLE, PAIRS, Coverage
from tests.fuzz.configs import COMBOS, KNOWN, SCHEDULES, features, known
from tests.fuzz.models import Layer, ModelSpec, build, io, source

BUDGET_S = 150.0  # the drawing stops early on a slow machine; the draws themselves are fixed
STATS = Stats()
COVERAGE = Coverage(22)


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_random_models_train_like_the_plain_model(one_thread):
    """Every drawn model and configuration trains, evaluates and steps its optimizer like a deep
    copy of the model trained by gradient accumulation (or is refused as its features allow, or as
    the generator expects); every pair of the features that matter is reached (tests/fuzz/coverage.py)."""
    start, case = time.monotonic(), 0
    # the budget, then (a slow machine) on while a pair is unreached, up to 1.6 x the budget
    while time.monotonic() - start < BUDGET_S or (COVERAGE.unreached() and time.monotonic() - start < 1.6 * BUDGET_S):
        case += 1
        one_case(COVERAGE.next_force(), 2_200_000 + case, STATS, COVERAGE, max_layers=6, shrink_s=60)
    print("\n" + STATS.summary() + "\n" + COVERAGE.summary())
    assert STATS.ran >= 20, STATS.summary()
    assert len(STATS.by_schedule) == len(SCHEDULES), f"not every schedule ran: {STATS.summary()}"
    assert STATS.refused_as_expected, STATS.summary()
    assert not COVERAGE.unreached(), COVERAGE.summary()


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
    assert "torch.set_default_dtype(torch.float64)" in path.read_text()  # the fuzzer's dtype: float32 fails RTOL


def test_rounding_on_a_zero_gradient_passes_and_an_error_does_not():
    """A gradient zero in exact arithmetic (a bias before an InstanceNorm) rounds on the scale of the
    largest gradient: 8e-12 beside a gradient of 59 and a loss of 6.5 passes (seed 3535 failed it on
    the loss's scale alone); 1e-9 of the largest gradient on that tensor does not."""
    from tests.fuzz.harness import compare_step

    ref = torch.nn.Linear(4, 4).double()
    big = torch.full((4, 4), 59.0 / 4, dtype=torch.float64)
    tiny = torch.full((4,), 2.6e-12, dtype=torch.float64)
    ref.weight.grad, ref.bias.grad = big.clone(), tiny.clone()
    mine = torch.nn.Linear(4, 4).double()
    mine.weight.grad, mine.bias.grad = big.clone(), tiny + 4e-12  # |diff| 8e-12
    held = dict(mine.named_parameters())
    compare_step(0, torch.tensor(6.5, dtype=torch.float64), torch.tensor(6.5, dtype=torch.float64), held, ref,
                 {}, None, None)
    mine.bias.grad = tiny + 59e-9
    with pytest.raises(AssertionError, match="gradient of bias"):
        compare_step(0, torch.tensor(6.5, dtype=torch.float64), torch.tensor(6.5, dtype=torch.float64), held, ref,
                     {}, None, None)


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
    assert isinstance(build(spec), torch.nn.Module) and harness.RTOL <= 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["pp", "mesh"])
def test_torchrun_legs(mesh):
    """2 ranks over gloo (one pipeline), and 4 ranks as a 2 (dp) x 2 (pp) mesh: a smaller budget. Each leg
    reaches dropout (with checkpointing) and compiled stages: the first draws are forced to have them."""
    import re

    nproc = 2 if mesh == "pp" else 4
    out = launch.torchrun("tests/fuzz/dist.py", nproc, "--mesh", mesh, "--cases", "6" if mesh == "pp" else "4",
                          "--seed", "22", timeout=900)
    assert "fuzz dist: 0 failures" in out.stdout, out.stdout[-4000:]
    reached = re.search(r"pairs reached: (.*)", out.stdout)
    assert reached, out.stdout[-4000:]
    for feature in ("dropout", "compile", "checkpoint"):
        assert f"{mesh} x {feature}," in reached.group(1) + ",", reached.group(0)


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


def test_a_difference_of_one_in_a_million_is_caught(monkeypatch):
    """Every case runs in float64 at RTOL 1e-10: a gradient 1e-6 off (one microbatch of four 4e-6 off)
    is reported; float32 at 5e-4 let a 1e-3 error in one microbatch of four pass."""
    _skew(monkeypatch, lambda: 1 + 1e-6)
    with pytest.raises(FuzzFailure, match="relative error"):
        run(_SPEC, dict(_CFG))
    assert torch.get_default_dtype() == torch.float32  # restored


# seed 8888 case 2538: an InstanceNorm over an input constant along the sequence (rounding apart), so its
# output and the loss (6.7e-10) are rounding noise scaled by 1/sqrt(eps); a compiled stage sums in another order
_NOISE_SPEC = ModelSpec(
    (Layer("wsum", 0, flag=True), Layer("wsum", 1, flag=True), Layer("sdpa", 3), Layer("wsum", 4),
     Layer("mha", 5, 4, flag=True), Layer("instancenorm", 6, 3, flag=True)),
    tokens=True, padding_idx=True, kwarg=True, layout="tb")
_NOISE_CFG = dict(_CFG, seed=51280, schedule="dualpipe_v", m=4, mb=2, example_batch=2, mb2=2, compile=True,
                  graphs=True, reduction="sum", loss_param=False)


def test_a_difference_in_a_case_whose_plain_answer_is_rounding_is_not_judged():
    """The plain model's own loss moves 2.4e-5 relative when each of its ops rounds once more: the compiled
    run's difference (0.1 on the loss) is counted ill-conditioned, not a failure; with compile off the
    case is exact. A model whose answer float64 determines is still judged (the test above)."""
    stats = Stats()
    assert run(_NOISE_SPEC, dict(_NOISE_CFG), stats) == "ill-conditioned"
    assert stats.ill_conditioned == 1 and "loss at step 0" in stats.ill_example
    assert "1 ill-conditioned" in stats.summary()
    assert run(_NOISE_SPEC, dict(_NOISE_CFG, compile=False, graphs=False)) == "ok"
    make = lambda: build(_NOISE_SPEC)  # noqa: E731
    from tests.fuzz import conditioning
    moved = conditioning.movement(make, io(_NOISE_SPEC), _NOISE_CFG)
    loss = moved["loss at step 0"]
    assert loss > 1e-6 and conditioning.ill_conditioned(make, io(_NOISE_SPEC), _NOISE_CFG, 0.1, "loss at step 0") == loss
    assert conditioning.ill_conditioned(make, io(_NOISE_SPEC), _NOISE_CFG, 10.0, "loss at step 0") is None  # beyond
    # each tensor on its own movement: its well-determined gradients, and what the probe does not cover, are judged
    assert conditioning.ill_conditioned(make, io(_NOISE_SPEC), _NOISE_CFG, 0.01, "gradient of l6.bias at step 0") is None
    assert conditioning.ill_conditioned(make, io(_NOISE_SPEC), _NOISE_CFG, 0.01, "gradient of l6.bias at step 1") is None
    # a determined one: SLACK times its movement is under RTOL, so anything RTOL flags stays a failure
    assert conditioning.SLACK * max(conditioning.movement(lambda: build(_SPEC), io(_SPEC), _CFG).values()) < harness.RTOL


def test_a_wrong_gradient_in_a_case_whose_loss_is_rounding_is_still_a_failure(monkeypatch):
    """The loss of the case above is rounding, its gradients are not: every gradient 1% off (eager stages) is
    reported, not excused by the loss's movement (a review's mutant: the first version excused any tensor
    within SLACK of the case's largest movement)."""
    _skew(monkeypatch, lambda: 1.01)
    with pytest.raises(FuzzFailure, match="relative error"):
        run(_NOISE_SPEC, dict(_NOISE_CFG, compile=False, graphs=False))


def test_a_small_gradient_is_held_to_its_own_size():
    """No floor against the largest gradient (it was 1e-3 of it): a gradient of norm 1e-6 beside a loss of
    100 is compared on its own scale, so 1% off in it is reported; rounding on a zero one is not."""
    want = torch.full((8,), 1e-6 / 8 ** 0.5, dtype=torch.float64)
    with pytest.raises(AssertionError, match="relative error"):
        harness.close("gradient of l2.bias", want * 1.01, want, scale=100.0)
    harness.close("gradient of l2.bias", want * (1 + 1e-12), want, scale=100.0)
    harness.close("gradient that is zero", torch.full((8,), 1e-15, dtype=torch.float64), torch.zeros(8), 100.0)


def test_a_case_that_must_be_refused_fails_when_it_runs(monkeypatch):
    """Checkpointing a stage that updates running statistics must be refused (they would update twice):
    drawn, and a pipesplit that runs it instead is reported."""
    spec = ModelSpec((Layer("linear", 0, flag=True), Layer("batchnorm", 1, arg=0)))
    cfg = dict(_CFG, checkpoint=True)
    assert run(spec, dict(cfg)) == "refused as expected"
    import pipesplit.runtime.engine.pipeline as pl
    monkeypatch.setattr(pl, "checkpointed_stages", lambda prog, local, checkpoint: set(range(prog.num_stages)))
    with pytest.raises(FuzzFailure, match="not refused|relative error"):
        run(spec, dict(cfg))


def test_a_refusal_no_feature_allows_is_a_failure(monkeypatch):
    """A regression that starts refusing a working case is reported, not counted as refused."""
    import pipesplit

    def refuse(self, *args, **kwargs):
        raise pipesplit.PipesplitError("this step is refused for no reason")

    monkeypatch.setattr(pipesplit.Pipeline, "step", refuse)
    with pytest.raises(FuzzFailure, match="no feature of this case allows that refusal"):
        run(_SPEC, dict(_CFG))


def test_dropout_trains_against_the_plain_model_on_pipesplits_streams(monkeypatch):
    """A model with dropout (p > 0) is compared with the plain model whose dropout modules draw from
    pipesplit's (stage, microbatch) streams: two steps, input gradients, buffers; exact, and a
    gradient 1e-6 off under dropout is reported (the reference is not the split program)."""
    spec = ModelSpec((Layer("linear", 0, flag=True), Layer("dropout", 1, flag=True), Layer("batchnorm", 2),
                      Layer("linear", 3, flag=True), Layer("dropout", 4, flag=True)), input_grad=True, layout="tb")
    cfg = dict(_CFG, stages=3, schedule="1f1b", m=3, mb2=1, checkpoint=False)
    assert run(spec, dict(cfg)) == "ok"
    _skew(monkeypatch, lambda: 1 + 1e-6)
    with pytest.raises(FuzzFailure, match="relative error"):
        run(spec, dict(cfg))


def test_pairs_impossible_by_design_say_why():
    assert all(len(p) == 2 and why for p, why in IMPOSSIBLE.items())
    assert not set(IMPOSSIBLE) & set(PAIRS) and len(PAIRS) >= 90


def test_every_mutant_still_applies():
    """tests/fuzz/mutants.py's patches each find their text once in today's tree (mutants that no
    longer apply would rot silently); 20 or more, over every area."""
    import os

    from tests.fuzz import mutants

    assert len(mutants.MUTANTS) >= 20 and len({m.key for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
    assert {m.area for m in mutants.MUTANTS} >= {"capture", "planning", "splitting", "runtime", "compiled",
                                                 "checkpointing", "mesh"}
    for m in mutants.MUTANTS:
        for file, old, new in mutants.patches(m):
            with open(os.path.join(mutants.ROOT, file)) as f:
                assert f.read().count(old) == 1 and old != new, (m.key, file, old)


def test_a_zero_gradient_where_the_model_has_none_is_caught(monkeypatch):
    """A weight read only on a detached branch gets no gradient in plain PyTorch (None: an optimizer skips
    it); a pipeline that gives it zeros instead (history 1d0ed6f, mutant M16) is reported, with SGD too."""
    import pipesplit

    spec = ModelSpec((Layer("linear", 0, flag=True), Layer("detached", 1, arg=0, flag=True), Layer("act", 2)))
    assert "self.l2(v0).detach()" in source(spec)
    assert run(spec, dict(_CFG)) == "ok"
    step = pipesplit.Pipeline.step

    def zeros(self, *args, **kwargs):
        loss = step(self, *args, **kwargs)
        for p in self.parameters():
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        return loss

    monkeypatch.setattr(pipesplit.Pipeline, "step", zeros)
    with pytest.raises(FuzzFailure, match="l2.weight has a gradient, the model none"):
        run(spec, dict(_CFG))


def test_the_draws_build_what_the_mutants_need():
    """The shapes tests/fuzz/mutants.py's M03, M16, M24 and M25 need are drawn often (draws only, nothing
    runs): BatchNorm statistics read after their write; a weight no gradient reaches in a compiled F/I/W
    stage; a value made from the input at the front (a dropout mask, or one written through a view later)
    read again by the last layer, where the planner may rebuild it rather than receive it."""
    from tests.fuzz.check import draw_case
    from tests.fuzz.configs import SPLIT_BACKWARD
    from tests.fuzz.models import NOT_GRAPHED

    coverage, seen = Coverage(5), {"state_read": 0, "detached_fiw": 0, "bait_dropout": 0, "bait_view_write": 0}
    for case in range(400):
        spec, cfg = draw_case(900_000 + case, coverage.next_force())
        feats = features(spec, cfg)
        seen["state_read"] += "state_read" in feats and cfg["m"] > 1 and not cfg["checkpoint"]
        fiw = cfg["compile"] and (cfg["schedule"] in SPLIT_BACKWARD or cfg["graphs"])
        seen["detached_fiw"] += fiw and "detached" in feats and not NOT_GRAPHED & feats
        front = not spec.tokens and not spec.input_grad and spec.layers[-1] == Layer("add", len(spec.layers) - 1, 1)
        bait = front and cfg["recompute"] == "auto" and cfg["stages"] > 1
        seen["bait_dropout"] += bait and spec.layers[0].op == "dropout" and spec.layers[0].flag
        seen["bait_view_write"] += bait and len(spec.layers) > 2 and spec.layers[1] == Layer("mul_", 1, flag=True)
        # as if each case ran (F/I/W graphs and graph replays as a compiled case of that kind would measure them)
        coverage.reached(feats | ({"fiw"} if fiw else set()) | ({"graphs_replayed"} if cfg["graphs"] else set()))
    assert min(seen.values()) >= 8, seen
