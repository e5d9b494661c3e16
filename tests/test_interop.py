"""interop.chain_modules: the split as a chain of modules that PyTorch's PipelineStage can run.

The two-rank run against torch.distributed.pipelining is in test_distributed.py; these
run the chain in one process, stage after stage, as PipelineStage would call it.
"""

from __future__ import annotations

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
