"""The planner keeps each in-place write in one stage with the reads a cut would separate from it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.capture import capture
from pipesplit.passes.annotate.costs import annotate_costs
from pipesplit.passes.plan.chain import build_chain, compute_nodes
from pipesplit.passes.plan.inplace import keep_writes_with_reads, write_requirements
from tests.close import assert_close, assert_grads_close
from tests.training import dot_loss


class ViewReadAfterWrite(nn.Module):
    """The fuzzer's seed 4141, by hand: a view of an activation made before ``mul_`` writes it, and read
    at the end. The planner cut between the view and the write and again after the write (3 and 4
    stages, uniform cost): the split refused its own plan (the writing stage writes its copy)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.l0, self.l1, self.l2, self.l3, self.l4, self.l5 = (nn.Linear(d, d) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x)
        v = h[..., :4]
        g = self.l2(torch.tanh(self.l1(torch.tanh(h))))  # tanh saves its output: h is free to be written
        h.mul_(2.0)
        g = self.l4(torch.tanh(self.l3(g + h)))
        return self.l5(g) + v.sum(-1, keepdim=True)


class InputWrittenThenRead(nn.Module):
    """The fuzzer's seed 4343, by hand: ``x.mul_`` (its result unused) between a branch that read ``x``
    and one that reads it after. With 4 stages (FLOPs) the planner gave the write a stage that neither
    reader's stage depends on: refused by the Pipeline, as nothing ordered the reads and the write."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l1(torch.tanh(self.l0(torch.tanh(x))))
        x.mul_(2.0)
        b = self.l3(torch.tanh(self.l2(x)))
        return a + b


class ViewOfAnInputReadAfterItsWrite(nn.Module):
    """A view of the input, the input written in place, the view read: one cut is left (after the write)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x[..., :4]
        x.mul_(2.0)
        return torch.tanh(v)


def _step_equals_accumulation(model: nn.Module, num_stages: int, cost: str, m: int = 2) -> pipesplit.SplitProgram:
    """Compiled with no split points, one step in float64 equals plain gradient accumulation: the loss,
    the outputs, every gradient, and the caller's input after the step (the models write it)."""
    torch.manual_seed(0)
    model = model.double()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(copy.deepcopy(model), torch.randn(2, 4, 8, dtype=torch.float64), num_stages=num_stages,
                             cost=cost, progress=False)
    assert prog.num_stages == num_stages
    x, target = torch.randn(4, 4, 8, dtype=torch.float64), torch.randn(4, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        a, b = x.clone(), x.clone()
        assert_close(prog(a), model(b), name="outputs")
        assert_close(a, b, name="the input after the forward")
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=m, loss_fn=dot_loss, loss_reduction="sum")
    x_ref, x_pipe = x.clone(), x.clone()
    want = torch.zeros((), dtype=torch.float64)
    for xm, tm in zip(x_ref.chunk(m), target.chunk(m)):  # a backward per microbatch: the next one writes x
        loss = dot_loss(ref(xm), tm)
        loss.backward()
        want += loss.detach()
    assert_close(pipe.step(x_pipe, target=target), want, name="loss")
    assert all(p.grad is not None for p in ref.parameters())
    assert_grads_close(pipe.named_parameters(), ref)
    assert_close(x_pipe, x_ref, name="the caller's input after the step")
    return prog


@pytest.mark.parametrize("num_stages", [3, 4])
def test_an_alias_read_after_a_write_is_not_cut_from_it(num_stages):
    prog = _step_equals_accumulation(ViewReadAfterWrite(), num_stages, "uniform")
    where = prog.plan.assignment()
    assert where["linear"] == where["slice_1"] == where["mul_"], prog.plan.stages


def test_an_input_written_then_read_keeps_its_stages_ordered():
    _step_equals_accumulation(InputWrittenThenRead(), 4, "flops")


def test_split_points_that_cut_between_a_write_and_a_read_are_still_refused():
    """The planner avoids the cut; a user who names it gets the split's refusal, as before."""
    with pytest.raises(pipesplit.PipesplitError, match=r"writes 'linear' in place \('mul_'\), and 'sum_1' in stage "
                       r"2 reads 'slice_1', an alias of it, after that write"):
        pipesplit.compile(ViewReadAfterWrite(), torch.randn(2, 4, 8), split_points=["l1", "l3"], progress=False)


def test_too_few_cuts_left_names_the_write_and_the_fix():
    model, x = ViewOfAnInputReadAfterItsWrite(), torch.randn(2, 4, 8)
    prog = pipesplit.compile(model, x, num_stages=2, cost="uniform", progress=False)
    assert prog.plan.stages == [["slice_1", "mul_"], ["tanh"]]
    with pytest.raises(pipesplit.PipesplitError, match=r"num_stages=3 needs 2 cut\(s\), but in-place writes leave only 1 "
                       r"of the graph's 2 places to cut: 'mul_' \(aten.mul_.Tensor\) writes 'x' in place, and "
                       r"'(slice_1|tanh)' reads .*Use num_stages <= 2, or write out of place "
                       r"in the model \(x = x.mul\(2.0\) instead of x.mul_\(2.0\)"):
        pipesplit.compile(model, x, num_stages=3, cost="uniform", progress=False)


def test_a_graph_without_writes_keeps_every_cut():
    from pipesplit.models import gpt

    model = gpt(layers=2, dim=16, vocab=32, seq=8, heads=2)
    gm = annotate_costs(capture(model, torch.randint(0, 32, (2, 8))).gm)
    assert write_requirements(gm) == []


def test_the_op_that_made_a_view_read_after_the_write_stays_with_the_write():
    """Only the cuts between the ops that made the written storage's tensors (``linear``, its view
    ``slice_1``) and the write go: keeping the write with the read at the end instead would have its
    stage receive both tensors of one storage, which the split refuses too."""
    gm = annotate_costs(capture(ViewReadAfterWrite(), torch.randn(2, 4, 8)).gm)
    nodes = compute_nodes(gm)
    chain = build_chain(gm, lambda n: 1.0)
    allowed, spans = keep_writes_with_reads(nodes, chain.allowed, write_requirements(gm))
    names = [n.name for n in nodes]
    lo, hi = names.index("linear"), names.index("mul_")
    assert sorted((s[1], s[2]) for s in spans) == [(lo, hi), (names.index("slice_1"), hi)]
    assert not allowed[lo + 1 : hi + 1].any() and allowed[: lo + 1].all() and allowed[hi + 1 :].all()
