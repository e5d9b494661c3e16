"""compile()'s planner options as one frozen value (pipesplit.PlannerOptions) and as keywords."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit import PlannerOptions
from pipesplit.errors import PipesplitError, PlanError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(6)])


def test_options_plan_what_the_same_keywords_plan():
    model, x = _model(), torch.randn(4, 16)
    opts = PlannerOptions(num_stages=3, slack=0.2, no_split=["0", "1"], schedule="1f1b", num_microbatches=4)
    by_options = pipesplit.compile(model, x, planner=opts, progress=False)
    by_keywords = pipesplit.compile(model, x, num_stages=3, slack=0.2, no_split=["0", "1"], schedule="1f1b",
                                    num_microbatches=4, progress=False)
    assert by_options.plan.stages == by_keywords.plan.stages
    assert by_options.num_stages == 3
    torch.testing.assert_close(by_options(x), model(x))
    again = pipesplit.compile(model, x, planner=dataclasses.replace(opts, num_stages=2), progress=False)
    assert again.num_stages == 2 and opts.num_stages == 3, "replace() makes a new value; the old one is unchanged"


def test_options_are_frozen_and_hold_their_own_copies():
    pins = {"2": 1}
    opts = PlannerOptions(num_stages=2, pins=pins, no_split=["0"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.num_stages = 4  # type: ignore[misc]
    pins["2"] = 0
    assert opts.pins == {"2": 1} and opts.no_split == ("0",)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_stages": 0}, "num_stages must be at least 1, got 0."),
    ({"num_stages": 2.5}, "num_stages must be a whole number of stages"),
    ({"recompute": "sometimes"}, "recompute must be 'auto' or 'never', got 'sometimes'."),
    ({"order": "random"}, "order must be 'auto' or 'program', got 'random'."),
    ({"refine": 2}, "refine=2: refining corrects profiled times with measured ones"),
    ({"slack": -0.1}, "slack must be a fraction >= 0 of the optimal bottleneck, got -0.1."),
])
def test_a_bad_option_fails_where_the_options_are_built(kwargs, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        PlannerOptions(**kwargs)


def test_a_bad_keyword_fails_before_the_export_with_the_same_message(monkeypatch):
    def no_export(*args, **kwargs):
        raise AssertionError("compile exported before checking its options")

    monkeypatch.setattr(torch.export, "export", no_export)
    with pytest.raises(PlanError, match="recompute must be 'auto' or 'never'"):
        pipesplit.compile(_model(), torch.randn(4, 16), recompute="sometimes")


def test_options_and_keywords_cannot_be_mixed():
    with pytest.raises(PipesplitError, match=r"slack=, num_stages=|num_stages=, slack="):
        pipesplit.compile(_model(), torch.randn(4, 16), planner=PlannerOptions(num_stages=2), num_stages=2, slack=0.2)
    with pytest.raises(PipesplitError, match=r"^slack= given beside planner="):  # at its default value, too
        pipesplit.compile(_model(), torch.randn(4, 16), planner=PlannerOptions(slack=0.2), slack=0.05)
    with pytest.raises(PipesplitError, match="planner= takes a pipesplit.PlannerOptions, got dict"):
        pipesplit.compile(_model(), torch.randn(4, 16), planner={"num_stages": 2})  # type: ignore[arg-type]


def test_planner_options_beside_a_fixed_split_are_refused_as_keywords_are():
    with pytest.raises(PlanError, match="slack= only steer the planner, and split_points= fixes the split"):
        pipesplit.compile(_model(), torch.randn(4, 16), split_points=["3"], planner=PlannerOptions(slack=0.2))


def test_an_unknown_cost_or_schedule_fails_where_the_options_are_built():
    from pipesplit.errors import CostError, ScheduleError

    with pytest.raises(CostError, match="unknown cost 'flop'"):
        PlannerOptions(cost="flop")
    with pytest.raises(ScheduleError, match="1f1c"):
        PlannerOptions(schedule="1f1c")
