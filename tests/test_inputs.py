"""Inputs the model looks rows up in are tables, never cut into microbatches (pipesplit.capture, microbatch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipesplit
from tests.test_semantics import Lookup
from tests.training import dot_loss


class EmbeddingTable(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, idx, table):
        return self.b(torch.tanh(self.a(F.embedding(idx, table))))


class SelectRows(EmbeddingTable):
    def forward(self, idx, table):
        return self.b(torch.tanh(self.a(table.index_select(0, idx))))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("model_cls", [Lookup, EmbeddingTable, SelectRows])
@pytest.mark.parametrize("ids", ["any row", "rows below a microbatch"])  # an IndexError, or silently wrong rows
def test_a_table_the_size_of_the_batch_is_refused_when_cut_naming_it_and_unbatched(model_cls, dynamic, ids):
    """Issue 22 #16: a (V, d) table with V == the batch size, compiled without unbatched=."""
    torch.manual_seed(0)
    model, table = model_cls(), torch.randn(8, 8)
    prog = pipesplit.compile(model, (torch.randint(0, 8, (8,)), table), num_stages=2, dynamic_batch=dynamic,
                             progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    idx = torch.randint(0, 8 if ids == "any row" else 2, (8,))
    with pytest.raises(pipesplit.InputError, match=r"input 'table' \(8, 8\).*values of input 'idx'.*"
                                                   r"unbatched=\['table'\]"):
        pipe.step(idx, table, target=torch.randn(8, 8))
    assert all(p.grad is None for p in pipe.parameters()), "nothing ran"
    assert prog.inputs[1].indexed_by == "idx"
    assert any("unbatched=['table']" in note for note in prog.notes), "said at compile too"
    torch.testing.assert_close(prog(idx, table), model(idx, table))  # uncut, it is the model


def test_a_table_marked_unbatched_and_batched_indexing_inputs_are_not_refused():
    torch.manual_seed(0)
    prog = pipesplit.compile(Lookup(), (torch.randint(0, 8, (8,)), torch.randn(8, 8)), num_stages=2,
                             unbatched=["table"], progress=False)
    assert [i.indexed_by for i in prog.inputs] == [None, None]
    pos = pipesplit.compile(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8), progress=False)
    assert pos.inputs[0].indexed_by is None


class LastToken(nn.Module):
    """Pools each sample's last valid position: ``x[arange(B), lengths - 1]`` indexes ``x`` by another
    input's values, but per sample (the rows follow the batch), so cutting both is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, lengths: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(lengths.shape[0], device=x.device)
        return self.b(self.a(x[rows, lengths - 1]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_per_sample_indexing_by_another_input_is_not_taken_for_a_table(dynamic):
    """A review of the lookup-table refusal: following sizes (sym_size -> arange) as well as values took
    per-sample pooling for a table lookup and refused it; the advice (unbatched=['x']) gave wrong rows."""
    from tests.training import check_training

    torch.manual_seed(0)
    model = LastToken()
    lengths, x = torch.randint(1, 6, (8,)), torch.randn(8, 6, 8)
    prog = pipesplit.compile(model, (lengths, x), num_stages=2, dynamic_batch=dynamic, progress=False)
    assert all(i.indexed_by is None for i in prog.inputs), [(i.name, i.indexed_by) for i in prog.inputs]
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((lengths, x), {})], m=4)


class Keywords(nn.Module):
    """Keyword inputs read differently, as a Hugging Face model reads ``labels`` and ``attention_mask``."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, labels=None, attention_mask=None, extra=None):
        h = self.b(torch.tanh(self.a(x * attention_mask)))
        return h, ((h - labels) ** 2).mean(-1) + (extra["w"] * extra["v"]).sum(-1)


def test_keyword_inputs_in_another_order_than_the_example_are_matched_by_name():
    """Issue 33 defect 3: ``prog(x, attention_mask=m, labels=y)`` after an example with ``labels`` first was
    refused asking for "the same keyword names"; a dict input with its keys in another order too. Any
    order now gives the model's result through ``prog``, ``pipe`` and ``pipe.step``."""
    import copy

    from tests.close import assert_close, assert_grads_close, assert_tree_close
    from tests.training import accumulate_tree, make_target

    torch.manual_seed(0)
    model = Keywords()
    ref = copy.deepcopy(model)

    def call(b: int) -> dict:
        return {"labels": torch.randn(b, 8), "attention_mask": torch.rand(b, 8),
                "extra": {"w": torch.randn(b, 1), "v": torch.randn(b, 8)}}

    prog = pipesplit.compile(model, torch.randn(4, 8), example_kwargs=call(4), num_stages=2, progress=False)
    x, kw = torch.randn(8, 8), call(8)
    shuffled = {"extra": {"v": kw["extra"]["v"], "w": kw["extra"]["w"]}, "attention_mask": kw["attention_mask"],
                "labels": kw["labels"]}
    assert_tree_close(prog(x, **shuffled), model(x, **kw))
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum")
    assert_tree_close(pipe(x, **shuffled), model(x, **kw))
    with torch.no_grad():
        target = make_target(ref(x, **kw))
    assert_close(pipe.step(x, target=target, **shuffled), accumulate_tree(ref, (x,), kw, target, 2))
    assert_grads_close(pipe.named_parameters(), ref)
    with pytest.raises(pipesplit.InputError, match="another structure"):  # a missing name is still refused
        prog(x, labels=kw["labels"], attention_mask=kw["attention_mask"], extra={"w": kw["extra"]["w"]})
