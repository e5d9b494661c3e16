"""CUDA: exactness and the pipeline on GPU streams (skipped cleanly without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import pipesplit
from tests.close import assert_close, assert_grads_close
from tests.test_runtime import assert_grads, dot_loss
from tests.zoo import CASE_BY_NAME

pytestmark = pytest.mark.cuda


def _gpt():
    torch.manual_seed(0)
    return CASE_BY_NAME["gpt_tied"].build()


def test_stages_sharing_one_gpu_are_exact():
    model = _gpt().cuda()
    idx = torch.randint(0, 64, (2, 16), device="cuda")
    prog = pipesplit.compile(model, idx, num_stages=4)
    assert all(s.device.type == "cuda" for s in prog.stages)
    x = torch.randint(0, 64, (8, 16), device="cuda")
    assert_close(prog(x), model(x), name="output")


def test_tied_weight_across_cpu_and_gpu():
    model = _gpt()
    idx = torch.randint(0, 64, (2, 16))
    prog = pipesplit.compile(model, idx, num_stages=2, devices=["cpu", "cuda"])
    ref = copy.deepcopy(model)
    x = torch.randint(0, 64, (3, 16))
    out = prog(x)
    assert out.device.type == "cuda"
    assert_close(out.cpu(), ref(x), name="output")
    t = torch.randn(3, 16, 64)
    dot_loss(out, t.cuda()).backward()
    dot_loss(ref(x), t).backward()
    assert all(p.grad is not None for p in ref.parameters())
    assert_grads_close(prog.named_parameters(), ref)  # compared on the CPU (close.rel_err moves both)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zb_v"])
def test_pipeline_on_cuda_streams_matches_full_batch(schedule):
    model = _gpt().cuda()
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16), device="cuda"), num_stages=4)
    multi = schedule in ("interleaved_1f1b", "zb_v")

    def ce(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=ce, num_ranks=2 if multi else None)
    ref = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (8, 16), device="cuda"), torch.randint(0, 64, (8, 16), device="cuda")
    loss = pipe.step(x, target=y)
    want = ce(ref(x), y)
    want.backward()
    assert_close(loss, want.detach(), name="loss")
    assert_grads(pipe, ref)
    assert_close(pipe.eval(x), ref(x), name="eval output")
