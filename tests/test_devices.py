"""Devices a stage graph creates tensors on follow the stage (pipesplit.passes.split.devices)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.compat import EXPORTS_META_MODELS
from pipesplit.passes.split.devices import retarget
from tests.close import assert_close
from tests.training import check_training, dot_loss


class Positions(nn.Module):
    """Creates tensors on a hidden state's device, as every Hugging Face model does."""

    def __init__(self, vocab: int = 16, d: int = 8, seq: int = 6):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, idx):
        h = self.emb(idx)
        h = self.a(h + self.pos(torch.arange(idx.shape[1], device=h.device)))
        causal = torch.ones(idx.shape[1], idx.shape[1], device=h.device).tril()
        return self.b(causal @ torch.tanh(h))


def _ids(b: int) -> torch.Tensor:
    return torch.randint(0, 16, (b, 6))


needs_meta_export = pytest.mark.skipif(not EXPORTS_META_MODELS, reason="this torch cannot export a meta model (2.13+)")


@needs_meta_export
@pytest.mark.parametrize("how", ["init_weights", "load_state_dict"])
def test_a_meta_model_creating_tensors_on_a_hidden_states_device_trains(how):
    """Issue 22 #10: device=meta baked into the stage graphs follows the stage's tensors when materialised."""
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = Positions()
    prog = pipesplit.compile(meta, _ids(4), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    real = Positions()
    if how == "init_weights":
        pipe.init_weights(meta)
        real.load_state_dict(prog.state_dict())
    else:
        prog.load_state_dict(real.state_dict())
    for stage in prog.stages:
        assert "meta" not in stage.module.code, f"stage {stage.index} still creates tensors on meta"
    x = _ids(4)
    assert_close(prog(x), real(x), name="output")
    check_training(real, pipe, [((_ids(4),), {}), ((_ids(6),), {})], m=2, steps=2)
    trained = Positions()
    trained.load_state_dict(prog.state_dict())
    assert_close(pipe.eval(x), trained.eval()(x).detach(), name="eval output after training")


@needs_meta_export
def test_a_recapture_of_a_materialised_meta_model_creates_tensors_where_the_stage_runs():
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = Positions()
    prog = pipesplit.compile(meta, _ids(4), num_stages=2, progress=False)
    prog.materialize()
    real = Positions()
    prog.load_state_dict(real.state_dict())
    x = _ids(3)  # another batch: captured again from the (meta) model
    assert_close(prog(x), real(x), name="output after the re-capture")
    assert prog.static_batch is None
    assert all("meta" not in s.module.code for s in prog.stages)


def test_retarget_rewrites_the_captures_device_only():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ones = graph.call_function(torch.ones, (3,), {"device": "meta"})
    zeros = graph.call_function(torch.zeros, (3,), {"device": torch.device("cpu")})
    graph.output(graph.call_function(torch.add, (graph.call_function(torch.add, (x, ones)), zeros)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert retarget(gm, torch.device("meta"), torch.device("cpu")) == 1
    assert "meta" not in gm.code and retarget(gm, torch.device("cpu"), torch.device("cpu")) == 0


@pytest.mark.cuda
def test_a_cpu_capture_creates_tensors_on_the_gpu_its_stage_runs_on():
    """The same mechanism for device=cpu baked by a capture on the CPU, stages placed on GPUs."""
    torch.manual_seed(0)
    model = Positions()
    prog = pipesplit.compile(model, _ids(4), num_stages=2, devices=["cuda:0", "cuda:0"], progress=False)
    assert all("device(type='cpu')" not in s.module.code for s in prog.stages)
    x = _ids(4)
    assert_close(prog(x.cuda()).cpu(), model(x), name="output")
