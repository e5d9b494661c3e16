"""The eval twin of the stage graphs equals ``model.eval()`` for every mode-dependent layer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.passes.split.modes import mode_arguments
from tests.close import assert_close
from tests.training import check_training, dot_loss


def _seq(*layers: nn.Module) -> nn.Module:
    return nn.Sequential(*layers)


class LSTMDropout(nn.Module):
    """Dropout between the LSTM's layers: the ``train`` flag of ``aten.lstm``."""

    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(8, 8, num_layers=2, dropout=0.5, batch_first=True), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


# name -> (model builder, example batch builder)
MODE_LAYERS = {
    "instance_norm_1d_running_stats": (
        lambda: _seq(nn.Conv1d(3, 4, 1), nn.InstanceNorm1d(4, track_running_stats=True, affine=True), nn.Conv1d(4, 4, 1)),
        lambda b: torch.randn(b, 3, 5)),
    "instance_norm_2d_running_stats": (
        lambda: _seq(nn.Conv2d(3, 4, 1), nn.InstanceNorm2d(4, track_running_stats=True), nn.Conv2d(4, 4, 1)),
        lambda b: torch.randn(b, 3, 4, 4)),
    "instance_norm_no_running_stats": (
        lambda: _seq(nn.Conv1d(3, 4, 1), nn.InstanceNorm1d(4, affine=True), nn.Conv1d(4, 4, 1)),
        lambda b: torch.randn(b, 3, 5)),
    "rrelu": (lambda: _seq(nn.Linear(8, 8), nn.RReLU(0.1, 0.4), nn.Linear(8, 8)), lambda b: torch.randn(b, 8)),
    "batch_norm_no_running_stats": (
        lambda: _seq(nn.Linear(8, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 8)),
        lambda b: torch.randn(b, 8)),
    "batch_norm_2d_no_running_stats": (
        lambda: _seq(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False), nn.Conv2d(4, 4, 1)),
        lambda b: torch.randn(b, 3, 4, 4)),
    "batch_norm": (lambda: _seq(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)), lambda b: torch.randn(b, 8)),
    "group_norm": (lambda: _seq(nn.Conv1d(4, 4, 1), nn.GroupNorm(2, 4), nn.Conv1d(4, 4, 1)),
                   lambda b: torch.randn(b, 4, 5)),
    "dropouts": (lambda: _seq(nn.Linear(8, 8), nn.Dropout(0.5), nn.AlphaDropout(0.5), nn.Linear(8, 8)),
                 lambda b: torch.randn(b, 8)),
    "lstm_dropout": (LSTMDropout, lambda b: torch.randn(b, 5, 8)),
    "feature_dropouts": (
        lambda: _seq(nn.Conv2d(3, 4, 1), nn.Dropout2d(0.5), nn.FeatureAlphaDropout(0.5), nn.Conv2d(4, 4, 1)),
        lambda b: torch.randn(b, 3, 4, 4)),
}


@pytest.mark.parametrize("name", sorted(MODE_LAYERS))
def test_eval_equals_model_eval_and_leaves_every_buffer(name):
    """Issue 22 #6 (InstanceNorm with running stats, RReLU) and #14 (BatchNorm without them)."""
    torch.manual_seed(0)
    build, inputs = MODE_LAYERS[name]
    model = build()
    prog = pipesplit.compile(model, inputs(4), num_stages=2, progress=False)
    before = {k: v.clone() for k, v in prog.state_dict().items()}
    x = inputs(4)
    want = copy.deepcopy(model).eval()(x)
    prog.eval()
    assert_close(prog(x), want, name="prog.eval() output")
    assert_close(prog(x), want, name="prog.eval() output, again")
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=1)
    assert_close(pipe(x), want, name="pipe(x) in eval mode")
    for k, v in prog.state_dict().items():
        assert torch.equal(v, before[k]), f"eval mode changed buffer {k}"
    prog.train()
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=1, loss_fn=dot_loss, loss_reduction="sum")
    assert_close(pipe.eval(x), want, name="pipe.eval(x)")
    assert pipe.training, "pipe.eval(x) puts the training mode back"
    if "dropout" not in name and name != "rrelu":  # deterministic in training mode: equal to accumulation
        check_training(model, pipe, [((inputs(4),), {})], m=1, steps=1)


def test_rrelu_in_eval_uses_the_mean_slope():
    model = _seq(nn.Linear(8, 8), nn.RReLU(0.1, 0.3))
    prog = pipesplit.compile(model, torch.randn(4, 8), num_stages=1, progress=False).eval()
    x = torch.randn(16, 8)
    h = model[0](x)
    assert_close(prog(x), torch.where(h >= 0, h, h * 0.2), name="slope (lower + upper) / 2")
    assert prog.stages[0].module_for(False) is prog.stages[0].module


def test_mode_arguments_come_from_each_ops_schema():
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x, stat = g.placeholder("x"), g.placeholder("stat")

    def args(op, *a):
        return [name for _, name in mode_arguments(g.call_function(op, (x, *a)))]

    assert args(aten.rrelu.default, 0.1, 0.3, True) == ["training"]
    assert args(aten.feature_alpha_dropout.default, 0.5, True) == ["train"]
    assert args(aten.instance_norm.default, None, None, stat, stat, True, 0.1, 1e-5, False) == ["use_input_stats"]
    assert args(aten.instance_norm.default, None, None, None, None, True, 0.1, 1e-5, False) == []
    assert args(aten.batch_norm.default, None, None, None, None, True, 0.1, 1e-5, False) == []
    assert args(aten._native_batch_norm_legit.no_stats, None, None, True, 0.1, 1e-5) == []
    assert args(aten.scaled_dot_product_attention.default, x, x, None, 0.1) == ["dropout_p"]
    assert args(aten.group_norm.default, 2) == [] and args(aten.layer_norm.default, [8]) == []


@pytest.mark.parametrize("legacy", [False, True])
def test_spectral_norm_trains_exactly_and_its_eval_mode_is_refused(legacy):
    """Its power iteration runs under ``if self.training``: in the eval twin of a training capture it
    still ran, wrote _u/_v and gave outputs ~2e-3 off model.eval()'s, silently."""
    torch.manual_seed(0)
    norm = torch.nn.utils.spectral_norm if legacy else torch.nn.utils.parametrizations.spectral_norm
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randn(2, 8), num_stages=2, progress=False)
    assert any("spectral norm" in n for n in prog.notes), prog.notes
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    x, t = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, target=t)
    for xm, tm in zip(x.chunk(2), t.chunk(2)):
        dot_loss(ref(xm), tm).backward()
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.grad, grads[name].grad, name=f"gradient of {name}")
    before = {k: v.clone() for k, v in prog.state_dict().items()}
    with pytest.raises(pipesplit.PipesplitError, match=r"spectral norm\) branch on self.training"):
        pipe.eval(x)
    with pytest.raises(pipesplit.PipesplitError, match="model.load_state_dict"):
        prog.eval()
    assert prog.training and all(torch.equal(v, before[k]) for k, v in prog.state_dict().items())
    ref.load_state_dict(prog.state_dict())  # the way the error names, and it is exact
    for k, v in ref.state_dict().items():
        assert torch.equal(v, before[k]), k
