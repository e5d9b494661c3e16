"""A 1-D target leaf as long as (a multiple of) the batch: per sample, or whole? The loss decides,
or the user says (pipesplit/runtime/engine/target_probe.py). Before, such a leaf was always cut."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipesplit
from pipesplit.errors import InputError


def _model(out: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, out))


def _weighted(out, t):
    return ((out - t["y"]) ** 2 * t["w"]).mean()


def _accumulated(model, loss_fn, x, targets):
    """Gradient accumulation on the plain model: ``targets[k]`` is microbatch k's target."""
    total = 0.0
    for xs, t in zip(x.chunk(len(targets)), targets):
        part = loss_fn(model(xs), t) / len(targets)
        part.backward()
        total += float(part.detach())
    return total


def _check_grads(prog, model):
    grads = dict(model.named_parameters())
    for name, p in prog.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_per_feature_weight_as_long_as_the_batch_is_refused_by_name():
    """(4,) feature weights, batch 4 in 4 microbatches: each microbatch got one weight, broadcast over
    all features, silently (the loss 7.5% off, gradients 32%)."""
    model = _model()
    x, y, w = torch.randn(4, 3), torch.randn(4, 4), torch.rand(4)
    prog = pipesplit.compile(model, x, num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=_weighted)
    with pytest.raises(InputError, match=r"target leaf 'w' \(4,\).*another loss.*target_unbatched=\['w'\]"):
        pipe.step(x, target={"y": y, "w": w})


def test_target_unbatched_gives_the_weight_whole_to_every_microbatch():
    model = _model()
    x, y, w = torch.randn(4, 3), torch.randn(4, 4), torch.rand(4)
    prog = pipesplit.compile(model, x, num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=_weighted, target_unbatched=["w"])
    loss = pipe.step(x, target={"y": y, "w": w})
    ref = _accumulated(model, _weighted, x, [{"y": ys, "w": w} for ys in y.chunk(4)])
    assert float(loss) == pytest.approx(ref, rel=1e-6)
    _check_grads(prog, model)
    with pytest.raises(InputError, match=r"target_unbatched names \['ww'\].*leaves are \['y', 'w'\].*did you mean 'w'"):
        pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=_weighted,
                           target_unbatched=["ww"]).step(x, target={"y": y, "w": w})


def _class_weighted(out, t):
    return F.cross_entropy(out, t[0], weight=t[1])


def test_class_weights_twice_the_batch_are_refused_by_name_then_exact_whole():
    """8 classes, batch 4: the (8,) class weights were cut to (4,) and torch raised its own error."""
    model = _model(out=8)
    x, labels, weights = torch.randn(4, 3), torch.randint(0, 8, (4,)), torch.rand(8)
    prog = pipesplit.compile(model, x, num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=2, loss_fn=_class_weighted)
    with pytest.raises(InputError, match=r"failed on target leaf '1' \(8,\).*runs with it whole.*target_unbatched=\['1'\]"):
        pipe.step(x, target=(labels, weights))
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=2, loss_fn=_class_weighted, target_unbatched=["1"])
    pipe.zero_grad()
    loss = pipe.step(x, target=(labels, weights))
    ref = _accumulated(model, _class_weighted, x, [(lab, weights) for lab in labels.chunk(2)])
    assert float(loss) == pytest.approx(ref, rel=1e-6)
    _check_grads(prog, model)


def test_labels_as_long_as_the_batch_are_cut_and_checked_once():
    """(batch,) labels: whole, cross_entropy cannot take them, so cutting is confirmed, on the first step only."""
    model = _model(out=5)
    x, labels = torch.randn(8, 3), torch.randint(0, 5, (8,))
    calls = []

    def loss_fn(out, y):
        calls.append(y.shape[0])
        return F.cross_entropy(out, y)

    prog = pipesplit.compile(model, x, num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=loss_fn)
    loss = pipe.step(x, target=labels)
    assert sorted(calls) == [2, 2, 2, 2, 8]  # one run with the labels whole, which failed
    ref = _accumulated(model, F.cross_entropy, x, list(labels.chunk(4)))
    assert float(loss) == pytest.approx(ref, rel=1e-6)
    _check_grads(prog, model)
    calls.clear()
    pipe.step(x, target=labels)
    assert calls == [2, 2, 2, 2]


def test_labels_of_one_sample_per_microbatch_are_ambiguous_unless_declared():
    """Microbatches of one sample: a (batch,) leaf cut gives (1,), which broadcasts as a weight would;
    pipesplit cannot tell, so it asks; target_batch_dim=0 says per sample, and nothing is probed."""
    model = _model(out=1)
    x, y = torch.randn(4, 3), torch.randn(4)

    def loss_fn(out, t):
        return F.mse_loss(out.squeeze(-1), t)

    prog = pipesplit.compile(model, x, num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=4, loss_fn=loss_fn)
    with pytest.warns(UserWarning), pytest.raises(InputError, match=r"the target \(4,\).*target_batch_dim=None.*target_batch_dim=0"):
        pipe.step(x, target=y)
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=4, loss_fn=loss_fn, target_batch_dim=0)
    pipe.zero_grad()
    loss = pipe.step(x, target=y)
    ref = _accumulated(model, loss_fn, x, list(y.chunk(4)))
    assert float(loss) == pytest.approx(ref, rel=1e-6)
    _check_grads(prog, model)
