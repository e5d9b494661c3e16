"""pipe(x) joins outputs without a batch dimension by the rule the graph gives (passes/split/merges.py,
runtime/engine/merge.py): sums summed, maxima maxed, means weighted, a masked token mean by its label counts,
and what it cannot derive refused by name. Each averaged silently before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipesplit
from pipesplit.errors import InputError
from pipesplit.passes.split.merges import OutputMerge
from pipesplit.runtime.engine.merge import merge_outputs


class Reduced(nn.Module):
    """Per-sample features h, and ``kind`` of them reduced over the batch."""

    def __init__(self, kind: str):
        super().__init__()
        self.a, self.b, self.kind = nn.Linear(4, 6), nn.Linear(6, 3), kind

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        reduced = {
            "sum": lambda: h.sum(),
            "max": lambda: h.amax(),
            "min_by_neg": lambda: -(h.max() * 2),  # a maximum through a negative scale: a minimum
            "mean": lambda: h.mean(),
            "mean_rows": lambda: h.mean(0) + 1.0,  # a mean over the batch only, shifted
            "sim": lambda: h @ h.T,  # in-batch similarity: (B, B)
            "norm": lambda: h.pow(2).sum().sqrt(),
            "sum_plus": lambda: h.sum() + 1.0,  # each microbatch would add the 1
        }[self.kind]
        return h, reduced()


def _pipe(model, example, m=4, dynamic=True):
    prog = pipesplit.compile(model, example, num_stages=2, dynamic_batch=dynamic, progress=False)
    return prog, pipesplit.Pipeline(prog, "gpipe", num_microbatches=m)


@pytest.mark.parametrize("kind", ["sum", "max", "min_by_neg", "mean", "mean_rows"])
def test_a_reduction_over_the_batch_joins_exactly(kind):
    """Before: averaged over the microbatches (a sum 75% off, a max 27% off at 4 microbatches)."""
    torch.manual_seed(0)
    model = Reduced(kind)
    x = torch.randn(8, 4)
    prog, pipe = _pipe(model, x)
    h, got = pipe.eval(x)
    ref_h, ref = model(x)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(prog(x)[1], ref, rtol=1e-6, atol=1e-6)


def test_a_static_capture_asks_the_dynamic_one_how_to_join_a_sum():
    """Compiled at one microbatch (2): the static graph cannot tell, so the dynamic capture decides."""
    torch.manual_seed(0)
    model = Reduced("sum")
    prog, pipe = _pipe(model, torch.randn(2, 4), dynamic=False)
    assert prog.output_merges[1].kind == "unknown"
    x = torch.randn(8, 4)
    torch.testing.assert_close(pipe(x)[1], model(x)[1], rtol=1e-6, atol=1e-6)
    assert prog.output_merges[1].kind == "sum" and prog.static_batch is None


@pytest.mark.parametrize("dynamic", [True, False])
def test_an_in_batch_similarity_is_refused(dynamic):
    """h @ h.T came back (B, B/m): each microbatch's diagonal block, concatenated."""
    torch.manual_seed(0)
    model = Reduced("sim")
    x = torch.randn(8, 4)
    prog, pipe = _pipe(model, x[:2], dynamic=dynamic)
    with pytest.raises(InputError, match=r"output 1 \[1\].*dimensions \[0, 1\].*h @ h.T.*prog\(x\)"):
        pipe(x)
    torch.testing.assert_close(prog(x)[1], model(x)[1])  # the whole batch at once is exact, and so is
    one = pipesplit.Pipeline(prog, "gpipe", num_microbatches=1)  # one microbatch, as the message says
    torch.testing.assert_close(one(x)[1], model(x)[1])


@pytest.mark.parametrize("kind,op", [("norm", "sqrt"), ("sum_plus", "add")])
def test_what_cannot_be_derived_is_refused_by_name(kind, op):
    torch.manual_seed(0)
    _, pipe = _pipe(Reduced(kind), torch.randn(8, 4))
    with pytest.raises(InputError, match=rf"cannot join output 1 \[1\].*{op}.*prog\(x\).*num_microbatches=1"):
        pipe(torch.randn(8, 4))


def test_a_mean_over_uneven_microbatches_weighs_each_by_its_size():
    """Batch 10 in 4 microbatches (3, 3, 2, 2): the mean of the means would be 4% off. pipe(x) refuses
    uneven microbatches; the join itself weighs them."""
    torch.manual_seed(0)
    model = Reduced("mean")
    x = torch.randn(10, 4)
    prog, pipe = _pipe(model, x[:2])
    with pytest.raises(InputError, match="does not split into 4 equal microbatches"):
        pipe(x)
    pieces = list(x.split([3, 3, 2, 2]))
    outs = [[t.detach() for t in prog(p)] for p in pieces]
    merged, weights = merge_outputs(outs, prog.output_merges, [[p] for p in pieces], prog.inputs, 0)
    torch.testing.assert_close(merged[1], model(x)[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(merged[0], model(x)[0])
    assert weights[1] is not None and float(weights[1]) == 10.0
    plain = torch.stack([o[1] for o in outs]).mean()  # what averaging gave
    assert (plain - model(x)[1]).abs() > 1e-3


def test_a_join_weighs_a_mean_by_counts_and_skips_empty_microbatches():
    rule = OutputMerge("mean", counts=None)
    values = [[torch.tensor(2.0)], [torch.tensor(4.0)]]
    inputs = [[torch.zeros(1, 3)], [torch.zeros(3, 3)]]
    prog = pipesplit.compile(nn.Linear(3, 3), torch.zeros(2, 3), num_stages=1, progress=False)
    merged, _ = merge_outputs(values, [rule], inputs, prog.inputs, 0)
    assert float(merged[0]) == pytest.approx((2.0 * 1 + 4.0 * 3) / 4)


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def test_a_hugging_face_token_mean_loss_weighs_each_microbatch_by_its_labels():
    """GPT-2's loss with -100 labels came back 0.8% off: each microbatch's token mean weighted equally.
    Here microbatches hold 10, 4, 0 and 7 of their labels (one has none: its own mean is 0/0)."""
    model = _hf_gpt2()
    x = torch.randint(0, 50, (8, 6))
    labels = x.clone()
    labels[0, :3] = -100
    labels[2, :2] = labels[3, :] = -100
    labels[4:6] = -100
    labels[7, 1:] = -100
    prog = pipesplit.compile(model, x, example_kwargs={"labels": labels}, num_stages=2, dynamic_batch=True,
                             progress=False)
    assert prog.output_merges[0].kind == "mean" and prog.output_merges[0].counts is not None
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4)
    got = pipe.eval(x, labels=labels)
    with torch.no_grad():
        ref = model(x, labels=labels, use_cache=False)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.logits, ref.logits)
    # other labels, other counts: each call counts its own
    swapped = torch.where(labels == -100, x, torch.full_like(x, -100))
    torch.testing.assert_close(pipe.eval(x, labels=swapped).loss, model(x, labels=swapped).loss, rtol=1e-6, atol=1e-6)


class WithLoss(nn.Module):
    """A classifier that returns its own cross-entropy, as Hugging Face heads do."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.lin, self.reduction = nn.Linear(4, 5), reduction

    def forward(self, x, y):
        logits = self.lin(x)
        return logits, F.cross_entropy(logits, y, ignore_index=-1, reduction=self.reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_cross_entropy_output_with_its_own_ignore_index_joins_exactly(reduction):
    torch.manual_seed(0)
    model = WithLoss(reduction)
    x, y = torch.randn(8, 4), torch.randint(0, 5, (8,))
    y[:3] = -1
    prog = pipesplit.compile(model, (x, y), num_stages=2, dynamic_batch=True, progress=False)
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=4)
    _, got = pipe.eval(x, y)
    torch.testing.assert_close(got, model(x, y)[1], rtol=1e-6, atol=1e-6)


def test_training_with_an_aux_output_is_unchanged():
    """The step's loss stays gradient accumulation: loss_fn sees each microbatch's own outputs."""
    torch.manual_seed(0)
    model = Reduced("mean")
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    prog, pipe = _pipe(model, x)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4,
                              loss_fn=lambda out, t: F.mse_loss(out[0], t) + out[1] ** 2)
    loss = pipe.step(x, target=y)
    ref = 0.0
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        h, aux = model(xs)
        part = (F.mse_loss(h, ys) + aux ** 2) / 4
        part.backward()
        ref += float(part.detach())
    assert float(loss) == pytest.approx(ref, rel=1e-6)
    grads = dict(model.named_parameters())
    for name, p in prog.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
    torch.testing.assert_close(pipe(x)[1], model(x)[1])  # train-mode pipe(x): the same mean
