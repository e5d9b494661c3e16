"""Planning across lengths (passes/plan/lengths.py): the split for the expected step over the lengths a batch takes."""

from __future__ import annotations

import pytest
import torch

import pipesplit
from pipesplit.capture import capture
from pipesplit.errors import PlanError
from pipesplit.models import gpt
from pipesplit.passes.annotate.costs import annotate_costs
from pipesplit.passes.annotate.flops import at_sizes, hint
from pipesplit.passes.plan.lengths import length_mix, parse_plan_lengths, steps_over_lengths
from pipesplit.passes.plan.planner import plan_partition
from pipesplit.passes.plan.step_planner import TIE
from pipesplit.schedules import resolve_schedule

RATE = 1e10  # FLOPs per second: every step below is simulated from FLOP counts alone, the same on any machine
SHORT, LONG = 16, 1024


@pytest.fixture(scope="module")
def captured():
    """A GPT whose attention (quadratic in the length) dominates at 1024 and its MLP at 16."""
    torch.manual_seed(0)
    model = gpt(layers=4, dim=32, heads=2, seq=LONG)
    cap = capture(model, torch.randint(0, 100, (2, 32)), dims={"idx": {1: None}})
    annotate_costs(cap.gm)
    return cap


def _plan(cap, weights):
    mix = length_mix(cap.gm, cap.inputs, 0, parse_plan_lengths(weights))
    schedule = resolve_schedule("1f1b", 2, None, 4)
    return plan_partition(cap.gm, 2, schedule=schedule, flops_per_s=RATE, lengths=mix, order="program"), mix, schedule


def test_costs_follow_the_length(captured):
    """Every FLOP count is the one at the length the symbol is given: the attention's grows with its square."""
    gm = captured.gm
    sdpa = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    mix = length_mix(gm, captured.inputs, 0, {SHORT: 1.0})
    assert hint(sdpa.meta["val"].shape[2]) == 32  # the example's length
    with at_sizes({mix.symbol: 64}):
        assert hint(sdpa.meta["val"].shape[2]) == 64
    assert hint(sdpa.meta["val"].shape[2]) == 32


def test_the_plan_for_short_and_long_lengths_differ_and_the_mix_is_best_in_expectation(captured):
    short, _, schedule = _plan(captured, [SHORT])
    long, _, _ = _plan(captured, [LONG])
    mixed, mix, _ = _plan(captured, {SHORT: 0.5, LONG: 0.5})
    assert short.stages != long.stages  # attention's share grows with the length: the cut moves
    assert mixed.lengths == [SHORT, LONG] and mixed.length_weights == [0.5, 0.5]
    expected = {}
    for name, plan in (("short", short), ("long", long), ("mixed", mixed)):
        steps = steps_over_lengths(captured.gm, plan.stages, mix, schedule, flops_per_s=RATE)
        expected[name] = 0.5 * steps[0] + 0.5 * steps[1]
    assert mixed.length_steps_s == pytest.approx(
        steps_over_lengths(captured.gm, mixed.stages, mix, schedule, flops_per_s=RATE), rel=1e-9)
    assert mixed.predicted_step_s == pytest.approx(expected["mixed"], rel=1e-9)
    # the mix weighs every single length's candidates by the expectation; splits within TIE are ties
    assert expected["mixed"] <= expected["short"] * (1 + TIE)
    assert expected["mixed"] <= expected["long"] * (1 + TIE)
    assert expected["mixed"] < max(expected["short"], expected["long"])


def test_the_example_costs_come_back_after_planning(captured):
    before = {n.name: n.meta["pipesplit_cost"] for n in captured.gm.graph.nodes}
    _plan(captured, [LONG])
    assert {n.name: n.meta["pipesplit_cost"] for n in captured.gm.graph.nodes} == before


@pytest.mark.parametrize("given, words", [
    ([], "empty"), ([0, 8], "not a length"), ({8: -1.0}, "weight is a finite number > 0"), ("32", "takes a list"),
    ([8, 8], "twice"), ({8: float("nan")}, "finite"),
])
def test_bad_plan_lengths_are_refused(given, words):
    with pytest.raises(PlanError, match=words):
        parse_plan_lengths(given)


def test_plan_lengths_needs_a_schedule_and_one_declared_length():
    model = gpt(layers=2, dim=16, heads=2, seq=64)
    x = torch.randint(0, 100, (2, 16))
    with pytest.raises(PlanError, match="schedule"):
        pipesplit.compile(model, x, num_stages=2, dynamic_dims={"idx": 1}, plan_lengths=[16, 64])
    with pytest.raises(PlanError, match="declare"):
        pipesplit.compile(model, x, num_stages=2, schedule="1f1b", plan_lengths=[16, 64])
    with pytest.raises(PlanError, match="cost='flops'"):
        pipesplit.PlannerOptions(num_stages=2, schedule="1f1b", cost="profile", plan_lengths=[16])
    with pytest.raises(PlanError, match="takes sizes"):  # the model's position table holds 64
        pipesplit.compile(model, x, num_stages=2, schedule="1f1b", dynamic_dims={"idx": 1}, plan_lengths=[16, 128])


def test_two_dynamic_dimensions_are_ambiguous():
    class Image(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(x).relu().mean((2, 3))

    with pytest.raises(PlanError, match="ambiguous"):
        pipesplit.compile(Image(), torch.randn(2, 3, 8, 8), num_stages=1, schedule="gpipe",
                          dynamic_dims={"x": [2, 3]}, plan_lengths=[8, 16])


def test_compile_reports_the_step_at_each_length():
    model = gpt(layers=2, dim=16, heads=2, seq=128)
    prog = pipesplit.compile(model, torch.randint(0, 100, (2, 16)), num_stages=2, schedule="1f1b", num_microbatches=2,
                             dynamic_dims={"idx": 1}, plan_lengths={16: 3, 128: 1})
    plan = prog.plan
    assert plan.lengths == [16, 128] and plan.length_weights == [0.75, 0.25]
    assert plan.predicted_step_s == pytest.approx(0.75 * plan.length_steps_s[0] + 0.25 * plan.length_steps_s[1])
    assert plan.length_steps_s[0] < plan.length_steps_s[1]
    assert "length 128 (weight 0.25)" in prog.report()
    again = pipesplit.Plan.from_json(plan.to_json())
    assert again.length_steps_s == plan.length_steps_s
    x = torch.randint(0, 100, (2, 100))
    torch.testing.assert_close(prog(x), model(x))


def test_plan_lengths_beside_a_given_split_is_refused():
    model = gpt(layers=2, dim=16, heads=2, seq=64)
    with pytest.raises(PlanError, match="plan_lengths= only steer the planner"):
        pipesplit.compile(model, torch.randint(0, 100, (2, 16)), split_points=["blocks.1"], schedule="1f1b",
                          dynamic_dims={"idx": 1}, plan_lengths=[16, 64])


def test_the_memory_cap_holds_at_the_longest_length(captured):
    """Activations grow with the length: a cap the plan for the short length alone would break at the
    long one holds at every length, with the stages ``checkpoint="auto"`` chooses at the longest (4 stages:
    with 2, the last stage, its logits and the loss's gradient of them, cannot go under such a cap at all)."""
    mix = length_mix(captured.gm, captured.inputs, 0, parse_plan_lengths({SHORT: 0.5, LONG: 0.5}))
    schedule = resolve_schedule("1f1b", 4, None, 8)
    free = plan_partition(captured.gm, 4, schedule=schedule, flops_per_s=RATE, lengths=mix, order="program")
    cap = int(max(free.stage_memory) * 0.85)
    capped = plan_partition(captured.gm, 4, schedule=schedule, flops_per_s=RATE, lengths=mix, order="program",
                            max_stage_memory=cap, checkpoint="auto")
    assert max(capped.stage_memory) <= cap < max(free.stage_memory)
    assert capped.checkpoint  # only checkpointing fits it
    assert capped.predicted_step_s > free.predicted_step_s
