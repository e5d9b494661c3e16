"""What a training step means beyond exact gradients: randomness, modes, autocast, shapes, inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.models import GPT, GPTConfig
from tests.close import assert_close, assert_grads_close
from tests.training import check_training, dot_loss, streamed_reference
from tests.zoo import CASE_BY_NAME


def _dropout_gpt(p: float = 0.3) -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, dim=32, layers=4, heads=2, seq=16, dropout=p))


def _ids(b: int) -> torch.Tensor:
    return torch.randint(0, 64, (b, 16))


def _run(pipe, x, target, seed=123):
    torch.manual_seed(seed)
    pipe.zero_grad()
    loss = pipe.step(x, target=target)
    return loss.detach().clone(), {n: p.grad.clone() for n, p in pipe.named_parameters()}


def _same(a, b):
    assert torch.equal(a[0], b[0]), f"losses differ: {a[0]} vs {b[0]}"
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), f"gradient of {name} differs"


# ---------------------------------------------------------------- randomness
@pytest.fixture(scope="module")
def dropout_prog():
    return pipesplit.compile(_dropout_gpt(), _ids(2), num_stages=4, progress=False)


def test_dropout_is_bit_identical_across_runs_schedules_and_checkpointing(dropout_prog):
    x, t = _ids(8), torch.randn(8, 16, 64)
    results = {}
    for schedule, ckpt in [("gpipe", False), ("1f1b", False), ("zb_h1", False), ("interleaved_1f1b", False),
                           ("1f1b", True), ("zb_h1", True)]:
        pipe = pipesplit.Pipeline(dropout_prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum",
                                  checkpoint=ckpt, num_ranks=2 if schedule == "interleaved_1f1b" else None)
        results[(schedule, ckpt)] = [_run(pipe, x, t) for _ in range(2)]
    first = results[("gpipe", False)][0]
    for key, (a, b) in results.items():
        _same(a, b)  # the same seed twice
        _same(first, a)  # every schedule, with and without checkpointing
    other = _run(pipesplit.Pipeline(dropout_prog, "1f1b", num_microbatches=4, loss_fn=dot_loss), x, t, seed=124)
    assert not torch.equal(other[0], first[0]), "another seed must draw other masks"


def test_dropout_pipeline_equals_the_stages_run_one_after_another(dropout_prog):
    """An independent reference: the root graph interpreted per microbatch, each stage on its stream."""
    x, t = _ids(8), torch.randn(8, 16, 64)
    pipe = pipesplit.Pipeline(dropout_prog, "zb_h1", num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    loss, grads = _run(pipe, x, t, seed=5)
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**62, ()).item())
    dropout_prog.zero_grad()
    want = streamed_reference(dropout_prog, (x,), {}, t, 4, seed)
    assert_close(loss, want, name="loss")
    for name, p in dropout_prog.named_parameters():
        assert_close(grads[name], p.grad, name=f"gradient of {name}")
    dropout_prog.zero_grad()


def test_one_stage_dropout_equals_the_model_seeded_per_microbatch():
    from pipesplit.rng import stream_seed

    model = _dropout_gpt()
    prog = pipesplit.compile(model, _ids(2), num_stages=1, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    x, t = _ids(4), torch.randn(4, 16, 64)
    loss, grads = _run(pipe, x, t, seed=9)
    torch.manual_seed(9)
    seed = int(torch.randint(0, 2**62, ()).item())
    ref = copy.deepcopy(model)
    want = 0.0
    for m, (xm, tm) in enumerate(zip(x.chunk(2), t.chunk(2))):
        torch.manual_seed(stream_seed(seed, 0, m))
        part = dot_loss(ref(xm), tm)
        part.backward()
        want += part.detach()
    assert torch.equal(loss, want), (loss, want)
    for name, p in ref.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def test_the_split_program_draws_like_the_model():
    model = _dropout_gpt()
    prog = pipesplit.compile(model, _ids(2), num_stages=3, progress=False)
    x = _ids(4)
    torch.manual_seed(3)
    want = model(x)
    torch.manual_seed(3)
    assert torch.equal(prog(x), want)


def test_a_step_takes_one_draw_from_the_users_generator(dropout_prog):
    pipe = pipesplit.Pipeline(dropout_prog, "1f1b", num_microbatches=2, loss_fn=dot_loss)
    x, t = _ids(4), torch.randn(4, 16, 64)
    torch.manual_seed(0)
    pipe.step(x, target=t)
    after = torch.rand(3)
    torch.manual_seed(0)
    torch.randint(0, 2**62, ())
    assert torch.equal(after, torch.rand(3)), "the dropout masks must not come from the user's generator"


# --------------------------------------------------------------------- modes
@pytest.mark.parametrize("name", ["conv_bn", "dropout_gpt"])
def test_eval_mode_equals_model_eval(name):
    torch.manual_seed(0)
    if name == "conv_bn":
        case = CASE_BY_NAME["conv_bn"]
        model, example, batch = case.build(), case.inputs(2)[0], case.inputs(6)[0]
    else:
        model, example, batch = _dropout_gpt(), (_ids(2),), (_ids(6),)
    prog = pipesplit.compile(model, example, num_stages=3, progress=False)
    state = {k: v.clone() for k, v in prog.state_dict().items()}
    assert prog.training and prog.eval() is prog and not prog.training
    want = copy.deepcopy(model).eval()(*batch)
    assert_close(prog(*batch), want, name="eval output")
    assert_close(prog(*batch), want, name="eval output, again (no dropout, stats untouched)")
    for k, v in prog.state_dict().items():
        assert torch.equal(v, state[k]), f"eval mode changed {k}"
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2)
    assert not pipe.training
    assert_close(pipe.forward(*batch), want, name="pipelined eval output")
    assert_close(pipe(*batch), want, name="pipe(x)")
    pipe.train()
    assert prog.training
    if name == "conv_bn":  # back in training mode: batch statistics again, running stats move
        check_training(model, pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss,
                                                 loss_reduction="sum"), [case.inputs(4)], m=2, steps=1)


def test_a_program_compiled_in_eval_mode_refuses_training_mode():
    model = _dropout_gpt().eval()
    prog = pipesplit.compile(model, _ids(2), num_stages=2, progress=False)
    assert not prog.training
    with pytest.raises(pipesplit.PipesplitError, match=r"model.train\(\)"):
        prog.train()


# ------------------------------------------------------------------ autocast
def test_autocast_around_step_reaches_every_stage():
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build()
    prog = pipesplit.compile(model, _ids(2), num_stages=3, progress=False)
    seen = []

    def loss_fn(out, target):
        seen.append(out.dtype)
        return dot_loss(out, target)

    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=loss_fn, loss_reduction="sum")
    x, t = _ids(4), torch.randn(4, 16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, target=t)
    assert seen == [torch.bfloat16] * 2, seen
    ref = copy.deepcopy(model)
    want = 0.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for xm, tm in zip(x.chunk(2), t.chunk(2)):
            part = dot_loss(ref(xm), tm)
            part.backward()
            want += part.detach()
    assert_close(loss, want, name="loss", rtol=3e-2)
    assert_grads_close(pipe.named_parameters(), ref, rtol=3e-2)


# -------------------------------------------------------------------- shapes
class BranchOnBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if x.shape[0] > 2:
            h = h * 2
        return self.b(torch.relu(h))


def test_sizes_outside_exports_range_are_refused_naming_input_and_range():
    model = BranchOnBatch()
    prog = pipesplit.compile(model, torch.randn(4, 8), num_stages=2, progress=False)
    x = torch.randn(3, 8)
    assert_close(prog(x), model(x), name="inside the range")
    with pytest.raises(pipesplit.InputError, match=r"input 'x' has size 2 in dimension 0.*sizes >= 3") as info:
        prog(torch.randn(2, 8))
    assert "example" in str(info.value)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss)
    with pytest.raises(pipesplit.InputError, match=r"size 2 in dimension 0 \(a microbatch"):
        pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))
    assert all(p.grad is None for p in pipe.parameters())


def test_a_batch_of_one_still_runs():
    model = CASE_BY_NAME["mlp"].build()
    prog = pipesplit.compile(model, torch.randn(4, 16), num_stages=2, progress=False)
    x = torch.randn(1, 16)
    assert_close(prog(x), model(x), name="batch of 1")


class ScaleByBatch(nn.Module):
    """A float and an int derived from the batch size cross the cut."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        scale = x.shape[0] ** -0.5
        h = torch.relu(self.a(x))
        return self.b(h) * scale + x.shape[0] * 2


def test_batch_derived_floats_and_ints_cross_cuts_in_a_pipeline():
    model = ScaleByBatch()
    prog = pipesplit.compile(model, torch.randn(4, 8), split_points=["b"], progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randn(6, 8),), {})], m=2, steps=2)
    assert {b.kind for b in prog.boundaries} >= {"float", "int"}  # microbatches of 3: a dynamic batch


# -------------------------------------------------------------------- inputs
class Lookup(nn.Module):
    """``table`` (V, d) is an input without a batch dimension."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, idx, table):
        h = self.a(table[idx])
        return self.c(torch.tanh(self.b(h)) + table.mean(0))


@pytest.mark.parametrize("vocab", [5, 8])  # 8: the table's size equals the batch's
def test_unbatched_inputs_go_whole_to_every_microbatch(vocab):
    torch.manual_seed(0)
    model = Lookup()
    table = torch.randn(vocab, 8)
    prog = pipesplit.compile(model, (torch.randint(0, vocab, (2,)), table), num_stages=3, unbatched=["table"],
                             progress=False)
    assert prog.inputs[1].shape == (vocab, 8)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    batches = [((torch.randint(0, vocab, (8,)), table), {})]
    ref = copy.deepcopy(model)
    idx = batches[0][0][0]
    t = torch.randn(8, 8)
    want = sum(dot_loss(ref(i, table), ti) for i, ti in zip(idx.chunk(4), t.chunk(4)))
    want.backward()
    assert_close(pipe.step(idx, table, target=t), want.detach(), name="loss")
    assert_grads_close(pipe.named_parameters(), ref)


def test_disagreeing_batch_sizes_name_the_input_and_the_fix():
    prog = pipesplit.compile(Lookup(), (torch.randint(0, 5, (2,)), torch.randn(5, 8)), num_stages=2, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss)
    with pytest.raises(pipesplit.InputError, match=r"'table'.*unbatched=") as info:
        pipe.step(torch.randint(0, 5, (4,)), torch.randn(6, 8), target=torch.randn(4, 8))
    assert "'idx': 4" in str(info.value)
    with pytest.raises(pipesplit.PipesplitError, match="unbatched names"):
        pipesplit.compile(Lookup(), (torch.randint(0, 5, (2,)), torch.randn(5, 8)), unbatched=["tabel"])


def test_targets_without_a_batch_dimension():
    model = CASE_BY_NAME["mlp"].build()
    prog = pipesplit.compile(model, torch.randn(2, 16), num_stages=2, progress=False)
    weights = torch.randn(4)  # one weight per class, the same for every sample

    def loss_fn(out, w):
        return (out * w).sum()

    x = torch.randn(6, 16)
    with pytest.raises(pipesplit.InputError, match="target_batch_dim=None"):
        pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=loss_fn).step(x, target=weights)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=loss_fn, loss_reduction="sum",
                              target_batch_dim=None)
    want = loss_fn(model(x), weights)
    assert_close(pipe.step(x, target=weights), want.detach(), name="loss")


# ----------------------------------------------------------- smaller items
def test_load_state_dict_refuses_a_wrongly_shaped_tensor():
    model = CASE_BY_NAME["mlp"].build()
    prog = pipesplit.compile(model, torch.randn(2, 16), num_stages=2, progress=False)
    sd = model.state_dict()
    sd["layers.0.0.bias"] = torch.zeros(1)  # would broadcast into (16,)
    before = prog.state_dict()["layers.0.0.bias"].clone()
    with pytest.raises(pipesplit.InputError, match=r"layers.0.0.bias: \(1,\) for \(16,\)"):
        prog.load_state_dict(sd)
    assert torch.equal(prog.state_dict()["layers.0.0.bias"], before), "nothing is loaded when one tensor is wrong"


@pytest.mark.parametrize("option", [{"pins": {"layers.0": 0}}, {"no_split": ["out"]}, {"slack": 0.2},
                                    {"order": "program"}])
def test_planner_options_beside_a_fixed_split_are_refused(option):
    """Options that choose cuts cannot apply to a fixed split; max_stage_memory= and schedule= price it
    instead (tests/test_checkpointing.py)."""
    model = CASE_BY_NAME["mlp"].build()
    with pytest.raises(pipesplit.PlanError, match=f"{next(iter(option))}=.*split_points="):
        pipesplit.compile(model, torch.randn(2, 16), split_points=["layers.4"], **option)
