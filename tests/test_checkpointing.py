"""Activation checkpointing as a planner decision: per stage, chosen with the cuts, priced for any split, run as planned."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit import Plan, PlanError
from pipesplit.passes.plan.checkpointing import candidate_sets, describe
from tests.close import assert_close, assert_grads_close


class Deep(nn.Module):
    """Equal layers whose activations outweigh their parameters: under 1f1b the early stages hold the most."""

    def __init__(self, d: int = 64, depth: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


KW = dict(num_stages=4, schedule="1f1b", num_microbatches=8, progress=False)
QUARTERS = ["layers.4", "layers.8", "layers.12"]


@pytest.fixture(scope="module")
def deep():
    torch.manual_seed(0)
    model, x = Deep(), torch.randn(256, 64)
    free = pipesplit.compile(model, x, **KW)
    # the tightest cap (in 5% steps) that no split meets without checkpointing
    cap = int(max(free.plan.stage_memory))
    while True:
        cap = int(cap * 0.95)
        try:
            pipesplit.compile(model, x, max_stage_memory=cap, checkpoint=False, **KW)
        except PlanError:
            return model, x, free, cap


def test_candidate_sets_take_the_stages_holding_the_most_microbatches_first():
    assert candidate_sets([5, 4, 3, 2]) == [frozenset(), {0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]
    assert candidate_sets([2, 3, 3]) == [frozenset(), {1}, {1, 2}, {0, 1, 2}]
    assert describe([0, 1, 2, 5], 8) == "stages 0-2, 5 of 8" and describe([], 4) == "none of 4 stages"


def test_auto_checkpoints_the_early_stages_under_1f1b_and_beats_all_or_nothing(deep):
    model, x, free, cap = deep
    assert free.plan.checkpoint == []  # no cap: nothing to gain
    assert pipesplit.compile(model, x, checkpoint="auto", **KW).plan.checkpoint == []
    auto = pipesplit.compile(model, x, max_stage_memory=cap, checkpoint="auto", **KW).plan
    every = pipesplit.compile(model, x, max_stage_memory=cap, checkpoint=True, **KW).plan
    recomputing = sorted({*auto.checkpoint, *auto.checkpoint_partial})  # whole stages or their first blocks
    assert recomputing and recomputing[0] == 0 and 3 not in recomputing, auto.checkpoint_summary
    assert recomputing == list(range(len(recomputing)))  # the first j stages
    assert every.checkpoint == [0, 1, 2, 3]
    assert max(auto.stage_memory_bytes) <= cap and auto.max_stage_memory == cap
    assert auto.predicted_step_s < every.predicted_step_s  # fewer stages pay the second forward
    # the auto plan is no slower than the hand split of equal quarters with its own best checkpointing
    hand = pipesplit.compile(model, x, split_points=QUARTERS, schedule="1f1b", num_microbatches=8,
                             max_stage_memory=cap, checkpoint="auto", progress=False).plan
    assert max(hand.stage_memory) <= cap and (hand.checkpoint or hand.checkpoint_partial)
    assert auto.predicted_step_s <= hand.predicted_step_s * (1 + 1e-9)


def test_a_split_is_priced_under_the_schedule_and_warned_over_the_cap(deep):
    model, x, free, cap = deep
    prog = pipesplit.compile(model, x, split_points=QUARTERS, schedule="1f1b", num_microbatches=8,
                             max_stage_memory=cap, progress=False)
    plan = prog.plan
    assert plan.schedule == "1f1b" and plan.num_microbatches == 8 and plan.predicted_step_s > 0
    assert len(plan.stage_memory_bytes) == 4 and plan.checkpoint == []
    over = [s for s, m in enumerate(plan.stage_memory_bytes) if m > cap]
    assert over and over[0] == 0
    notes = [n for n in prog.notes if "over max_stage_memory" in n]
    assert len(notes) == len(over)
    assert f"stage 0 is predicted to hold" in notes[0] and f"{cap:,}" in notes[0]
    assert f"{plan.stage_memory_bytes[0]:,} bytes" in notes[0] and f"checkpoint={over}" in notes[0]
    assert "OVER" in prog.report()
    # the same split checkpointed where it needs it: exactly the stages over the cap, and under it now
    fixed = pipesplit.compile(model, x, split_points=QUARTERS, schedule="1f1b", num_microbatches=8,
                              max_stage_memory=cap, checkpoint="auto", progress=False)
    assert sorted({*fixed.plan.checkpoint, *fixed.plan.checkpoint_partial}) == over
    assert max(fixed.plan.stage_memory) <= cap
    assert not [n for n in fixed.notes if "over max_stage_memory" in n]
    assert fixed.plan.predicted_step_s > plan.predicted_step_s  # the recompute is priced
    assert "recomputes" in fixed.report() and fixed.plan.checkpoint_labels[0] in fixed.report()


def test_a_plan_with_checkpointing_saves_loads_and_is_repriced(deep, tmp_path):
    model, x, _, cap = deep
    prog = pipesplit.compile(model, x, max_stage_memory=cap, checkpoint="auto", **KW)
    path = tmp_path / "plan.json"
    prog.plan.save(path)
    loaded = Plan.load(path)
    assert loaded.checkpoint == prog.plan.checkpoint and loaded.max_stage_memory == cap
    again = pipesplit.compile(model, x, plan=path, schedule="1f1b", num_microbatches=8, max_stage_memory=cap,
                              progress=False).plan
    assert again.checkpoint == prog.plan.checkpoint
    assert again.predicted_step_s == pytest.approx(prog.plan.predicted_step_s, rel=0.05)
    assert again.stage_memory == prog.plan.stage_memory
    # a plan saved when checkpointing was all or nothing
    data = json.loads(prog.plan.to_json())
    data.pop("max_stage_memory")
    data["checkpoint"] = True
    assert Plan.from_json(json.dumps(data)).checkpoint == [0, 1, 2, 3]
    data["checkpoint"] = False
    assert Plan.from_json(json.dumps(data)).checkpoint == []


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_per_stage_checkpointed_step_equals_gradient_accumulation(schedule):
    torch.manual_seed(1)
    model = Deep(d=16, depth=8)
    x = torch.randn(8, 16)
    prog = pipesplit.compile(model, x, num_stages=4, schedule=schedule, num_microbatches=4, checkpoint=[0, 2],
                             progress=False)
    assert prog.plan.checkpoint == [0, 2]
    loss_fn = lambda out, y: torch.nn.functional.mse_loss(out, y)  # noqa: E731
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=loss_fn)
    assert {i for i, w in pipe.workers.items() if w.checkpointing} == {0, 2}  # exactly what was planned
    xb, y = torch.randn(16, 16), torch.randn(16, 16)
    loss = pipe.step(xb, target=y)
    want = sum(loss_fn(model(xm), ym) for xm, ym in zip(xb.chunk(4), y.chunk(4))) / 4
    want.backward()
    assert_close(loss, want.detach(), name="loss")
    assert_grads_close(prog.named_parameters(), model)


class _UnusedOutput(nn.Module):
    """Blocks, a head, and a second output no loss reaches (``tanh(h)``, which saves its result)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(4)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.blocks(x)
        return self.head(h), torch.tanh(h)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_checkpointed_stage_with_an_output_no_loss_reaches_keeps_nothing_after_the_step(schedule):
    """The unused output's graph holds checkpoint's frame, which held the stage's forward closure and through it
    the microbatch's record: a cycle through autograd's C++ nodes that Python's collector cannot see, so every
    step kept its microbatches' recomputed values (69 kB a step here; 2 MiB a microbatch on a review's LM).
    The step's gradients are the plain model's too."""
    import gc

    from pipesplit.bench.stage_memory import LiveBytes, counting_memory

    torch.manual_seed(0)
    model = _UnusedOutput()
    prog = pipesplit.compile(model, torch.randn(4, 8, 32), split_points=["blocks.2"], schedule=schedule,
                             num_microbatches=4, checkpoint=True, progress=False)
    loss_fn = lambda out, y: torch.nn.functional.mse_loss(out[0], y)  # noqa: E731
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=loss_fn)
    live = LiveBytes(2)
    after = []
    for i in range(3):
        pipe.zero_grad(set_to_none=True)
        xb, y = torch.randn(16, 8, 32), torch.randn(16, 8, 10)
        with counting_memory(live):
            pipe.step(xb, target=y)
        gc.collect()
        after.append(list(live.live))
    assert after[0] == after[1] == after[2], after  # the gradients, made in step 0 and kept; nothing else
    model.zero_grad(set_to_none=True)
    want = sum(loss_fn(model(xm), ym) for xm, ym in zip(xb.chunk(4), y.chunk(4))) / 4
    want.backward()
    assert_grads_close(prog.named_parameters(), model)


def test_bad_checkpoint_choices_are_refused_with_the_fix():
    model, x = Deep(d=8, depth=4), torch.randn(4, 8)
    with pytest.raises(PlanError, match="checkpoint must be 'auto', True, False, a list of stage indices"):
        pipesplit.compile(model, x, num_stages=2, checkpoint="some")
    with pytest.raises(PlanError, match=r"checkpoint names stages \[5\]; a plan of 2 stages has stages 0..1"):
        pipesplit.compile(model, x, num_stages=2, schedule="1f1b", checkpoint=[5], progress=False)


def test_mixed_precision_adamw_holds_16_bytes_a_parameter_and_the_optimizer_its_own_state():
    from pipesplit.passes.plan.objective import MemoryModel
    from pipesplit.passes.plan.chain import build_chain
    from pipesplit.passes.annotate.costs import annotate_costs
    from pipesplit.capture import capture

    model = Deep(d=32, depth=2).to(torch.bfloat16)
    gm = annotate_costs(capture(model, torch.randn(4, 32, dtype=torch.bfloat16)).gm)
    n = sum(p.numel() for p in model.parameters())
    act = lambda chain: int(chain.act.sum())  # noqa: E731
    for memory, per_param in [(MemoryModel(optimizer="adamw", master_weights=True), 16), (MemoryModel(), 8),
                              (MemoryModel(optimizer="sgd"), 4), (MemoryModel(optimizer="momentum"), 6),
                              (MemoryModel(optimizer="adafactor", master_weights=True), 8)]:
        chain = build_chain(gm, lambda node: 1.0, state_factor=memory.state_factor_for)
        assert chain.total_memory() - act(chain) == n * per_param, memory
    with pytest.raises(PlanError, match="optimizer=.lion.. is not one it knows"):
        MemoryModel(optimizer="lion")


def test_on_cuda_the_cap_defaults_to_the_device_memory_less_the_margin(monkeypatch):
    from types import SimpleNamespace
    from pipesplit.passes.plan import pricing

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 2**30))
    assert pricing.device_memory_cap(["cuda:0", "cuda:1"]) == int(80 * 2**30 * (1 - pricing.DEVICE_MEMORY_MARGIN))
    assert pricing.device_memory_cap(["cpu"]) is None


def test_a_checkpointed_stage_under_a_split_backward_is_charged_the_forwards_the_runtime_runs():
    """Under zb_h1 a checkpointed stage runs its whole backward in I, recomputing its forward once, and
    nothing in W. Its I used to keep the recomputed graph for W, which recomputed it again (3 forwards a
    microbatch) and held it until the step ended (a GPT's checkpointed stage next to plain ones: 89 MiB
    measured, 62 without; benchmarks/bench_memory.py); the model charged I = F + I, W = F + I + W."""
    import numpy as np

    from pipesplit.models import gpt
    from pipesplit.passes.plan.chain import Chain
    from pipesplit.passes.plan.objective import CommModel, MemoryModel, split_stages
    from pipesplit.passes.plan.step_planner import figures_for
    from pipesplit.schedules import get_schedule

    torch.manual_seed(0)
    model, m = gpt(layers=2, dim=32, vocab=64, seq=16, heads=2), 4
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=2, schedule="zb_h1",
                             num_microbatches=m, checkpoint=True, progress=False)
    calls = [0, 0]
    for s, stage in enumerate(prog.stages):
        # a pre-hook: a recompute stops early (it raises once it has what the backward needs)
        stage.module.register_forward_pre_hook(lambda *_, s=s: calls.__setitem__(s, calls[s] + 1))
    pipe = pipesplit.Pipeline(prog, "zb_h1", num_microbatches=m,
                              loss_fn=lambda o, y: torch.nn.functional.cross_entropy(o.flatten(0, 1), y.flatten()))
    pipe.step(torch.randint(0, 64, (2 * m, 16)), target=torch.randint(0, 64, (2 * m, 16)))
    assert calls == [2 * m, 2 * m]

    n = 4
    chain = Chain([None] * n, np.ones(n), np.zeros(n, np.int64), np.zeros(n + 1, np.int64), np.ones(n + 1, bool))
    seconds = np.array([[1.0, 2.0, 4.0]] * n)  # per node F, I, W
    schedule = get_schedule("zb_h1", num_stages=2, num_microbatches=m)
    assert set(split_stages(schedule)) == {0, 1}
    fig = figures_for(chain, [0, 2], seconds, [2, 1], MemoryModel(), CommModel(), "cpu", None, {0, 1},
                      split=split_stages(schedule))
    f, i, w = 2.0, 4.0, 8.0  # a stage of two nodes
    assert [(c.forward, c.backward_input, c.backward_weight) for c in fig.costs] == [(f, f + i + w, 0.0)] * 2
    plain = figures_for(chain, [0, 2], seconds, [2, 1], MemoryModel(), CommModel(), "cpu", None, {0, 1})
    assert [(c.forward, c.backward_input, c.backward_weight) for c in plain.costs] == [(f, f + i, w)] * 2
