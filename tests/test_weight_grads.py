"""Zero-bubble's W action computes linear, layer-norm and embedding weight gradients with the
kernels autograd would call, without the autograd engine (pipesplit.runtime.engine.weight_grads).

Each test runs a stage's I then W both ways, direct and through autograd one op at a time as
before, and compares them with each other and with the plain model's backward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.runtime.engine.weight_grads import WeightGraph, input_grads, weight_backward, weight_graph

aten = torch.ops.aten


class Block(nn.Module):
    """Embedding (with a padding index), layer norms with and without a bias, linears with and
    without one, on 3-D activations: the ops W computes directly."""

    def __init__(self, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.ln = nn.LayerNorm(dim)
        self.ln_nobias = nn.LayerNorm(dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(self.ln(h))))
        return self.ln_nobias(h)


class WrittenFirst(nn.Module):
    """The linear's input is a tensor that is written in place (before the linear reads it, as
    autograd allows): W goes through autograd, which checks the tensor's version."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.add_(1)
        return self.lin(h) * h


def _stage_grads(module: torch.fx.GraphModule, weights: WeightGraph, args: tuple) -> dict[str, torch.Tensor]:
    """One forward, I and W (into .grad) of ``module`` rewritten as ``weights``; the weights' gradients."""
    for p in module.parameters():
        p.grad = None
    outs = tuple(weights.module(*args))
    own, extras = list(outs[:weights.num_outputs]), list(outs[weights.num_outputs:])
    roots = [o for o in own if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.full_like(r, 0.5) + torch.arange(r.numel(), dtype=r.dtype).reshape(r.shape) / r.numel()
             for r in roots]
    _, by_extra = input_grads(weights, roots, grads, [], extras)
    weight_backward(weights, extras, by_extra, roots, grads)
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_weight_gradients_equal_autograd_ones(dtype):
    torch.manual_seed(0)
    model = Block().to(dtype)
    ids = torch.randint(0, 50, (3, 7))
    ids[0, :2] = 0  # the padding row gets no gradient
    prog = pipesplit.compile(model, ids, num_stages=1, progress=False)
    module = prog.stages[0].module
    weights = weight_graph(module)
    assert weights is not None
    ops = {}
    outputs = [n for n in weights.module.graph.nodes if n.op == "output"][0].args[0][weights.num_outputs:]
    for (outs, _), d in zip(weights.groups, weights.direct):
        ops[outputs[outs[0]].target] = ops.get(outputs[outs[0]].target, 0) + (d is not None)
    assert ops == {aten.embedding.default: 1, aten.layer_norm.default: 2, aten.linear.default: 2}, ops
    direct = _stage_grads(module, weights, (ids,))
    through_autograd = _stage_grads(module, dataclasses.replace(weights, direct=[None] * len(weights.direct)), (ids,))
    assert direct.keys() == through_autograd.keys() and len(direct) == 7
    for name in direct:  # the same kernels: equal up to the order of a sum
        torch.testing.assert_close(direct[name], through_autograd[name], msg=name)
    assert direct["emb.weight"][0].abs().max() == 0, "the padding row must get no gradient"


def test_an_input_written_in_place_goes_through_autograd():
    torch.manual_seed(0)
    model = WrittenFirst()
    x = torch.randn(4, 8)
    prog = pipesplit.compile(model, x, num_stages=1, progress=False)
    module = prog.stages[0].module
    weights = weight_graph(module)
    assert weights is not None and weights.direct == [None], "the linear's input is written in place: no direct W"
    got = _stage_grads(module, weights, (x,))
    y = model(x)
    grads = torch.full_like(y, 0.5) + torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) / y.numel()
    y.backward(grads)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)


class UnsafeCore(nn.Module):
    """``W`` feeds two linears; the second's output is written in place while ``early`` still needs
    its old value, so W's gradient must come from the stage outputs (it is "unsafe"): the first
    linear, which also consumes the safe ``b``, must make no alias for W (issue 22, defect 1)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.W = nn.Parameter(torch.randn(d, d) / 3)
        self.b = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(x, self.W, self.b)
        y = torch.nn.functional.linear(h, self.W)
        early = y.sum()
        y.mul_(2)
        return y + early


class SharedUnsafeWeight(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.pre, self.core = nn.Linear(d, d), UnsafeCore(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.core(self.pre(x))


def test_an_unsafe_weight_gets_no_alias_in_any_op():
    torch.manual_seed(0)
    prog = pipesplit.compile(SharedUnsafeWeight(), torch.randn(2, 8), num_stages=1, progress=False)
    module = prog.stages[0].module
    w = dict(module.named_parameters())["core.W"]
    weights = weight_graph(module)
    assert weights is not None
    assert all(p is not w for ps in weights.weights for p in ps) and any(p is w for p in weights.rest)
    aliased = [n for n in weights.module.graph.nodes if n.target is aten.alias.default]
    assert all(a.args[0].target != "core.W" for a in aliased), "an unsafe weight must get no alias"


@pytest.mark.parametrize("schedule", ["zb_h1", "zb_v", "dualpipe_v"])
def test_a_weight_shared_with_an_unsafe_op_is_counted_once(schedule):
    from tests.training import check_training, dot_loss

    torch.manual_seed(0)
    model = SharedUnsafeWeight()
    prog = pipesplit.compile(model, torch.randn(2, 8), split_points=["core"], progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randn(8, 8),), {})], m=4)


class SparseLookup(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 8):
        super().__init__()
        self.emb, self.lin = nn.Embedding(vocab, d, sparse=True), nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "zb_v"])
def test_a_sparse_embedding_gets_its_sparse_gradient(schedule):
    """``nn.Embedding(sparse=True)`` under a split backward: W must hand autograd its sparse gradient
    (it tried to copy it into a dense ``.grad``; issue 22, defect 11), and SGD's step must match."""
    import copy

    from tests.training import chunk_tree, dot_loss

    torch.manual_seed(0)
    model = SparseLookup()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randint(0, 20, (2, 5)), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    opt, opt_ref = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        ids, target = torch.randint(0, 20, (8, 5)), torch.randn(8, 5, 8)
        for i, t in zip(ids.chunk(4), chunk_tree(target, 4)):
            dot_loss(ref(i), t).backward()
        pipe.step(ids, target=target)
        held = dict(pipe.named_parameters())
        for name, p in ref.named_parameters():
            got = held[name].grad
            assert got is not None and got.layout == p.grad.layout, name
            torch.testing.assert_close(got.to_dense(), p.grad.to_dense(), msg=name)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(held[name].detach(), p.detach(), msg=f"{name} after the step")


class SentDerived(nn.Module):
    """``v = w * 2`` feeds a linear in stage 0 and is also sent to stage 1: the split backward's W must
    not take v's gradient in stage 0 for w's whole gradient (the part through the cut comes back later)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / 3)
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.w * 2.0
        h = self.b(torch.nn.functional.linear(self.a(x), v))
        return torch.nn.functional.linear(h, v)


@pytest.mark.parametrize("schedule", ["zb_h1", "zb_v"])
def test_a_weight_derived_value_sent_over_a_cut_keeps_its_whole_gradient(schedule):
    """A review found it (on cc662f4 too): w's gradient was off by 86% under the split backward."""
    from tests.training import check_training, dot_loss

    torch.manual_seed(0)
    model = SentDerived()
    prog = pipesplit.compile(model, torch.randn(2, 8), split_points=["b"], progress=False)
    assert any(b.src == 0 and b.dst == 1 for b in prog.boundaries)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randn(8, 8),), {})], m=4)


class WrittenAfter(nn.Module):
    """A linear's output written in place right after it (``h.mul_(2)``, ``h.relu_()``): the gradient I
    leaves at ``h`` is the writer's output's, not the linear's."""

    def __init__(self, write: str):
        super().__init__()
        self.a, self.b, self.write = nn.Linear(8, 8), nn.Linear(8, 8), write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(2) if self.write == "mul_" else h.relu_()
        return self.b(h)


@pytest.mark.parametrize("write", ["mul_", "relu_"])
@pytest.mark.parametrize("schedule", ["zb_h1", "zb_v", "dualpipe_v"])
def test_a_weight_op_whose_output_is_written_in_place_gets_its_own_gradient(schedule, write):
    """The fuzzer found it: W's direct kernels took the in-place writer's output gradient for the
    linear's (a.weight's gradient half the reference after mul_(2))."""
    from tests.training import check_training, dot_loss

    torch.manual_seed(0)
    model = WrittenAfter(write)
    prog = pipesplit.compile(model, torch.randn(8, 8), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randn(8, 8),), {})], m=4)


class DropoutThenWrite(nn.Module):
    """``Dropout(0.0)`` returns its input itself (ATen's dropout changes nothing at p == 0), so
    ``relu_`` on its result writes the embedding's output: the direct W path must see that write."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.drop, self.head = nn.Embedding(16, 8), nn.Dropout(0.0), nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.emb(idx)).relu_())


def test_an_output_written_through_a_dropout_that_returns_it_is_seen():
    """The fuzzer found it: emb.weight's gradient 74% off under zb_h1 (aliasing took dropout's
    result for a new tensor, so the embedding kept the direct W path)."""
    from tests.training import check_training, dot_loss

    torch.manual_seed(0)
    model = DropoutThenWrite()
    prog = pipesplit.compile(model, torch.randint(0, 16, (4, 4)), num_stages=1, progress=False)
    pipe = pipesplit.Pipeline(prog, "zb_h1", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randint(0, 16, (4, 4)),), {})], m=2)


class SparseTiedHead(nn.Module):
    """A sparse embedding whose weight is also the output head's (``F.linear(h, emb.weight)``)."""

    def __init__(self, vocab: int = 16, d: int = 8):
        super().__init__()
        self.emb, self.lin = nn.Embedding(vocab, d, sparse=True), nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.lin(self.emb(ids)), self.emb.weight)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "zb_v"])
@pytest.mark.parametrize("m", [1, 4])
def test_a_sparse_embedding_tied_to_a_head_sums_as_autograd_does(schedule, m):
    """The embedding's sparse gradient plus the head's dense one is the dense sum AccumulateGrad makes
    on the plain model (summing the tied replicas raised ``add(sparse, dense) is not supported``)."""
    import copy

    from tests.training import chunk_tree, dot_loss

    torch.manual_seed(0)
    model = SparseTiedHead()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randint(0, 16, (2, 5)), num_stages=2, progress=False)
    assert sum("emb.weight" in s.attr_targets for s in prog.stages) == 2  # tied across the cut
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=m, loss_fn=dot_loss, loss_reduction="sum")
    opt, opt_ref = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        ids, target = torch.randint(0, 16, (8, 5)), torch.randn(8, 5, 16)
        for i, t in zip(ids.chunk(m), chunk_tree(target, m)):
            dot_loss(ref(i), t).backward()
        pipe.step(ids, target=target)
        held = dict(pipe.named_parameters())
        for name, p in ref.named_parameters():
            got = held[name].grad
            assert got is not None and got.layout == p.grad.layout, (name, got.layout if got is not None else None)
            torch.testing.assert_close(got, p.grad, msg=name)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(held[name].detach(), p.detach(), msg=f"{name} after the step")


_GROUP_NORM_CASE = """
import copy, torch, torch.nn as nn, torch.nn.functional as F, pipesplit
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                      nn.GroupNorm(4, 8), nn.Flatten(), nn.Linear(8 * 64, 5)).to(memory_format=torch.channels_last)
x, y = torch.randn(8, 3, 8, 8).to(memory_format=torch.channels_last), torch.randint(0, 5, (8,))
ref = copy.deepcopy(model)
for a, b in zip(x.chunk(4), y.chunk(4)):
    (F.cross_entropy(ref(a), b) / 4).backward()
prog = pipesplit.compile(model, (x[:2],), num_stages=2, split_points=["3"], progress=False)
for schedule in {schedules!r}:
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=F.cross_entropy)
    pipe.step(x, target=y)
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        err = ((p.grad - grads[name].grad).norm() / grads[name].grad.norm()).item()
        assert err < 1e-5, (schedule, name, err)
    pipe.zero_grad()
print("ok")
"""


def test_group_norm_over_channels_last_trains_under_the_split_backward():
    """W asked GroupNorm's backward for the weights' gradients alone, over a channels_last input:
    torch 2.10 and 2.13 then crash the process on CPU (a segmentation fault, no exception). Run in a
    child process, so that a crash fails this test and not the whole run."""
    import subprocess
    import sys

    from tests.launch import ROOT

    code = _GROUP_NORM_CASE.format(schedules=("zb_h1", "zb_v"))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stdout[-2000:],
                                                                       run.stderr[-2000:])
