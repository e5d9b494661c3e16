"""The split program computes what the model computes: outputs, every gradient, buffers."""

from __future__ import annotations

import copy

import pytest
import torch

import pipesplit
from tests.close import assert_close, assert_grads_close, assert_tree_close
from tests.zoo import CASE_BY_NAME, CASES, weighted_loss

STAGES = [1, 2, 3, 5, 8]


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_exact(model, args, kwargs, prog, run_args, run_kwargs):
    ref_model = copy.deepcopy(model)  # the reference run mutates BatchNorm stats
    want = ref_model(*run_args, **run_kwargs)
    got = prog(*run_args, **run_kwargs)
    assert_tree_close(got, want, name="outputs")
    weighted_loss(want).backward()
    weighted_loss(got).backward()
    assert any(p.grad is not None for p in ref_model.parameters())
    assert_grads_close(prog.named_parameters(), ref_model)
    prog_state = prog.state_dict()
    assert prog_state.keys() == ref_model.state_dict().keys()
    for name, buf in ref_model.state_dict().items():
        assert_close(prog_state[name], buf, name=f"state {name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_split_matches_model(case):
    torch.manual_seed(0)
    model = case.build()
    args, kwargs = case.inputs(4)
    before = _snapshot(model)
    params_before = [p for p in model.parameters()]
    for k in STAGES:
        if k > case.max_stages:
            continue
        prog = pipesplit.compile(model, args, example_kwargs=kwargs, num_stages=k, progress=False)
        assert prog.num_stages == k
        assert all(stage.nodes for stage in prog.stages)
        run_args, run_kwargs = case.inputs(3)  # another batch size than the example's
        check_exact(model, args, kwargs, prog, run_args, run_kwargs)
    after = _snapshot(model)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), f"compiling changed the user's {key}"
    assert [p for p in model.parameters()] == params_before
    assert all(p.grad is None for p in model.parameters()), "compiling touched the user's gradients"


def test_batchnorm_running_stats_update_exactly():
    torch.manual_seed(0)
    case = CASE_BY_NAME["conv_bn"]
    model = case.build()
    (x,), _ = case.inputs(4)
    prog = pipesplit.compile(model, (x,), num_stages=3)
    ref = copy.deepcopy(model)
    for _ in range(3):
        batch = torch.randn(5, 3, 8, 8)
        ref(batch)
        prog(batch)
    state = prog.state_dict()
    for name, buf in ref.state_dict().items():
        if "running" in name or "num_batches" in name:
            assert_close(state[name], buf, name=name)
    assert int(state["stem.1.num_batches_tracked"]) == 3


def test_tied_embedding_single_gradient_on_shared_device():
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build()
    idx = torch.randint(0, 64, (2, 16))
    prog = pipesplit.compile(model, (idx,), num_stages=4)
    names = [n for n, _ in prog.named_parameters()]
    assert "tok.weight" in names and "head.weight" not in names  # one parameter, like the model
    tok = dict(prog.named_parameters())["tok.weight"]
    held = {s.index: t for s in prog.stages for t in s.module.parameters()
            if t.untyped_storage().data_ptr() == tok.untyped_storage().data_ptr()}
    assert sorted(held) == [0, 3], "the tied weight should be used by the first and last stage"
    assert held[0] is tok and held[3] is not tok, "the last stage's alias shares the storage, with a gradient of its own"
    check_exact(model, (idx,), {}, prog, (torch.randint(0, 64, (3, 16)),), {})
    assert held[3].grad is None, "the alias's gradient was added into the one parameter's"


def test_tied_embedding_across_devices_syncs_and_sums():
    """Stages on distinct devices hold replicas; gradients land summed on one parameter."""
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build()
    idx = torch.randint(0, 64, (2, 16))
    devices = ["cpu", "cpu:0"]  # two distinct torch.device values: replicas are real copies
    prog = pipesplit.compile(model, (idx,), num_stages=2, devices=devices)
    tok = dict(prog.named_parameters())["tok.weight"]
    replicas = [p for s in prog.stages for p in s.module.parameters() if p.shape == tok.shape and p is not tok]
    assert replicas, "the last stage should hold a replica of the tied weight"
    check_exact(model, (idx,), {}, prog, (torch.randint(0, 64, (3, 16)),), {})
    assert all(r.grad is None for r in replicas)
    # an optimizer step on the owner reaches the replica before the next forward
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(prog.parameters(), lr=0.5)
    for step in range(2):
        batch = torch.randint(0, 64, (3, 16))
        opt_ref.zero_grad(), opt.zero_grad()
        weighted_loss(ref(batch), seed=step).backward()
        weighted_loss(prog(batch), seed=step).backward()
        opt_ref.step(), opt.step()
    final = torch.randint(0, 64, (3, 16))
    assert_close(prog(final), ref(final), name="output after two SGD steps")


def test_kwarg_first_used_late_reaches_only_that_stage():
    torch.manual_seed(0)
    case = CASE_BY_NAME["late_kwarg"]
    model = case.build()
    args, kwargs = case.inputs(4)
    prog = pipesplit.compile(model, args, example_kwargs=kwargs, num_stages=4)
    users = [s.index for s in prog.stages if "bias" in s.input_names]
    assert users == [3]


def test_long_skip_crosses_every_later_stage():
    torch.manual_seed(0)
    case = CASE_BY_NAME["long_skip"]
    model = case.build()
    prog = pipesplit.compile(model, case.inputs(4)[0], num_stages=4)
    skip = [b for b in prog.boundaries if b.src == 0 and b.dst == 3]
    assert skip, "the skip value must be sent from stage 0 straight to stage 3"
    assert all(b.kind == "tensor" and b.shape == (4, 16) for b in skip)  # captured at the example's batch
