"""Bad input gets a clear PipesplitError, and the user's model is never changed by a failure."""

from __future__ import annotations

import copy
import inspect
import logging
import os
import re
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.models import gpt
from tests.close import assert_close
from tests.test_exact import check_exact


@contextmanager
def unchanged(model: nn.Module) -> Iterator[None]:
    """The block must leave ``model``'s values, parameter objects and gradients as they were."""
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    training = model.training
    yield
    after = model.state_dict()
    assert list(after) == list(values), "the model's state_dict keys changed"
    for key, value in values.items():
        assert torch.equal(after[key], value), f"the model's {key} changed"
    now = dict(model.named_parameters(remove_duplicate=False))
    assert now.keys() == params.keys()
    assert all(now[n] is p for n, p in params.items()), "a parameter object of the model was replaced"
    now_buffers = dict(model.named_buffers(remove_duplicate=False))
    assert all(now_buffers[n] is b for n, b in buffers.items()), "a buffer object of the model was replaced"
    assert all(p.grad is None for p in model.parameters()), "a .grad appeared on the model"
    assert model.training == training


# ------------------------------------------------------------------ models


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent: torch.export cannot trace this
            return self.b(h)
        return h


class TwoInputs(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x, y):
        return self.b(torch.relu(self.a(x)) + y)


class PinsBatch(nn.Module):
    """Reshapes with a literal batch size: export specializes the batch dimension to 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.a(x).view(4, -1).repeat(1, 2))


def _line_of(func, text: str) -> int:
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if text in line)


# ------------------------------------------------------------------ capture


def test_data_dependent_branch_names_the_user_line():
    torch.manual_seed(0)
    model = Branchy()
    with unchanged(model), pytest.raises(pipesplit.CaptureError) as info:
        pipesplit.compile(model, torch.randn(2, 4), num_stages=2)
    msg = str(info.value)
    line = _line_of(Branchy.forward, "if h.sum() > 0")
    assert f"{os.path.abspath(__file__)}:{line}" in msg, msg
    assert "h.sum() > 0" in msg
    assert "torch.cond" in msg and "torch.where" in msg
    assert isinstance(info.value, pipesplit.PipesplitError)


def test_a_capture_error_leads_with_the_failing_line_and_the_hint():
    with pytest.raises(pipesplit.CaptureError) as info:
        pipesplit.compile(Branchy(), torch.randn(2, 4), num_stages=2)
    first, code, hint, *rest = str(info.value).splitlines()
    line = _line_of(Branchy.forward, "if h.sum() > 0")
    assert first == f"torch.export could not capture Branchy at {os.path.abspath(__file__)}:{line} in forward:"
    assert code.strip().startswith("if h.sum() > 0:")
    assert hint.startswith("hint: ") and "torch.where" in hint and "torch.cond" in hint
    # torch's own words follow, less its advice to itself (kept on __cause__, whatever the release says)
    boilerplate = re.compile(r"TORCH_LOGS|TORCHDYNAMO_|https?://|guard_or_false|^\s*for more information", re.I | re.M)
    assert not boilerplate.search(str(info.value)), str(info.value)
    assert rest and rest[0].startswith("torch.export says: ") and len(rest) <= 3, rest
    assert boilerplate.search(str(info.value.__cause__)), "torch's whole account stays on __cause__"


def test_torch_boilerplate_is_dropped_by_its_shape():
    from pipesplit.export import torch_summary

    text = (
        "Could not guard on data-dependent expression Eq(u7, 1) (unhinted: Eq(u7, 1)).\n\n"
        "consider using data-dependent friendly APIs such as guard_or_false, guard_or_true. A new sentence.\n"
        "Caused by: (_export/non_strict_utils.py:9999 in __torch_function__)\n"
        'For more information, run with TORCH_LOGS="+dynamic,guards"\n'
        'For extended logs when we create symbols, also add TORCHDYNAMO_EXTENDED_DEBUG_CREATE_SYMBOL="u7"\n'
        "If you suspect the guard was triggered from C++, add TORCHDYNAMO_EXTENDED_DEBUG_CPP=1\n"
        "For more debugging help, see https://example.org/some/new/page\n"
    )
    assert torch_summary(text) == "Could not guard on data-dependent expression Eq(u7, 1) (unhinted: Eq(u7, 1))."
    assert torch_summary("\nA first line.\nA second line.\n\nLater.") == "A first line.\nA second line."


def test_a_capture_failure_shows_only_pipesplits_message(capfd, caplog):
    # torch's loggers do not propagate and write through their own handlers: listen on each
    watched = [logging.getLogger(name) for name in
               ("torch", "torch._dynamo", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes")]
    levels = [logger.level for logger in watched]
    for logger in watched:
        logger.addHandler(caplog.handler)
    try:
        with pytest.raises(pipesplit.CaptureError) as info:
            pipesplit.compile(Branchy(), torch.randn(2, 4), num_stages=2)
        out, err = capfd.readouterr()
        assert "def forward" not in out + err, "torch printed the partial graph"
        assert out + err == "", out + err
        shown = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
        assert shown == [], "torch logged while pipesplit raised its own error"
        assert [logger.level for logger in watched] == levels, "logger levels must be restored"
        logging.getLogger("torch.fx.experimental.symbolic_shapes").warning("after")  # torch logs again afterwards
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == ["after"]
    finally:
        for logger in watched:
            logger.removeHandler(caplog.handler)
    cause = info.value.__cause__  # torch's whole account stays reachable
    assert cause is not None and "data-dependent" in str(cause) and "def forward" in cause.partial_fx_graph


def test_non_module_is_refused():
    with pytest.raises(pipesplit.CaptureError, match=r"nn\.Module.*function"):
        pipesplit.compile(lambda x: x * 2, torch.randn(2, 4))
    with pytest.raises(pipesplit.CaptureError, match=r"nn\.Module.*dict"):
        pipesplit.compile({"weight": torch.randn(4)}, torch.randn(2, 4))


@pytest.mark.parametrize(
    "args, kwargs, says",
    [
        ((torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)), None, "too many positional"),
        ((torch.randn(2, 8),), None, "missing a required argument: 'y'"),
        ((torch.randn(2, 8), torch.randn(2, 8)), {"z": torch.randn(2, 8)}, "unexpected keyword argument 'z'"),
    ],
    ids=["extra_positional", "missing_arg", "unknown_kwarg"],
)
def test_example_inputs_must_fit_forward(args, kwargs, says):
    model = TwoInputs()
    with unchanged(model), pytest.raises(pipesplit.CaptureError) as info:
        pipesplit.compile(model, args, example_kwargs=kwargs)
    msg = str(info.value)
    assert says in msg
    assert "TwoInputs.forward(x, y)" in msg, "the message should show the signature"
    assert "example_kwargs" in msg


# --------------------------------------------------------------------- plan


def test_zero_stages():
    model = TwoInputs()
    with unchanged(model), pytest.raises(pipesplit.PlanError, match=r"num_stages must be at least 1, got 0"):
        pipesplit.compile(model, (torch.randn(2, 8), torch.randn(2, 8)), num_stages=0)


def test_too_many_stages_gives_the_numbers():
    model = TwoInputs()
    with unchanged(model), pytest.raises(pipesplit.PlanError) as info:
        pipesplit.compile(model, (torch.randn(2, 8), torch.randn(2, 8)), num_stages=50)
    msg = str(info.value)
    assert "num_stages=50" in msg
    limit = int(re.search(r"num_stages <= (\d+)", msg).group(1))
    assert 1 < limit < 50
    pipesplit.compile(model, (torch.randn(2, 8), torch.randn(2, 8)), num_stages=limit)  # the suggestion works


def test_devices_of_the_wrong_length():
    model = TwoInputs()
    with unchanged(model), pytest.raises(pipesplit.PlanError, match=r"1 device\(s\) for 2 stages"):
        pipesplit.compile(model, (torch.randn(2, 8), torch.randn(2, 8)), num_stages=2, devices=["cpu"])


@pytest.fixture
def no_export(monkeypatch):
    """These mistakes must be caught before the (slow) export."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.export ran before the argument check")
    monkeypatch.setattr(torch.export, "export", refuse)


@pytest.mark.parametrize("k", [2.5, "2", True, 2.0])
def test_num_stages_that_is_not_a_whole_number(no_export, k):
    with pytest.raises(pipesplit.PlanError, match=r"num_stages must be a whole number of stages, got .*num_stages=2"):
        pipesplit.compile(TwoInputs(), (torch.randn(2, 8), torch.randn(2, 8)), num_stages=k)


@pytest.mark.parametrize("count", [0, 1])
def test_a_device_this_machine_does_not_have(no_export, monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    wanted = f"cuda:{count}"
    with pytest.raises(pipesplit.PlanError) as info:
        pipesplit.compile(TwoInputs(), (torch.randn(2, 8), torch.randn(2, 8)), num_stages=2, devices=["cpu", wanted])
    msg = str(info.value)
    assert f"devices[1]='{wanted}' is not available: this machine has {count} cuda device(s)" in msg
    assert "available: " + ", ".join(["cpu"] + [f"cuda:{i}" for i in range(count)]) + ")" in msg
    assert "devices=['cpu'] * 2" in msg


@pytest.mark.parametrize("devices, says", [
    (["gpu:0", "cpu"], "devices[0]='gpu:0' is not a device; this machine has 'cpu'"),
    ("cpu", "devices takes one device per stage, got the single device 'cpu'; pass a list, e.g. devices=['cpu'] * 2"),
])
def test_devices_that_are_not_devices(no_export, devices, says):
    with pytest.raises(pipesplit.PlanError) as info:
        pipesplit.compile(TwoInputs(), (torch.randn(2, 8), torch.randn(2, 8)), num_stages=2, devices=devices)
    assert says in str(info.value)


# -------------------------------------------------------------------- calls


@pytest.fixture(scope="module")
def two():
    torch.manual_seed(0)
    model = TwoInputs()
    prog = pipesplit.compile(model, (torch.randn(4, 8), torch.randn(4, 8)), num_stages=2)
    return model, prog


@pytest.mark.parametrize(
    "args, kwargs, got",
    [
        ((torch.randn(3, 8), torch.randn(3, 8)), {"z": torch.randn(3, 8)}, "kwargs={'z': Tensor[3, 8]}"),
        ((torch.randn(3, 8),), {}, "args=(Tensor[3, 8],)"),
        (([torch.randn(3, 8)], torch.randn(3, 8)), {}, "args=([Tensor[3, 8]], Tensor[3, 8])"),
    ],
    ids=["extra_kwarg", "missing_arg", "list_for_tensor"],
)
def test_call_with_another_structure(two, args, kwargs, got):
    _, prog = two
    with pytest.raises(pipesplit.InputError) as info:
        prog(*args, **kwargs)
    lines = str(info.value).splitlines()
    expected = next(line for line in lines if "expected:" in line)
    actual = next(line for line in lines if "got:" in line)
    assert "args=(x, y), kwargs={}" in expected
    assert got in actual


@pytest.mark.parametrize(
    "x, words",
    [
        (torch.randn(3, 8, 1), ["'x'", "(3, 8, 1)", "3 dimensions", "(*, 8)", "2 dimensions"]),
        (torch.randn(3, 7), ["'x'", "dimension 1", "must be 8", "got 7"]),
        (torch.randn(3, 8, dtype=torch.float64), ["'x'", "torch.float64", "torch.float32"]),
        (torch.ones(3, 8, dtype=torch.long), ["'x'", "torch.int64", "torch.float32"]),
    ],
    ids=["rank", "feature_dim", "float64", "int64"],
)
def test_call_with_a_wrong_tensor(two, x, words):
    model, prog = two
    with pytest.raises(pipesplit.InputError) as info:
        prog(x, torch.randn(3, 8))
    for word in words:
        assert word in str(info.value)
    y = torch.randn(3, 8)
    good = torch.randn(3, 8)
    assert_close(prog(good, y), model(good, y), name="output")  # a failed call leaves the program usable


def test_non_tensor_for_a_tensor_input(two):
    _, prog = two
    with pytest.raises(pipesplit.InputError, match=r"'y' must be a tensor, got float"):
        prog(torch.randn(3, 8), 1.0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_inputs_that_disagree_on_the_batch_raise_what_a_pipeline_raises(dynamic):
    torch.manual_seed(0)
    model = TwoInputs()
    prog = pipesplit.compile(model, (torch.randn(4, 8), torch.randn(4, 8)), num_stages=2, dynamic_batch=dynamic)
    x, y = torch.randn(8, 8), torch.randn(6, 8)
    with pytest.raises(pipesplit.InputError) as called:
        prog(x, y)
    with pytest.raises(pipesplit.InputError) as stepped:
        pipesplit.Pipeline(prog, "gpipe", num_microbatches=2).step(x, y)
    assert str(called.value) == str(stepped.value)
    assert "inputs disagree on the batch size along dim 0: {'x': 8, 'y': 6}" in str(called.value)
    assert prog.notes == [], "refused before capturing the model again for another batch"
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    assert_close(prog(x, y), model(x, y), name="output")  # and a call that agrees still runs


def test_an_unbatched_input_may_differ():
    torch.manual_seed(0)
    model = TwoInputs()
    prog = pipesplit.compile(model, (torch.randn(4, 8), torch.randn(1, 8)), num_stages=2, unbatched=["y"])
    x, y = torch.randn(6, 8), torch.randn(1, 8)
    assert_close(prog(x, y), model(x, y), name="output")


# ------------------------------------------------------------ plan files


def test_a_missing_plan_file_is_a_plan_error(no_export, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pipesplit.PlanError) as info:
        pipesplit.compile(TwoInputs(), (torch.randn(2, 8), torch.randn(2, 8)), plan="nope.json")
    assert "plan file 'nope.json' does not exist" in str(info.value)
    assert str(tmp_path / "nope.json") in str(info.value)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(pipesplit.PlanError, match=r"plan file 'bad.json': the plan is not valid JSON"):
        pipesplit.compile(TwoInputs(), (torch.randn(2, 8), torch.randn(2, 8)), plan="bad.json")


# ------------------------------------------------------------ stage counts the model cannot balance


def _gpt_warnings(k: int, caplog) -> tuple[object, list[str]]:
    torch.manual_seed(0)
    model = gpt(layers=2, dim=32, vocab=512, seq=16)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipesplit"):
        prog = pipesplit.compile(model, torch.randint(0, 512, (4, 16)), num_stages=k)
    return prog, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_more_stages_than_the_model_can_balance_are_warned(caplog):
    prog, warned = _gpt_warnings(16, caplog)
    plan = prog.plan
    total, largest = sum(plan.stage_costs), plan.lower_bound  # the lower bound is the largest op here
    assert largest > total / 16
    most = int(total // largest)
    balance = [n for n in prog.notes if "more than this model can balance" in n]
    assert len(balance) == 1 and f"pipesplit: {balance[0]}" in warned, (prog.notes, warned)
    note = balance[0]
    assert note.startswith("num_stages=16 is more than this model can balance: its largest op, ")
    assert "in head)" in note  # the op that sets the bottleneck, and where it is
    assert f"balance {plan.bottleneck / (total / 16):.2f}x the mean" in note
    assert f"compile with num_stages={most} or fewer" in note
    empty = [s for s, c in enumerate(plan.stage_costs) if c == 0]
    assert empty, plan.stage_costs  # this many stages leaves some with nothing to compute
    which = f"stage {empty[0]} of 16 does" if len(empty) == 1 else f"stages {', '.join(map(str, empty))} of 16 do"
    assert any(n.startswith(f"{which} no compute") for n in prog.notes), prog.notes
    _, warned = _gpt_warnings(most, caplog)  # the count it suggests balances
    assert not [w for w in warned if "balance" in w or "no compute" in w], warned


def test_a_stage_count_that_balances_says_nothing(caplog):
    prog, warned = _gpt_warnings(2, caplog)
    assert warned == [] and prog.notes == []


# ------------------------------------------------------------ pinned batch


def test_model_that_pins_the_batch():
    torch.manual_seed(0)
    model = PinsBatch()
    with unchanged(model):
        prog = pipesplit.compile(model, torch.randn(4, 8), num_stages=2, dynamic_batch=True)
    assert any("pins the batch" in note and "=4" in note for note in prog.notes), prog.notes
    assert "pins the batch" in prog.report()
    assert [i.shape for i in prog.inputs] == [(4, 8)]
    assert prog.boundaries and all(None not in b.shape for b in prog.boundaries), prog.boundaries
    x = torch.randn(4, 8)
    assert_close(prog(x), model(x), name="output")
    with pytest.raises(pipesplit.InputError) as info:
        prog(torch.randn(3, 8))
    msg = str(info.value)
    assert "pins the batch dimension to 4" in msg and "got 3" in msg


class ScalesRows(nn.Module):
    """``bias`` is a (T, D) table broadcast over the batch; with T equal to the example's batch it looks
    batched, and the capture pins its dimension 0 while ``x``'s stays free."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * bias)


def test_an_input_pinned_beside_a_free_batch_is_named_as_a_table():
    torch.manual_seed(0)
    model, x, bias = ScalesRows(), torch.randn(4, 4, 8), torch.randn(4, 8)
    # a capture with a dynamic batch alone pins bias's dimension 0 and names it in a note; the program
    # gives it whole to every microbatch, as it is (so does the capture with every dimension dynamic,
    # which a static program takes at its first new size: it sees that dimension is x's length)
    for dynamic in (True, False):
        prog = pipesplit.compile(model, (x, bias), num_stages=2, dynamic_batch=dynamic)
        pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=lambda out, t: (out * t).sum(),
                                  loss_reduction="sum")
        t = torch.randn(4, 4, 8)
        assert_close(pipe.step(x, bias, target=t), (model(x, bias) * t).sum().detach(), name="loss")
        assert [i.batched for i in prog.inputs] == [True, False]
        msg = " ".join(prog.notes)
        assert not dynamic or "'bias' kept dimension 0 fixed while 'x' took any size" in msg and "unbatched=['bias']" in msg, msg
    # the fix it names works and trains as the model does
    prog = pipesplit.compile(model, (x, bias), num_stages=2, unbatched=["bias"])
    assert not prog.notes, prog.notes
    y = torch.randn(6, 4, 8)
    assert_close(prog(y, bias), model(y, bias), name="output at another batch")


def test_example_batch_of_one_pins_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    prog = pipesplit.compile(model, torch.randn(1, 4), num_stages=2, dynamic_batch=True)
    assert any("batch of 2 or more" in note for note in prog.notes), prog.notes
    x = torch.randn(1, 4)
    assert_close(prog(x), model(x), name="output")
    with pytest.raises(pipesplit.InputError, match=r"batch of 2 or more"):
        prog(torch.randn(2, 4))


def test_batch_stays_dynamic_without_a_note():
    torch.manual_seed(0)
    model = TwoInputs()
    prog = pipesplit.compile(model, (torch.randn(4, 8), torch.randn(4, 8)), num_stages=2, dynamic_batch=True)
    assert prog.notes == []
    assert [i.shape for i in prog.inputs] == [(None, 8), (None, 8)]


# ---------------------------------------------------------------- Hugging Face


def _hf_gpt2_default() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
    return model.eval()  # dropout off, so the comparison below is exact


def test_hf_causal_lm_default_config():
    pytest.importorskip("transformers")
    model = _hf_gpt2_default()
    ids = torch.randint(0, 64, (2, 8))
    assert model.config.use_cache
    with unchanged(model):  # a KV-cache object cannot cross a stage: pipesplit asks for none, and says so
        prog = pipesplit.compile(model, ids, num_stages=2)
    assert any("use_cache=False" in note for note in prog.notes), prog.notes
    assert "use_cache=False" in prog.report()
    check_exact(model, (ids,), {}, prog, (torch.randint(0, 64, (3, 8)),), {"use_cache": False})
    out = prog(torch.randint(0, 64, (3, 8)))  # called as the model is: without use_cache
    assert out.past_key_values is None


def test_hf_causal_lm_without_cache_matches():
    pytest.importorskip("transformers")
    model = _hf_gpt2_default()
    model.config.use_cache = False
    ids = torch.randint(0, 64, (2, 8))
    with unchanged(model):
        prog = pipesplit.compile(model, ids, num_stages=2)
    check_exact(model, (ids,), {}, prog, (torch.randint(0, 64, (3, 8)),), {})


# ------------------------------------------------------------------- state


def _small_gpt():
    torch.manual_seed(0)
    return gpt(layers=2, dim=16, vocab=32, seq=8, heads=2)


def _perturb(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def test_state_dict_keys_follow_the_model_with_tied_weights():
    model = _small_gpt()
    prog = pipesplit.compile(model, torch.randint(0, 32, (2, 8)), num_stages=2)
    want = model.state_dict()
    got = prog.state_dict()
    assert list(got) == list(want)
    assert "tok.weight" in got and "head.weight" in got
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert got["tok.weight"].data_ptr() == got["head.weight"].data_ptr(), "a tied weight is one tensor"


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu:0"]], ids=["one_device", "replicas"])
def test_load_state_dict_follows_a_changed_model(devices):
    model = _small_gpt()
    prog = pipesplit.compile(model, torch.randint(0, 32, (2, 8)), num_stages=2, devices=devices)
    idx = torch.randint(0, 32, (3, 8))
    assert_close(prog(idx), model(idx), name="output")
    _perturb(model)
    assert not torch.allclose(prog(idx), model(idx)), "the program must hold its own copy of the weights"
    prog.load_state_dict(model.state_dict())
    torch.testing.assert_close(prog(idx), model(idx), rtol=0, atol=0)


def test_load_state_dict_mismatched_keys():
    model = _small_gpt()
    prog = pipesplit.compile(model, torch.randint(0, 32, (2, 8)), num_stages=2)
    before = {k: v.clone() for k, v in prog.state_dict().items()}
    changed = _small_gpt()
    _perturb(changed)
    sd = changed.state_dict()
    sd.pop("ln_f.weight")
    sd["bogus.weight"] = torch.zeros(3)
    with pytest.raises(pipesplit.InputError) as info:
        prog.load_state_dict(sd)
    msg = str(info.value)
    assert "1 missing key(s) ['ln_f.weight']" in msg
    assert "1 unexpected key(s) ['bogus.weight']" in msg
    assert "strict=False" in msg
    for k, v in prog.state_dict().items():  # a refused load changes nothing
        assert torch.equal(v, before[k]), k

    result = prog.load_state_dict({"ln_f.bias": torch.full((16,), 0.5), "bogus.weight": torch.zeros(3)}, strict=False)
    assert result.unexpected_keys == ["bogus.weight"] and len(result.missing_keys) == len(before) - 1, result
    after = prog.state_dict()
    assert torch.equal(after["ln_f.bias"], torch.full((16,), 0.5))
    for k, v in after.items():
        if k != "ln_f.bias":
            assert torch.equal(v, before[k]), k


def test_calling_a_program_a_distributed_pipeline_cut_down_says_what_to_call():
    """Under torchrun a Pipeline keeps only its rank's stages (``keep_only``); ``prog(x)`` then raised a
    raw ``TypeError: 'NoneType' object is not callable``."""
    prog = pipesplit.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
                             torch.randn(2, 4), num_stages=2, progress=False)
    prog.keep_only({1})  # what rank 1 of a 2-rank Pipeline does
    with pytest.raises(pipesplit.PipesplitError, match=r"holds only stage\(s\) \[1\] of the program's 2.*pipe\(x\)"):
        prog(torch.randn(2, 4))
    prog.eval()
    with pytest.raises(pipesplit.PipesplitError, match="pipe.eval"):
        prog(torch.randn(2, 4))


# ------------------------------------------------------------ targets of a seq-first model


class SeqScore(nn.Module):
    """Seq-first: x is (T, B, F); one score per sequence, (B,)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))).mean(0)).squeeze(-1)


def _mse(out, t):
    return ((out - t) ** 2).mean()


def test_a_seq_first_models_batch_targets_are_cut_where_the_batch_is_or_refused():
    """(B,) labels have no dimension 1 (target_batch_dim follows batch_dim=1): handed whole to every
    microbatch they broadcast against a one-sequence output and trained wrong; now refused, and with
    target_batch_dim=0 the step equals gradient accumulation."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8, 8), torch.randn(8)
    model = SeqScore()
    ref = copy.deepcopy(model)
    prog = pipesplit.compile(model, (x[:, :1],), num_stages=2, batch_dim=1, split_points=["b"])
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=8, loss_fn=_mse)
    with pytest.raises(pipesplit.InputError, match=r"shape \(8,\): no dimension 1 \(target_batch_dim=1\)"):
        pipe.step(x, target=y)
    assert all(p.grad is None for p in pipe.parameters())
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=8, loss_fn=_mse, target_batch_dim=0)
    loss = pipe.step(x, target=y)
    want = sum(float(_loss_backward(ref, x[:, i:i + 1], y[i:i + 1], 8)) for i in range(8))
    assert_close(loss, torch.tensor(want), name="loss")
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.grad, grads[name].grad, name=f"gradient of {name}")


def _loss_backward(ref, x, y, m):
    loss = _mse(ref(x), y) / m
    loss.backward()
    return loss.detach()


def test_flattened_labels_of_a_seq_first_model_are_refused():
    """(T * B,) labels flattened from (T, B) are time-major: contiguous slices would mix samples."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, 8)
    prog = pipesplit.compile(SeqScore(), (x[:, :2],), num_stages=2, batch_dim=1, split_points=["b"])
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, target_batch_dim=0,
                              loss_fn=lambda out, t: _mse(out, t.view(6, -1).mean(0)))
    with pytest.raises(pipesplit.InputError, match=r"6 x the batch of 8.*target_batch_dim=1"):
        pipe.step(x, target=torch.randn(48))


def test_num_microbatches_is_fixed_once_the_pipeline_is_built():
    """Set after building, the schedule still ran 4 of 8 microbatches (loss half, gradients ~50% off)."""
    torch.manual_seed(0)
    prog = pipesplit.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), torch.randn(4, 8),
                             num_stages=2)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=_mse)
    with pytest.raises(pipesplit.PipesplitError, match="num_microbatches is fixed.*num_microbatches=8"):
        pipe.num_microbatches = 8
    assert pipe.num_microbatches == 4


@pytest.mark.parametrize("returned, says", [
    (lambda o, t: (((o - t) ** 2).mean(), {"mean": 0.0}), "a tuple of 2"),
    (lambda o, t: float(((o - t) ** 2).mean()), "a float"),
    (lambda o, t: (o - t) ** 2, r"a tensor of shape \(2, 8\)"),
])
def test_a_loss_fn_that_returns_no_scalar_loss_is_named(returned, says):
    """They raised Python's or autograd's own errors from inside the runtime."""
    prog = pipesplit.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), torch.randn(2, 8),
                             num_stages=2)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=returned)
    with pytest.raises(pipesplit.PipesplitError, match=f"loss_fn returned {says} for microbatch 0; it must return"):
        pipe.step(torch.randn(8, 8), target=torch.randn(8, 8))


class StatefulLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.rnn = nn.Linear(4, 8), nn.LSTM(8, 8, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.inp(x), (h0, c0))[0]  # h0, c0: (layers, batch, hidden)


def test_an_input_with_its_batch_in_another_dimension_is_named_as_such():
    """The only fix the error gave, unbatched=[...], is wrong for an RNN's (layers, batch, hidden) state."""
    torch.manual_seed(0)
    x, h0, c0 = torch.randn(8, 5, 4), torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    for unbatched, says in (((), r"batch of 8 appears elsewhere in 'h0' \(2, 8, 8\) \(dimension 1\?\)"),
                            (["h0", "c0"], "If it holds the batch .* batch_dim=0, so pass this input with its batch")):
        prog = pipesplit.compile(StatefulLSTM(), (x[:2], h0[:, :2], c0[:, :2]), num_stages=2, unbatched=unbatched)
        pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=lambda o, t: o.pow(2).mean())
        with pytest.raises(pipesplit.InputError, match=says):
            pipe.step(x, h0, c0)


def test_a_target_leaf_without_the_batch_goes_whole_and_one_with_it_is_refused():
    from pipesplit.runtime.engine.microbatch import split_target

    labels, weights = torch.randn(6, 8), torch.randn(6)  # seq-first (T, B) labels and (T,) per-step weights
    parts = split_target((labels, weights), 4, batch_dim=1, batch=8, input_batch_dim=1)
    assert [tuple(p[0].shape) for p in parts] == [(6, 2)] * 4 and all(p[1] is weights for p in parts)
    with pytest.raises(pipesplit.InputError, match=r"shape \(8,\): no dimension 1"):
        split_target(torch.randn(8), 4, batch_dim=1, batch=8, input_batch_dim=1)


def test_more_stages_than_blocks_are_warned_once_with_the_block_count(caplog):
    """Issue 36: 40 stages for a 12-block GPT compiled without a word (cuts inside attention, 51 send/recv edges)."""
    prog, warned = _gpt_warnings(3, caplog)  # 2 blocks
    notes = [n for n in prog.notes if "repeated blocks" in n]
    assert len(notes) == 1 and "num_stages=3 is more than the model's 2 repeated blocks (blocks.0 to blocks.1)" in \
        notes[0] and "Compile with num_stages=2 or fewer" in notes[0], prog.notes
    assert len(notes) == 1 and [w for w in warned if "repeated blocks" in w] == [f"pipesplit: {notes[0]}"], warned
    prog, warned = _gpt_warnings(2, caplog)
    assert not [n for n in prog.notes if "repeated blocks" in n] and not warned


def test_the_blocks_of_a_hugging_face_llama_are_its_decoder_layers():
    from pipesplit.passes.plan.advice import repeated_blocks
    from tests.zoo import hf_llama

    torch.manual_seed(0)
    prog = pipesplit.compile(hf_llama(), torch.randint(0, 128, (2, 16)), num_stages=4)
    notes = [n for n in prog.notes if "repeated blocks" in n]
    assert len(notes) == 1 and "3 repeated blocks (model.layers.0 to model.layers.2)" in notes[0], prog.notes


def test_the_cli_prints_a_plan_warning_once(capsys):
    """Logged (stderr) and printed by the report's notes: the CLI said each plan warning twice."""
    from pipesplit.cli import main

    assert main(["split", "pipesplit.models:gpt", "--kwarg", "layers=2", "--kwarg", "dim=32", "--input-shape",
                 "2x16:int64", "--stages", "3"]) == 0
    out, err = capsys.readouterr()
    assert (out + err).count("repeated blocks") == 1, out + err
