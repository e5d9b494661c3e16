"""A loss function that trains tensors of its own (a learnable temperature, a margin) gets their
gradients as plain PyTorch's ``loss.backward()`` gives them, under every schedule.

Found this session: ``pipe.step`` left such a tensor's ``.grad`` None under every schedule
(the stage's backward named only the stage's parameters and input leaves), while gradient
accumulation on the model fills it: a silent wrong result for contrastive and distillation
losses with a learnable temperature.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import pipesplit
from pipesplit.models import gpt

SCHEDULES = [("gpipe", 2), ("1f1b", 2), ("zb_h1", 2), ("looped_bfs", 4), ("interleaved_1f1b", 4), ("zb_v", 4),
             ("dualpipe_v", 4)]


class TemperedLoss(torch.nn.Module):
    """Cross-entropy over logits divided by a learnable temperature, plus a learnable margin term."""

    def __init__(self):
        super().__init__()
        self.log_temp = torch.nn.Parameter(torch.tensor(0.3))
        self.margin = torch.nn.Parameter(torch.tensor([0.1, -0.2]))

    def forward(self, logits, target):
        ce = F.cross_entropy((logits / self.log_temp.exp()).flatten(0, 1), target.flatten())
        return ce + (self.margin ** 2).sum() * logits.float().mean()


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("schedule,stages", SCHEDULES)
def test_a_loss_with_parameters_of_its_own_trains_like_accumulation(schedule, stages, checkpoint):
    torch.manual_seed(0)
    model = gpt(layers=4, dim=16, vocab=32, seq=8, heads=2)
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    ref, ref_loss = copy.deepcopy(model), TemperedLoss()
    loss_fn = copy.deepcopy(ref_loss)
    prog = pipesplit.compile(model, x[:2], num_stages=stages, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=loss_fn, checkpoint=checkpoint)
    opt = torch.optim.AdamW([*pipe.parameters(), *loss_fn.parameters()], lr=1e-2)
    opt_ref = torch.optim.AdamW([*ref.parameters(), *ref_loss.parameters()], lr=1e-2)
    for _ in range(2):
        want = sum(ref_loss(ref(a), b) / 4 for a, b in zip(x.chunk(4), y.chunk(4)) if True)
        want.backward()
        got = pipe.step(x, target=y)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(loss_fn.named_parameters(), ref_loss.parameters()):
            assert p.grad is not None, f"the loss function's {name} got no gradient"
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=f"gradient of the loss's {name}")
        ref_params = dict(ref.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        for p, q in zip(loss_fn.parameters(), ref_loss.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_a_loss_with_parameters_of_its_own_is_refused_on_a_data_parallel_mesh(monkeypatch):
    """Replicas sum only the model's gradients: a loss's own tensors would drift apart, so a
    dp > 1 step refuses by name (the check runs in the last stage's forward, before any backward)."""
    from pipesplit.runtime.engine import pipeline as pipeline_mod

    torch.manual_seed(0)
    model = gpt(layers=2, dim=16, vocab=32, seq=8, heads=2)
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    pipe = pipesplit.Pipeline(pipesplit.compile(model, x, num_stages=2, progress=False), "1f1b", num_microbatches=2,
                              loss_fn=TemperedLoss())
    real = pipeline_mod.Pipeline._prepare

    def as_on_a_mesh(self, *args, **kwargs):
        data = real(self, *args, **kwargs)
        data.dp_size = 2
        return data

    monkeypatch.setattr(pipeline_mod.Pipeline, "_prepare", as_on_a_mesh)
    with pytest.raises(pipesplit.PipesplitError, match=r"loss_fn trains 2 tensor\(s\) the model does not hold.*2 data"):
        pipe.step(x, target=y)
    monkeypatch.undo()
    pipe.step(x, target=y)  # the same pipeline without the mesh trains
    assert all(p.grad is not None for p in pipe.parameters())


def test_a_plain_loss_finds_nothing_to_train_and_walks_only_its_own_ops():
    from pipesplit.runtime.engine.loss_leaves import loss_leaves, output_nodes

    w = torch.randn(4, 4, requires_grad=True)
    out = torch.randn(2, 4, requires_grad=True) @ w
    stop = output_nodes([out])
    loss = F.mse_loss(out, torch.zeros(2, 4))
    assert loss_leaves(loss, stop, [w]) == ([], [])
    t = torch.tensor(2.0, requires_grad=True)
    assert loss_leaves((out / t).sum(), stop, [w]) == ([t], [])
    assert loss_leaves((out / t).sum() + w.sum(), stop, [w]) == ([t], [w]), "the stage's own weight, by closure"
    x = torch.randn(2, 4, requires_grad=True)  # an input leaf of the stage, read by the loss: neither
    assert loss_leaves((out / t).sum() + x.sum(), stop, [w], [x]) == ([t], [])


class InPlaceLoss(torch.nn.Module):
    """A loss that writes the logits in place (a bias added with add_) before the cross-entropy."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(32) * 0.1)

    def forward(self, logits, target):
        return F.cross_entropy(logits.add_(self.bias).flatten(0, 1), target.flatten())


@pytest.mark.parametrize("schedule,stages", [("1f1b", 2), ("zb_h1", 2), ("zb_v", 4)])
def test_a_loss_writing_the_outputs_in_place_still_trains_its_own_tensors(schedule, stages):
    """A review found it: the walk stopped at the outputs' autograd nodes taken after the loss ran, and
    an in-place op in the loss is then the output's node: the zero-bubble schedules left the loss's
    bias without a gradient (plain: up to 0.05)."""
    torch.manual_seed(0)
    model = gpt(layers=4, dim=16, vocab=32, seq=8, heads=2)
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    ref, ref_loss = copy.deepcopy(model), InPlaceLoss()
    loss_fn = copy.deepcopy(ref_loss)
    pipe = pipesplit.Pipeline(pipesplit.compile(model, x[:2], num_stages=stages, progress=False), schedule,
                              num_microbatches=4, loss_fn=loss_fn)
    want = sum(ref_loss(ref(a), b) / 4 for a, b in zip(x.chunk(4), y.chunk(4)))
    want.backward()
    torch.testing.assert_close(pipe.step(x, target=y), want.detach(), rtol=1e-5, atol=1e-6)
    assert loss_fn.bias.grad is not None, "the loss's own bias got no gradient"
    torch.testing.assert_close(loss_fn.bias.grad, ref_loss.bias.grad, rtol=1e-5, atol=1e-7)


def test_a_loss_reading_a_stage_weight_directly_is_refused_where_the_backward_is_split():
    """A regulariser on a last-stage weight inside loss_fn: 1f1b trains it exactly; zb_h1 would lose the
    term (the W action differentiates through the stage's graph only), so it is refused by name."""
    torch.manual_seed(0)
    model = gpt(layers=4, dim=16, vocab=32, seq=8, heads=2)
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    prog = pipesplit.compile(model, x[:2], num_stages=2, progress=False)
    held = dict(prog.named_parameters())

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) + 0.1 * held["ln_f.weight"].pow(2).sum()

    ref = copy.deepcopy(model)
    want = sum(F.cross_entropy(ref(a).flatten(0, 1), b.flatten()) / 4 + 0.1 * ref.ln_f.weight.pow(2).sum() / 4
               for a, b in zip(x.chunk(4), y.chunk(4)))
    want.backward()
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=loss_fn)
    torch.testing.assert_close(pipe.step(x, target=y), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(held["ln_f.weight"].grad, ref.ln_f.weight.grad, rtol=1e-5, atol=1e-7)
    split = pipesplit.Pipeline(prog, "zb_h1", num_microbatches=4, loss_fn=loss_fn)
    with pytest.raises(pipesplit.PipesplitError, match=r"loss_fn reads 1 of stage 1's parameters directly"):
        split.step(x, target=y)
