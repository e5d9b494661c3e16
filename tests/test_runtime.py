"""The local pipeline executor: every schedule reproduces the unsplit model's loss and gradients."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

import pipesplit
from pipesplit.schedules import Schedule, list_schedules
from tests.close import assert_close, assert_grads_close, assert_tree_close
from tests.training import dot_loss, make_target
from tests.zoo import CASE_BY_NAME

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v"]
MULTI = {"interleaved_1f1b", "looped_bfs", "zb_v"}  # several stages per rank


def reference(model, args, kwargs, target):
    ref = copy.deepcopy(model)
    loss = dot_loss(ref(*args, **kwargs), target)
    loss.backward()
    return ref, loss.detach()


def assert_grads(pipe, ref):
    assert any(p.grad is not None for p in ref.parameters())
    assert_grads_close(pipe.named_parameters(), ref)


def test_all_builtin_schedules_are_covered():
    assert set(SCHEDULES) <= set(list_schedules())


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model_name", ["long_skip", "late_kwarg", "gpt_tied", "dict_tuple_out"])
def test_schedule_matches_full_batch(schedule, model_name):
    torch.manual_seed(0)
    case = CASE_BY_NAME[model_name]
    model = case.build()
    stages = 4
    prog = pipesplit.compile(model, case.inputs(2)[0], example_kwargs=case.inputs(2)[1], num_stages=stages)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum",
                              num_ranks=2 if schedule in MULTI else None)
    args, kwargs = case.inputs(8)
    target = make_target(model(*args, **kwargs))
    ref, want = reference(model, args, kwargs, target)
    loss = pipe.step(*args, target=target, **kwargs)
    assert_close(loss, want, name="loss")
    assert_grads(pipe, ref)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b"])
def test_several_optimizer_steps_stay_equal(schedule):
    """After each AdamW step the pipeline still computes the model's loss and gradients.

    The reference takes the pipeline's parameters before each step instead of following
    its own trajectory: AdamW moves a weight by lr * g / (sqrt(v) + eps), so where g is
    ~1e-9 (near eps) the float32 rounding of a 1e-3-scale gradient (~1e-11) moves it by
    lr * dg / eps ~ 1e-5. Two runs that only sum in another order part that far after one
    step, split or not; what must stay exact is the function at the parameters held.
    """
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build()
    idx = torch.randint(0, 64, (2, 16))
    prog = pipesplit.compile(model, idx, num_stages=4)

    def ce(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=ce, num_ranks=2 if schedule in MULTI else None)
    ref = copy.deepcopy(model)
    held = dict(pipe.named_parameters())
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)

    def take_the_pipelines_parameters():
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p.copy_(held[name])

    for step in range(3):
        take_the_pipelines_parameters()
        x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
        loss = pipe.step(x, target=y)
        want = ce(ref(x), y)
        want.backward()
        assert_close(loss, want.detach(), name=f"loss of step {step}")
        assert_grads(pipe, ref)
        before = {name: p.detach().clone() for name, p in held.items()}
        opt.step()
        pipe.zero_grad(), ref.zero_grad()
        still = [name for name, p in held.items() if torch.equal(p, before[name])]
        assert not still, f"the optimizer step {step} did not move {still}"
    take_the_pipelines_parameters()
    x = torch.randint(0, 64, (8, 16))
    assert_close(pipe.eval(x), ref(x), name="eval output after three AdamW steps")


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_stage_forward_hooks_with_kwargs_run_under_every_backward(schedule):
    """A forward hook registered on a stage module with with_kwargs=True (as FSDP2's fully_shard
    registers its own) is called with the kwargs under the split backward's weight graph too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    prog = pipesplit.compile(model, torch.randn(2, 8), num_stages=2)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=2, loss_fn=F.mse_loss)
    seen = []
    for s in prog.stages:
        s.module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(("pre", kwargs)), with_kwargs=True)
        s.module.register_forward_hook(lambda m, args, kwargs, out: seen.append(("post", kwargs)), with_kwargs=True)
    ref = copy.deepcopy(model)
    x, t = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, target=t)
    assert seen.count(("pre", {})) == seen.count(("post", {})) == 2 * 2  # two stages, two microbatches
    F.mse_loss(ref(x), t).backward()
    assert_grads(pipe, ref)


def test_gradient_accumulation_across_steps():
    torch.manual_seed(0)
    case = CASE_BY_NAME["long_skip"]
    model = case.build()
    prog = pipesplit.compile(model, case.inputs(2)[0], num_stages=3)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    ref = copy.deepcopy(model)
    for _ in range(2):
        (x,), _ = case.inputs(4)
        t = torch.randn(4, 16)
        pipe.step(x, target=t)
        dot_loss(ref(x), t).backward()
    assert_grads(pipe, ref)


def test_batchnorm_stats_follow_the_microbatches():
    """BatchNorm sees each microbatch, as the original model would when run on them in order."""
    torch.manual_seed(0)
    case = CASE_BY_NAME["conv_bn"]
    model = case.build()
    prog = pipesplit.compile(model, case.inputs(2)[0], num_stages=3)
    pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    (x,), _ = case.inputs(8)
    t = torch.randn(8, 10)
    pipe.step(x, target=t)
    ref = copy.deepcopy(model)
    for xm, tm in zip(x.chunk(2), t.chunk(2)):
        dot_loss(ref(xm), tm).backward()
    assert_grads(pipe, ref)
    state = prog.state_dict()
    for name, buf in ref.state_dict().items():
        assert_close(state[name], buf, name=name)


def test_eval_merges_outputs_like_the_model():
    torch.manual_seed(0)
    case = CASE_BY_NAME["dict_tuple_out"]
    model = case.build()
    prog = pipesplit.compile(model, case.inputs(2)[0], num_stages=3)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4)
    (x,), _ = case.inputs(8)
    got, want = pipe.eval(x), model(x)
    assert_tree_close(got, want, name="eval outputs")


def test_activation_checkpointing_keeps_gradients():
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build()
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=2)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum", checkpoint=True)
    x = torch.randint(0, 64, (4, 16))
    t = torch.randn(4, 16, 64)
    ref, want = reference(model, (x,), {}, t)
    assert_close(pipe.step(x, target=t), want, name="loss")
    assert_grads(pipe, ref)


class InplaceAcrossCuts(torch.nn.Module):
    """``relu_`` on the input and on activations: a cut makes a stage write a value it received."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        x.mul_(2.0)
        v = self.a(x)
        v = self.b(v.relu_())
        v = self.c(v.mul_(3.0))
        return v.relu_()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("stages", [2, 4])
def test_activation_checkpointing_of_stages_writing_their_inputs(stages, m, schedule):
    """A stage writing an input in place under ``checkpoint=True``: checkpointing saves the stage's inputs
    and replays the stage from them, so the copy the write goes to is made inside the replayed stage
    (made outside, the write changed what was saved: autograd's 'modified by an inplace operation')."""
    from tests.training import accumulate

    torch.manual_seed(0)
    model = InplaceAcrossCuts()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, torch.randn(2, 4, 8), num_stages=stages, progress=False)
    assert prog.stages[0].mutated_inputs and any(s.mutated_inputs for s in prog.stages[1:])
    if schedule == "interleaved_1f1b" and m == 1:
        pytest.skip("interleaved_1f1b runs 2+ microbatches")
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=m, loss_fn=dot_loss, loss_reduction="sum",
                              checkpoint=True)
    x, t = torch.randn(4, 4, 8), torch.randn(4, 4, 8)
    x_ref, x_pipe = x.clone(), x.clone()
    want = accumulate(ref, (x_ref,), {}, t, m)
    assert_close(pipe.step(x_pipe, target=t), want, name="loss")
    assert_grads(pipe, ref)
    assert_close(x_pipe, x_ref, name="the caller's input after the step")


def test_checkpointing_refuses_stages_that_update_buffers():
    case = CASE_BY_NAME["conv_bn"]
    prog = pipesplit.compile(case.build(), case.inputs(2)[0], num_stages=2)
    with pytest.raises(pipesplit.PipesplitError, match="checkpoint"):
        pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, checkpoint=True)


def test_dropout_trains():
    torch.manual_seed(0)
    model = pipesplit.models.GPT(pipesplit.models.GPTConfig(vocab=64, dim=32, layers=2, heads=2, seq=16, dropout=0.5))
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16)), num_stages=2)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    x = torch.randint(0, 64, (4, 16))
    outs = [pipe.forward(x) for _ in range(2)]
    assert not torch.equal(outs[0], outs[1]), "dropout should make two training-mode passes differ"
    assert torch.equal(pipe.eval(x), pipe.eval(x)), "eval mode has no dropout"
    assert pipe.training, "pipe.eval(x) restores the mode it found"
    pipe.step(x, target=torch.randn(4, 16, 64))
    grads = [p.grad for p in pipe.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------- bad input
def _mlp_pipe(**kw):
    case = CASE_BY_NAME["mlp"]
    prog = pipesplit.compile(case.build(), case.inputs(2)[0], num_stages=4)
    return pipesplit.Pipeline(prog, loss_fn=dot_loss, **kw)


def test_batch_that_does_not_split_is_refused_before_work():
    pipe = _mlp_pipe(schedule="1f1b", num_microbatches=4)
    with pytest.raises(pipesplit.InputError, match=r"batch of 6 does not split into 4"):
        pipe.step(torch.randn(6, 16), target=torch.randn(6, 4))
    assert all(p.grad is None for p in pipe.parameters())


def test_too_few_microbatches_for_a_schedule():
    with pytest.raises(pipesplit.ScheduleError) as info:
        _mlp_pipe(schedule="interleaved_1f1b", num_microbatches=1, num_ranks=2)
    assert "microbatch" in str(info.value)


def test_unknown_and_invalid_custom_schedules():
    with pytest.raises(pipesplit.ScheduleError, match="1f1b"):
        _mlp_pipe(schedule="1f1c", num_microbatches=4)
    broken = Schedule.from_lists(
        "broken",
        [["0F0", "0B0"], ["1F0", "1B0"], ["2F0", "2B0"], ["3B0", "3F0"]],  # stage 3 backward before forward
        num_stages=4, num_microbatches=1,
    )
    with pytest.raises(pipesplit.ScheduleError, match="3B0"):
        _mlp_pipe(schedule=broken, num_microbatches=1)


def test_wrong_input_shape_is_refused():
    pipe = _mlp_pipe(schedule="gpipe", num_microbatches=2)
    with pytest.raises(pipesplit.InputError, match="dimension 1 must be 16"):
        pipe.step(torch.randn(4, 15), target=torch.randn(4, 4))


def test_a_stuck_stage_times_out_naming_the_rank():
    case = CASE_BY_NAME["mlp"]
    prog = pipesplit.compile(case.build(), case.inputs(2)[0], num_stages=2)

    def slow_loss(out, target):
        time.sleep(3)
        return dot_loss(out, target)

    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=slow_loss, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(pipesplit.RuntimeCommError, match="rank 1") as info:
        pipe.step(torch.randn(4, 16), target=torch.randn(4, 4))
    assert time.monotonic() - start < 10
    assert "gradient" in str(info.value)


class SeqFirst(torch.nn.Module):
    """Takes (time, batch, features): the batch is dimension 1."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def test_batch_dimension_is_configurable():
    torch.manual_seed(0)
    model = SeqFirst()
    prog = pipesplit.compile(model, torch.randn(5, 2, 8), num_stages=3, batch_dim=1)
    assert prog.inputs[0].shape == (5, 2, 8) and prog.inputs[0].batched  # captured at the example's batch
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    x, t = torch.randn(5, 6, 8), torch.randn(5, 6, 3)
    ref, want = reference(model, (x,), {}, t)
    assert_close(pipe.step(x, target=t), want, name="loss")
    assert_grads(pipe, ref)
    assert prog.inputs[0].shape == (None, None, 8)  # microbatches of 3: captured again, the batch and the length dynamic
    assert_close(pipe.eval(x), model(x), name="eval output")
    with pytest.raises(pipesplit.PipesplitError, match="batch_dim=0"):
        pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, batch_dim=0)


@pytest.mark.parametrize("caller_mode", ["no_grad", "inference_mode", "plain"])
@pytest.mark.parametrize("stages,schedule", [(1, "1f1b"), (2, "looped_bfs"), (2, "zb_v")])
def test_one_rank_runs_in_the_callers_thread_as_a_rank_thread_would(stages, schedule, caller_mode):
    """One rank runs in the caller's thread (no hand-off), in the state a fresh rank thread starts in:
    a step under the caller's ``no_grad`` or ``inference_mode`` still trains, and the caller's modes
    come back unchanged."""
    torch.manual_seed(0)
    case = CASE_BY_NAME["gpt_tied"]
    model = case.build()
    prog = pipesplit.compile(model, case.inputs(2)[0], num_stages=stages, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum",
                              num_ranks=1)
    args, kwargs = case.inputs(8)
    target = make_target(model(*args, **kwargs))
    ref, want = reference(model, args, kwargs, target)
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "plain": torch.enable_grad}
    with modes[caller_mode]():
        before = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        loss = pipe.step(*args, target=target, **kwargs)
        assert (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) == before
    assert pipe._threads is None  # no rank thread was started
    assert_close(loss, want, name="loss")
    assert_grads(pipe, ref)


def test_a_step_without_random_ops_leaves_torchs_generator_as_the_model_would():
    """The per-step seed is drawn only for a program with random ops: without any, the numbers a user
    draws after a step are the ones they would draw after the plain model's step."""
    torch.manual_seed(0)
    case = CASE_BY_NAME["gpt_tied"]
    model = case.build()
    prog = pipesplit.compile(model, case.inputs(2)[0], num_stages=2, progress=False)
    assert prog.random_ops == 0
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    args, _ = case.inputs(4)
    target = make_target(model(*args))
    torch.manual_seed(5)
    pipe.step(*args, target=target)
    after_pipe = torch.rand(4)
    torch.manual_seed(5)
    dot_loss(model(*args), target).backward()
    assert torch.equal(after_pipe, torch.rand(4))
