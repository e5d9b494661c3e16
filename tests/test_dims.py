"""Dimensions besides the batch that change between calls (pipesplit.dims, passes/split/generalise.py):
declared up front with ``dynamic_dims=``, or captured dynamic the first time one changes; and the
refusal, naming the input, the dimension and the model's limit, of a size the model cannot take."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.dims import parse_dynamic_dims
from pipesplit.errors import CaptureError, InputError
from pipesplit.models import gpt
from tests.close import assert_close
from tests.test_generalise import _count_exports




@pytest.mark.parametrize("given,match", [
    ("idx", "takes a dict"),
    ({"idx": 0}, "the batch dimension"),
    ({"idx": -1}, "counted from 0"),
    ({"idx": {1: (0, 8)}}, "1 <= low <= high"),
    ({"idx": {1: (9, 8)}}, "1 <= low <= high"),
    ({"idx": {}}, "give a dimension"),
    ({3: 1}, "argument names"),
])
def test_dynamic_dims_is_checked_before_the_export(given, match):
    with pytest.raises(CaptureError, match=match):
        parse_dynamic_dims(given, batch_dim=0)
    with pytest.raises(CaptureError, match="unbatched= also names"):
        parse_dynamic_dims({"mask": 1}, batch_dim=0, unbatched=["mask"])


def test_a_declared_length_is_dynamic_from_the_start_and_never_captured_again(monkeypatch):
    calls = _count_exports(monkeypatch)
    torch.manual_seed(0)
    model = gpt(layers=2, dim=16, vocab=64, seq=64, heads=2)
    toks = torch.randint(0, 64, (4, 64))
    prog = pipesplit.compile(model, toks[:, :32], num_stages=2, dynamic_dims={"idx": {1: (1, 64)}}, progress=False)
    assert prog.inputs[0].shape == (None, None) and prog.plan.capture == "dynamic"
    for length in (32, 17, 64, 5):
        assert_close(prog(toks[:3, :length]), model(toks[:3, :length]), name=f"length {length}")
    assert len(calls) == 1, "declared dynamic: one export"
    with pytest.raises(InputError, match=r"input 'idx' has size 65 in dimension 1.*at most 64"):
        prog(torch.randint(0, 64, (2, 65)))
    with pytest.raises(CaptureError, match=r"unknown|does not pass"):
        pipesplit.compile(model, toks[:, :32], dynamic_dims={"tokens": 1}, progress=False)


def test_a_declared_range_past_a_position_table_is_refused_with_the_tables_size():
    model = gpt(layers=1, dim=16, vocab=64, seq=48, heads=2)
    with pytest.raises(CaptureError) as info:
        pipesplit.compile(model, torch.randint(0, 64, (2, 32)), dynamic_dims={"idx": {1: (1, 4096)}}, progress=False)
    msg = str(info.value)
    assert "input 'idx' dimension 1" in msg and "at most 48" in msg and "'pos.weight' is a table of 48 rows" in msg, msg


def test_a_length_past_the_position_table_is_refused_before_a_stage_runs():
    """torch.export bounds nothing here (an index out of range is a value); the table's rows do."""
    torch.manual_seed(0)
    model = gpt(layers=1, dim=16, vocab=64, seq=48, heads=2)
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 32)), num_stages=2, progress=False)
    prog(torch.randint(0, 64, (2, 20)))  # captured with every dimension dynamic
    assert prog.inputs[0].ranges[1][1] == 48
    with pytest.raises(InputError, match=r"'idx' has size 49 in dimension 1.*at most 48 there: 'pos.weight' is a table of 48"):
        prog(torch.randint(0, 64, (2, 49)))


class FixedLength(nn.Module):
    """Reshapes to a literal length: dimension 1 can only be 8."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).reshape(x.shape[0], 8 * 4))


def test_a_length_the_model_fixes_is_refused_naming_it(monkeypatch):
    torch.manual_seed(0)
    model = FixedLength()
    prog = pipesplit.compile(model, torch.randn(2, 8, 4), num_stages=2, progress=False)
    calls = _count_exports(monkeypatch)
    with pytest.raises(InputError, match=r"'x' has shape \(2, 6, 4\).*dimension 1 must be 8.*model fixes this dimension"):
        prog(torch.randn(2, 6, 4))
    x = torch.randn(5, 8, 4)
    assert_close(prog(x), model(x), name="another batch still runs")
    assert len(calls) == 1, "one capture with every dimension dynamic, not one per call"
    with pytest.raises(CaptureError, match=r"input 'x' dimension 1: the model fixes it at 8"):
        pipesplit.compile(model, torch.randn(2, 8, 4), dynamic_dims={"x": 1}, progress=False)


def test_an_image_size_changes_like_a_length():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    prog = pipesplit.compile(model, torch.randn(2, 3, 16, 16), num_stages=2, progress=False)
    for shape in ((2, 3, 16, 16), (3, 3, 24, 20), (2, 3, 9, 31)):
        x = torch.randn(shape)
        assert_close(prog(x), model(x), name=f"image {shape}")
    assert prog.inputs[0].shape == (None, 3, None, None)


def _packed(docs: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row per list of document lengths: token ids, per-document position ids, and a
    (1, T, T) mask causal within each document and blocking every other (0 or float32's minimum)."""
    ids, pos, masks = [], [], []
    for row in docs:
        p = torch.cat([torch.arange(n) for n in row])
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
        allowed = (doc[:, None] == doc[None, :]) & (torch.arange(length)[:, None] >= torch.arange(length)[None, :])
        ids.append(torch.randint(1, 64, (length,)))
        pos.append(p)
        masks.append(torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None])
    return torch.stack(ids), torch.stack(pos), torch.stack(masks)


def test_packed_sequences_train_as_separate_documents():
    """Hugging Face's packed form (per-document position ids, a block-causal 4D mask) through a split
    Llama: each document's logits are its own run's, a step equals accumulation, and the packed
    length may change between steps."""
    from tests.zoo import tiny_llama
    from tests.training import accumulate, dot_loss, make_target

    torch.manual_seed(0)
    model = tiny_llama()
    ids, pos, mask = _packed([[5, 11], [16], [3, 6, 7], [9, 7]], 16)
    kwargs = {"position_ids": pos, "attention_mask": mask}
    prog = pipesplit.compile(model, (ids,), example_kwargs=kwargs, num_stages=2, dynamic_dims=True, progress=False)
    logits = prog(ids, **kwargs).logits
    start = 0
    for n in (5, 11):  # row 0's documents, each alone
        alone = model(ids[:1, start:start + n], use_cache=False).logits
        assert_close(logits[:1, start:start + n], alone, name=f"document of {n} in a packed row")
        start += n
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=lambda o, t: dot_loss(o.logits, t),
                              loss_reduction="sum")
    for length, docs in ((16, [[5, 11], [16], [3, 6, 7], [9, 7]]), (10, [[10], [4, 6], [2, 8], [1, 9]])):
        ids, pos, mask = _packed(docs, length)
        kwargs = {"position_ids": pos, "attention_mask": mask}
        ref = copy.deepcopy(model)
        ref.load_state_dict(prog.state_dict())
        with torch.no_grad():
            target = make_target(ref(ids, **kwargs, use_cache=False).logits)
        want = accumulate(ref, (ids,), {**kwargs, "use_cache": False}, target, 2,
                          loss_fn=lambda o, t: dot_loss(o.logits, t))
        got = pipe.step(ids, target=target, **kwargs)
        assert_close(got, want, name=f"loss of packed rows of {length}")
        grads = dict(pipe.named_parameters())
        for name, p in ref.named_parameters():
            assert_close(grads[name].grad, p.grad, name=f"gradient of {name} (packed, {length})")
        pipe.zero_grad()
