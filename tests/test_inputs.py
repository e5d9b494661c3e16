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
