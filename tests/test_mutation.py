"""In-place writes: no order, recompute or profile may change what a mutating model computes."""

from __future__ import annotations

import copy

import torch
import torch.utils._pytree as pytree
from torch import nn

import pipesplit
from tests.close import assert_close, assert_grads_close
from tests.zoo import weighted_loss


class ViewWrite(nn.Module):
    """Writes a buffer through views (``buf[:, 0].add_``, ``buf[1] = ...``): writes with no users."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.register_buffer("seen", torch.zeros(3, d))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:
                self.seen[:, 0].add_(x.detach().mean())
        self.seen[1] = x.detach().mean(0)
        return x + self.seen[2]  # row 2 holds the column-0 update


def check_same(model, prog, args, kwargs=None, *, train=True):
    """Outputs, every parameter gradient (``train``) and the state after one call equal the model's."""
    kwargs = kwargs or {}
    ref = copy.deepcopy(model)
    want, got = ref(*args, **kwargs), prog(*args, **kwargs)
    want_leaves, want_spec = pytree.tree_flatten(want)
    got_leaves, got_spec = pytree.tree_flatten(got)
    assert got_spec == want_spec
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert_close(g, w, name=f"output {i}")
    if train:
        weighted_loss(want).backward()
        weighted_loss(got).backward()
        assert_grads_close(prog.named_parameters(), ref)
    state = prog.state_dict()
    for name, value in ref.state_dict().items():
        assert_close(state[name], value, name=f"state {name}")


def test_buffer_written_through_a_view_is_mutated_and_profiling_leaves_it():
    torch.manual_seed(0)
    model = ViewWrite()
    x = torch.randn(4, 16)
    at_compile = {k: v.clone() for k, v in model.state_dict().items()}
    for cost in ("profile", "hybrid"):
        prog = pipesplit.compile(model, x, num_stages=2, cost=cost, progress=False)
        assert prog.mutated_targets == {"seen"}
        state = prog.state_dict()
        for key, value in at_compile.items():  # profiling ran the graph 7 times on copies
            assert torch.equal(state[key], value), f"profiling changed the program's {key}"
            assert torch.equal(model.state_dict()[key], value), f"compiling changed the model's {key}"
        check_same(model, prog, (torch.randn(5, 16),))
