"""Tracing the runtime: every action recorded once, in schedule order, without changing the results."""

from __future__ import annotations

import json

import pytest
import torch

import pipesplit
from pipesplit.schedules import ActionKind
from pipesplit.units import human_seconds
from tests.zoo import MLP
from tests.training import mse


@pytest.fixture(scope="module")
def prog():
    torch.manual_seed(0)
    return pipesplit.compile(MLP(), torch.randn(8, 16), num_stages=3)


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "looped_bfs"])
def test_every_action_is_recorded_once_in_schedule_order(prog, batch, schedule):
    x, y = batch
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=mse)
    with pipe.trace() as tr:
        pipe.step(x, target=y)
        pipe.step(x, target=y)
    pipe.zero_grad()
    assert tr.num_steps == 2
    compute = [[a for a in rank if a.is_compute] for rank in pipe.schedule.actions]
    for step in range(2):
        mine = [r for r in tr.records if r.step == step]
        assert sorted(str(r.action) for r in mine) == sorted(str(a) for rank in compute for a in rank)
        for r in mine:
            assert r.rank == pipe.schedule.stage_to_rank[r.action.stage]
            assert r.start <= r.ready <= r.end
            begin, end = tr.steps[step]
            assert begin <= r.start and r.end <= end
        timeline = tr.timeline(step)
        assert [[e.action for e in rank] for rank in timeline.events] == compute
        assert 0.0 <= timeline.bubble_fraction < 1.0
        assert 0.0 < timeline.step_time <= tr.step_time(step)
    assert tr.steps[0][1] <= tr.steps[1][0]


def test_compute_starts_after_its_inputs_were_produced(prog, batch):
    x, y = batch
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=4, loss_fn=mse)
    with pipe.trace() as tr:
        pipe.step(x, target=y)
    pipe.zero_grad()
    timed = {str(r.action): r for r in tr.records}
    for r in tr.records:
        a = r.action
        if a.kind is ActionKind.FORWARD and a.stage > 0:
            assert r.ready >= timed[f"{a.stage - 1}F{a.microbatch}"].ready
        if a.kind is ActionKind.FULL_BACKWARD and a.stage < prog.num_stages - 1:
            assert r.ready >= timed[f"{a.stage + 1}B{a.microbatch}"].ready
    assert tr.median(0, "F") > 0 and tr.median(2, "B") > 0
    assert tr.median(0, "W") is None and len(tr.durations(1, "F")) == 4


def test_tracing_changes_neither_loss_nor_gradients(prog, batch):
    x, y = batch
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=mse)
    pipe.zero_grad()  # the program is shared with the other tests
    plain = pipe.step(x, target=y)
    grads = [p.grad.clone() for p in pipe.parameters()]
    pipe.zero_grad()
    with pipe.trace():
        traced = pipe.step(x, target=y)
    assert torch.equal(plain, traced)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, pipe.parameters()))
    pipe.zero_grad()
    assert all(w.tracer is None for w in pipe.workers.values())
    assert pipe._tracer is None


def test_nothing_is_recorded_outside_the_block(prog, batch):
    x, y = batch
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=mse)
    with pipe.trace() as tr:
        pipe.step(x, target=y)
    n = len(tr.records)
    pipe.step(x, target=y)
    pipe.zero_grad()
    assert len(tr.records) == n and tr.num_steps == 1


def test_chrome_trace(prog, batch, tmp_path):
    x, y = batch
    pipe = pipesplit.Pipeline(prog, "zb_h1", num_microbatches=4, loss_fn=mse)
    with pipe.trace() as tr:
        pipe.step(x, target=y)
    pipe.zero_grad()
    path = tmp_path / "trace.json"
    tr.to_chrome(path)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    actions = [e for e in events if e["ph"] == "X" and e.get("cat") not in ("wait", "step")]
    assert len(actions) == len(tr.records) == sum(a.is_compute for rank in pipe.schedule.actions for a in rank)
    for e in actions:
        a = pipesplit.schedules.Action.parse(e["name"])
        assert e["pid"] == pipe.schedule.stage_to_rank[a.stage] and e["tid"] == a.stage
        assert e["dur"] >= 0 and e["ts"] >= 0
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {(r, f"rank {r}") for r in range(3)} <= names
    assert sum(e.get("cat") == "step" for e in events) == 1


def test_eval_steps_are_traced_too(prog, batch):
    x, _ = batch
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=mse)
    with pipe.trace() as tr:
        pipe.eval(x)
    assert {r.action.kind for r in tr.records} == {ActionKind.FORWARD} and len(tr.records) == 6


def test_an_empty_trace_says_what_to_do(prog):
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=mse)
    with pipe.trace() as tr:
        pass
    with pytest.raises(pipesplit.PipesplitError, match=r"pipe.step\(...\) inside"):
        tr.timeline()
    with pytest.raises(pipesplit.PipesplitError, match="no actions"):
        tr.to_chrome()


@pytest.mark.cuda
def test_cuda_actions_are_timed_to_their_end():
    torch.manual_seed(0)
    prog = pipesplit.compile(MLP(), torch.randn(8, 16), num_stages=2, devices=["cuda", "cuda"])
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=mse)
    x, y = torch.randn(8, 16), torch.randn(8, 4, device="cuda")
    with pipe.trace() as tr:
        pipe.step(x, target=y)
    assert len(tr.records) == 16 and all(r.start <= r.ready <= r.end for r in tr.records)
    assert [[e.action for e in rank] for rank in tr.timeline().events] == [
        [a for a in rank if a.is_compute] for rank in pipe.schedule.actions]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_stage_costs_are_the_medians_of_each_stages_traced_actions(prog, batch, schedule):
    """What the benchmark reports as measured per stage: F, and the backward whole (B) or split (I, W)."""
    x, y = batch
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=mse)
    with pipe.trace() as tr:
        pipe.step(x, target=y)
    pipe.zero_grad()
    costs = tr.stage_costs()
    assert len(costs) == prog.num_stages
    for s, c in enumerate(costs):
        assert c.forward == tr.median(s, "F") > 0
        if schedule == "1f1b":
            assert (c.backward_input, c.backward_weight) == (tr.median(s, "B"), 0.0)
        else:
            assert (c.backward_input, c.backward_weight) == (tr.median(s, "I"), tr.median(s, "W"))
            assert c.backward_weight > 0


def test_a_traced_timeline_is_in_seconds_and_says_so(prog, batch):
    """tr.timeline().to_text() printed "step 0.217046": a number without its unit."""
    x, y = batch
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=mse)
    with pipe.trace() as tr:
        pipe.step(x, target=y)
    pipe.zero_grad()
    timeline = tr.timeline()
    assert timeline.unit == "s"
    head = timeline.to_text().splitlines()[0]
    assert f"step {human_seconds(timeline.step_time)}," in head
    assert any(f" {u}," in head for u in ("s", "ms", "µs")), head
