"""interop.chain_modules: the split as a chain of modules that PyTorch's PipelineStage can run.

The two-rank run against torch.distributed.pipelining is in test_distributed.py; these
run the chain in one process, stage after stage, as PipelineStage would call it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.interop import chain_modules
from tests.close import assert_close


class TimeMajor(nn.Module):
    """Inputs (time, batch, features): the batch is dimension 1, and its size, read in the
    first layer, is used after the cut to reshape."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        t, b = x.shape[0], x.shape[1]
        h = self.b(torch.relu(self.a(x)))
        return self.c(h).reshape(t * b, 4).sum(0, keepdim=True).expand(b, 4)


def _run_chain(prog, x):
    out = prog.flat_tensor_inputs(x)
    for module in chain_modules(prog):
        out = module(*out)
        out = out if isinstance(out, tuple) else (out,)
    return out[0]


def test_chain_reads_the_microbatch_size_from_the_batch_dimension():
    torch.manual_seed(0)
    model = TimeMajor()
    prog = pipesplit.compile(model, torch.randn(5, 4, 8), split_points=["b", "c"], batch_dim=1, progress=False)
    x = torch.randn(5, 3, 8)  # another batch size, and another than the time length
    assert_close(_run_chain(prog, x), model(x), name="output of the chain")
    assert any(b.kind != "tensor" for b in prog.boundaries), "the test needs a size that crosses a cut"


def test_a_weight_tied_across_stages_is_refused_without_a_way_to_sum_its_gradient():
    """Issue 38: torch's schedules leave each stage its own share of a tied weight's gradient; to_pipeline_stage
    names the tie and the fix instead of training on a share."""
    from pipesplit.interop import tied_across_stages, to_pipeline_stage
    from pipesplit.models import gpt

    torch.manual_seed(0)
    prog = pipesplit.compile(gpt(layers=2, dim=16, vocab=32, seq=8, heads=2), torch.randint(0, 32, (2, 8)),
                             num_stages=2, progress=False)
    assert list(tied_across_stages(prog).values()) == [[0, 1]]
    with pytest.raises(pipesplit.PipesplitError, match=r"ties weights across stages: tok.weight/head.weight \(stages 0, "
                                                       r"1\).*tied_grads='sum'.*sum_tied_grads"):
        to_pipeline_stage(prog, 1, device="cpu")
    with pytest.raises(pipesplit.PipesplitError, match=r"tied_grads='yes'\): pass 'refuse' \(the default\) or 'sum'"):
        to_pipeline_stage(prog, 1, device="cpu", tied_grads="yes")


def test_sum_tied_grads_in_one_process_puts_the_whole_gradient_on_the_first_holder():
    """Without torch.distributed the stages given are every stage that ran: the shares (here already moved to
    the owner by the program's own hook) end up once, on the first stage's tensor."""
    from pipesplit.interop import sum_tied_grads
    from pipesplit.models import gpt

    torch.manual_seed(0)
    model = gpt(layers=2, dim=16, vocab=32, seq=8, heads=2)
    ref = copy.deepcopy(model)
    x = torch.randint(0, 32, (4, 8))
    prog = pipesplit.compile(model, x, num_stages=2, progress=False)
    _run_chain(prog, x).sum().backward()
    ref(x).sum().backward()
    sum_tied_grads(prog, [0, 1])
    owner, replica = prog.stage_entries[0][0], prog.stage_entries[1][0]
    assert replica.grad is None, "one update per step: the copy sharing its storage gets none"
    assert_close(owner.grad, ref.tok.weight.grad, name="tok.weight's gradient")
