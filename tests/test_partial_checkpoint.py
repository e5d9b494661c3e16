"""Activation checkpointing within a stage: the first blocks of a stage recompute, planned, priced and run as planned."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

import pipesplit
from pipesplit import Plan, PipesplitError, PlanError
from pipesplit.models import GPT, GPTConfig
from tests.close import assert_close, assert_grads_close
from tests.test_checkpointing import KW, QUARTERS, Deep
from tests.training import dot_loss


@pytest.fixture(scope="module")
def deep():
    """The model, its example, and a cap 15% under the largest stage of the plan made without one."""
    torch.manual_seed(0)
    model, x = Deep(), torch.randn(256, 64)
    free = pipesplit.compile(model, x, **KW)
    return model, x, free, int(max(free.plan.stage_memory) * 0.85)


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _assert_accumulates(prog, model, loss, xb, y, m=4):
    """``loss`` and the program's gradients equal gradient accumulation of ``_mse`` over ``m`` microbatches."""
    want = sum(_mse(model(xm), ym) for xm, ym in zip(xb.chunk(m), y.chunk(m))) / m
    want.backward()
    assert_close(loss, want.detach(), name="loss")
    assert_grads_close(prog.named_parameters(), model)


def test_auto_recomputes_only_the_blocks_a_stage_needs_and_beats_whole_stages(deep):
    model, x, free, cap = deep
    auto = pipesplit.compile(model, x, max_stage_memory=cap, checkpoint="auto", **KW)
    plan = auto.plan
    assert plan.checkpoint_partial and 0 in plan.checkpoint_partial, plan.checkpoint_summary
    assert 3 not in plan.checkpoint_partial and 3 not in plan.checkpoint  # the last stage holds the fewest
    assert max(plan.stage_memory_bytes) <= cap
    # the best of whole stages (the set search alone, on the same split search) is slower
    stages = [pipesplit.compile(model, x, max_stage_memory=cap, checkpoint=list(range(j)), **KW).plan
              for j in (1, 2, 3)]
    whole = min(p.predicted_step_s for p in stages if max(p.stage_memory) <= cap)
    assert plan.predicted_step_s < whole
    assert plan.checkpoint_summary[0].startswith("stage 0: block") and "recomputed" in plan.checkpoint_summary[0]
    assert plan.checkpoint_summary[3] == "stage 3: nothing recomputed"
    assert plan.checkpoint_labels[0] in auto.report() and "partly checkpointed" in repr(plan)
    # the hand split of equal quarters, priced with checkpoint="auto": each stage over the cap recomputes a head
    hand = pipesplit.compile(model, x, split_points=QUARTERS, schedule="1f1b", num_microbatches=8,
                             max_stage_memory=cap, checkpoint="auto", progress=False).plan
    assert hand.checkpoint_partial and max(hand.stage_memory) <= cap
    assert plan.predicted_step_s <= hand.predicted_step_s * (1 + 1e-9)


def test_a_dict_asks_for_the_first_blocks_of_stages_and_a_saved_plan_keeps_them(deep, tmp_path):
    model, x, _, cap = deep
    prog = pipesplit.compile(model, x, split_points=QUARTERS, schedule="1f1b", num_microbatches=8,
                             max_stage_memory=cap, checkpoint={0: 2, 1: 4}, progress=False)
    plan = prog.plan
    assert plan.checkpoint == [1]  # all 4 blocks of stage 1: the whole stage
    assert plan.checkpoint_partial == {0: 2 * 2} and plan.checkpoint_labels == {0: "blocks 0-1 of 4 (layers.0 to layers.1)"}
    none = pipesplit.compile(model, x, split_points=QUARTERS, schedule="1f1b", num_microbatches=8, progress=False).plan
    assert plan.stage_memory[0] < none.stage_memory[0] and plan.stage_memory[2:] == none.stage_memory[2:]
    assert plan.predicted_step_s > none.predicted_step_s
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.checkpoint_partial == plan.checkpoint_partial and loaded.checkpoint_labels == plan.checkpoint_labels
    again = pipesplit.compile(model, x, plan=path, schedule="1f1b", num_microbatches=8, progress=False).plan
    assert again.checkpoint_partial == plan.checkpoint_partial and again.stage_memory == plan.stage_memory
    data = json.loads(plan.to_json())
    data["checkpoint_partial"] = {"0": 99}
    with pytest.raises(PlanError, match="field 'checkpoint_partial' must be stage index -> how many"):
        Plan.from_json(json.dumps(data))


def test_bad_partial_choices_are_refused_with_the_fix():
    model, x = Deep(d=8, depth=4), torch.randn(4, 8)
    with pytest.raises(PlanError, match=r"a dict maps a stage index to how many of its first blocks.*got 0: 0"):
        pipesplit.compile(model, x, num_stages=2, schedule="1f1b", checkpoint={0: 0})
    with pytest.raises(PlanError, match=r"got 0: True"):
        pipesplit.compile(model, x, num_stages=2, schedule="1f1b", checkpoint={0: True})
    with pytest.raises(PlanError, match=r"asks stage 1 to recompute 3 blocks, but it has 2; ask for 1 to 2"):
        pipesplit.compile(model, x, num_stages=2, schedule="1f1b", checkpoint={1: 3}, progress=False)
    with pytest.raises(PlanError, match=r"asks stage 1 to recompute 3 blocks, but it has 2"):  # without a schedule too
        pipesplit.compile(model, x, num_stages=2, checkpoint={1: 3}, progress=False)
    with pytest.raises(PlanError, match=r"pass schedule= and num_microbatches= too"):  # a given split is not balanced
        pipesplit.compile(model, x, split_points=["layers.2"], checkpoint={0: 1}, progress=False)
    assert pipesplit.compile(model, x, num_stages=2, checkpoint={0: 1}, progress=False).plan.checkpoint_partial == {0: 2}


def _count_heads(monkeypatch):
    """Count the runs of every recomputed head: its forward and its recompute in the backward."""
    from pipesplit.runtime.engine import recompute_head

    runs = [0]
    real = recompute_head.checkpoint

    def counting(fn, *args, **kwargs):
        def counted(*a):
            runs[0] += 1
            return fn(*a)
        assert kwargs == {"use_reentrant": False, "preserve_rng_state": False}
        return real(counted, *args, **kwargs)

    monkeypatch.setattr(recompute_head, "checkpoint", counting)
    return runs


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_partly_checkpointed_step_equals_gradient_accumulation_in_float64(schedule, monkeypatch):
    torch.manual_seed(1)
    model = Deep(d=16, depth=8).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    prog = pipesplit.compile(model, x, num_stages=2, schedule=schedule, num_microbatches=4, checkpoint={0: 2, 1: 3},
                             progress=False)
    assert prog.plan.checkpoint == [] and prog.plan.checkpoint_partial == {0: 4, 1: 6}
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=_mse)
    assert {i: len(w.head) for i, w in pipe.workers.items()} == {0: 4, 1: 6}  # exactly what was planned
    assert not any(w.checkpointing for w in pipe.workers.values())
    runs = _count_heads(monkeypatch)
    xb, y = torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)
    loss = pipe.step(xb, target=y)
    assert runs[0] >= 2 * 2 * 4, runs  # each stage's head, for each microbatch, again in its backward
    _assert_accumulates(prog, model, loss, xb, y)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dropout_is_bit_identical_with_part_of_each_stage_recomputed(compiled):
    """Compiled, the head and the tail are two graphs and the recompute calls the same compiled head."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, dim=32, layers=4, heads=2, seq=16, dropout=0.3)).double()
    x, t = torch.randint(0, 64, (8, 16)), torch.randn(8, 16, 64, dtype=torch.float64)
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=2, checkpoint={0: 1, 1: 1},
                             progress=False)
    assert len(prog.plan.checkpoint_partial) == 2 and prog.plan.checkpoint == []
    results = []
    for schedule, ckpt in [("1f1b", False), ("1f1b", None), ("zb_h1", None)]:  # None: as planned
        pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum",
                                  checkpoint=ckpt, compile={"backend": "aot_eager"} if compiled else False,
                                  progress=False)
        assert all(bool(w.head) == (ckpt is None) for w in pipe.workers.values())
        torch.manual_seed(7)
        pipe.zero_grad()
        loss = pipe.step(x, target=t)
        if compiled:
            parts = [getattr(m, "pipesplit_part", "") for m in pipe.compiler._compiled.keys()]
            assert pipe.compiler.eager == [] and parts.count("head") == (2 if ckpt is None else 0), (schedule, parts)
        results.append((loss.detach().clone(), {n: p.grad.clone() for n, p in pipe.named_parameters()}))
    first = results[0]
    for loss, grads in results[1:]:  # a mask drawn anew in the recompute would change the gradients
        assert torch.equal(loss, first[0])
        for name, g in grads.items():
            assert torch.equal(g, first[1][name]), name


class _Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_recomputed_head_that_updates_batchnorm_stats_is_refused():
    prog = pipesplit.compile(_Normed(), torch.randn(8, 8), num_stages=2, schedule="1f1b", num_microbatches=2,
                             checkpoint={0: 1}, progress=False)
    with pytest.raises(PipesplitError, match="stage 0 recomputes its first .* update buffers in place"):
        pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=_mse)
    pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=_mse, checkpoint=False)  # the way out it names


class _Norms(nn.Module):
    """The fuzz case's model: a dead branch and two GroupNorms over transposed rows."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.GroupNorm(2, 8, affine=False)
        self.a2, self.b2 = nn.Parameter(torch.randn(8) * 0.5), nn.Parameter(torch.randn(8) * 0.5)
        self.l4 = nn.GroupNorm(2, 8, affine=True)

    def forward(self, x):
        v1 = self.l1(x.transpose(1, 2)).transpose(1, 2)
        v1 * (self.a2 + self.b2) + self.b2  # noqa: B018 (dead: export drops it)
        return self.l4((x * 0.5).transpose(1, 2)).transpose(1, 2)


def test_a_partly_checkpointed_stage_survives_a_new_batch_size():
    """Found by the one-hour fuzz run (seed 2712, case 306): the re-capture at a new batch size names the
    stages' nodes afresh, and a head named by the old graph's nodes was refused ("none of which its graph
    has now"). The head carries over to the new capture; the step equals gradient accumulation."""
    torch.manual_seed(0)
    model = _Norms().double()
    prog = pipesplit.compile(model, torch.randn(2, 4, 8, dtype=torch.float64), num_stages=4, cost="uniform",
                             checkpoint={0: 1, 2: 1, 3: 1}, progress=False)
    pipe = pipesplit.Pipeline(prog, "zb_h1", num_microbatches=1, loss_fn=dot_loss, loss_reduction="sum")
    x, y = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(1, 4, 8, dtype=torch.float64)
    loss = pipe.step(x, target=y)  # a batch of 1, captured at 2: a re-capture
    want = dot_loss(model(x), y)
    want.backward()
    assert_close(loss, want.detach(), name="loss")
    assert_grads_close(prog.named_parameters(), model)


def _blocks(depth=4, dim=16, dropout=0.0):
    """A stack of the GPT's blocks over float embeddings, so the caller's input gets a gradient too."""
    from pipesplit.models import Block

    return nn.Sequential(*[Block(GPTConfig(dim=dim, heads=2, seq=8, dropout=dropout)) for _ in range(depth)])


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_partly_checkpointed_stage_runs_compiled_and_equals_gradient_accumulation(schedule, recwarn):
    """Under compile= the recomputed head and the kept tail run as two compiled graphs (they ran eager before,
    the rest of the pipeline compiled); under zb_h1 the stage runs its whole backward at I (a compiled backward
    runs once). Loss, every parameter's and the input's gradient, and the optimizer's next step."""
    torch.manual_seed(0)
    model = _blocks().double()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randn(2, 8, 16, dtype=torch.float64), num_stages=2, checkpoint={0: 1},
                             progress=False)
    assert prog.plan.checkpoint == [] and list(prog.plan.checkpoint_partial) == [0]
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum",
                              compile={"backend": "aot_eager"}, progress=False)
    x = torch.randn(8, 8, 16, dtype=torch.float64, requires_grad=True)
    xr, t = x.detach().clone().requires_grad_(), torch.randn(8, 8, 16, dtype=torch.float64)
    loss = pipe.step(x, target=t)
    want = sum(dot_loss(ref(xm), tm) for xm, tm in zip(xr.chunk(4), t.chunk(4)))
    want.backward()
    assert_close(loss, want.detach(), name="loss")
    assert_grads_close(prog.named_parameters(), ref)
    assert_close(x.grad, xr.grad, name="input gradient")
    for opt in (torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)):
        opt.step()
    held = dict(prog.named_parameters())
    for name, p in ref.named_parameters():
        assert_close(held[name].detach(), p.detach(), name=f"{name} after a step")
    # compiled: the head and the tail, no stage eager, no warning saying so
    parts = sorted(getattr(m, "pipesplit_part", "") for m in pipe.compiler._compiled.keys())
    assert parts == ["", "head", "tail"] if schedule == "1f1b" else parts[-2:] == ["head", "tail"], parts
    assert pipe.compiler.eager == [] and not [w for w in recwarn if "runs eager" in str(w.message)]


def test_pipeline_takes_the_first_blocks_of_stages_as_compile_does(monkeypatch):
    torch.manual_seed(1)
    model = Deep(d=16, depth=8).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    halves = dict(split_points=["layers.4"], schedule="1f1b", num_microbatches=4, progress=False)
    planned = pipesplit.compile(model, x, checkpoint={0: 1}, **halves).plan
    prog = pipesplit.compile(model, x, checkpoint={0: 3}, **halves)
    assert prog.plan.checkpoint_partial == {0: 6}
    # the Pipeline's choice, not the plan's: stage 0's first block (as compile counts it), stage 1 whole
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=_mse, checkpoint={0: 1, 1: 4})
    assert len(pipe.workers[0].head) == planned.checkpoint_partial[0] == 2
    assert pipe.workers[1].checkpointing and not pipe.workers[1].head and not pipe.workers[0].checkpointing
    runs = _count_heads(monkeypatch)
    xb, y = torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)
    loss = pipe.step(xb, target=y)
    assert runs[0] == 2 * 4  # stage 0's head, for each microbatch, again in its backward
    assert [h.num_nodes for h in pipe.workers[0]._heads.values()] == [2]  # as asked, not the plan's 6
    _assert_accumulates(prog, model, loss, xb, y)


def test_pipeline_refuses_bad_blocks_with_the_numbers():
    model, x = Deep(d=8, depth=4), torch.randn(4, 8)
    prog = pipesplit.compile(model, x, num_stages=2, progress=False)
    for bad, match in [({2: 1}, r"checkpoint names stages \[2\]; a plan of 2 stages has stages 0..1"),
                       ({1: 3}, r"asks stage 1 to recompute 3 blocks, but it has 2; ask for 1 to 2"),
                       ({0: 0}, r"a dict maps a stage index to how many of its first blocks.*got 0: 0"),
                       ({0: 1.5}, r"got 0: 1.5"), ("all", r"checkpoint must be True, False, None .* or a dict")]:
        with pytest.raises(PipesplitError, match=match):
            pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=_mse, checkpoint=bad)


class _InplaceRelu(nn.Module):
    def forward(self, x):
        return x.relu_()


class _WritesItsInput(nn.Module):
    """The fuzz case's model (seed 177 of the compiled partial draws): stage 1's head is ``relu_`` on its input."""

    def __init__(self):
        super().__init__()
        self.ln, self.act = nn.LayerNorm(8), _InplaceRelu()

    def forward(self, x):
        v = x * 2
        return self.act(self.ln(v)) + v


@pytest.mark.parametrize("compiled", [False, True])
def test_a_head_that_writes_its_input_in_place_recomputes_from_the_input_as_it_came(compiled):
    """Found by the fuzzer's compiled partial draws, eager too: the stage cloned the inputs it writes outside the
    head's checkpoint, so the head's relu_ wrote the very tensor the recompute replays from (autograd's "modified
    by an inplace operation"). The clones are made inside what recomputes; the tail reads the written ones."""
    torch.manual_seed(0)
    model = _WritesItsInput().double()
    prog = pipesplit.compile(model, torch.randn(2, 4, 8, dtype=torch.float64), split_points=["act"],
                             schedule="1f1b", num_microbatches=2, checkpoint={1: 1}, progress=False)
    assert prog.plan.stages[1][0] == "relu_" and prog.plan.checkpoint_partial == {1: 1}, prog.plan.stages
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum",
                              compile={"backend": "aot_eager"} if compiled else False, progress=False)
    x, t = torch.randn(4, 4, 8, dtype=torch.float64), torch.randn(4, 4, 8, dtype=torch.float64)
    loss = pipe.step(x, target=t)
    want = sum(dot_loss(model(xm), tm) for xm, tm in zip(x.chunk(2), t.chunk(2)))
    want.backward()
    assert_close(loss, want.detach(), name="loss")
    assert_grads_close(prog.named_parameters(), model)


def test_the_head_search_charges_a_split_backward_stage_what_its_figures_do():
    """Under a split (zero-bubble) schedule a stage recomputing its head runs its whole backward in I, so
    nothing waits for W: the first-blocks search must count it as the plan's figures do (one formula,
    ``stage_bytes(split=True)``). The cap is stage 0's figure with its shortest head: the search must take
    that head, not a longer one (it overcharged such a stage by the units waiting for W)."""
    from pipesplit.passes.plan.chain import build_chain, compute_nodes
    from pipesplit.passes.plan.objective import (
        CommModel, MemoryModel, activation_units_per_stage, in_flight_per_stage, split_stages,
    )
    from pipesplit.passes.plan.partial_checkpoint import find_blocks
    from pipesplit.passes.plan.partial_search import with_shortest_heads
    from pipesplit.passes.plan.planner import cost_function
    from pipesplit.passes.plan.step_planner import figures_for, node_seconds
    from pipesplit.schedules import get_schedule

    torch.manual_seed(0)
    prog = pipesplit.compile(Deep(), torch.randn(256, 64), split_points=QUARTERS, progress=False)
    gm, memory = prog.captured_gm, MemoryModel()
    name, fn = cost_function("flops")
    chain = build_chain(gm, fn, state_factor=memory.state_factor_for, order=compute_nodes(gm))
    seconds = node_seconds(chain.nodes, name, fn, 5e10)
    starts = tuple(int(x) for x in np.cumsum([0] + [len(s) for s in prog.plan.stages[:-1]]))
    sched = get_schedule("zb_h1", num_stages=4, num_microbatches=8)
    split, in_flight, units = split_stages(sched), in_flight_per_stage(sched), activation_units_per_stage(sched)
    assert 0 in split and units[0] > in_flight[0] + 0.25  # stage 0 would hold microbatches waiting for W
    blocks, comm = find_blocks(chain), CommModel()
    first = blocks.ends(starts[0], starts[1])[0]
    fig = figures_for(chain, starts, seconds, in_flight, memory, comm, "cpu", units, (), {0: first}, split=split)
    cap = int(fig.memory[0])
    plain = figures_for(chain, starts, seconds, in_flight, memory, comm, "cpu", units, ())
    assert plain.memory[0] > cap  # stage 0 needs a head to fit
    got = with_shortest_heads(chain, blocks, starts, seconds, sched, memory, comm, "cpu", cap)
    assert got is not None and got.heads.get(0) == first, (got and got.heads, first)
    assert got.figures.memory[0] == fig.memory[0]
