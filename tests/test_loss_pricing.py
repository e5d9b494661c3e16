"""The loss is priced on the stage that makes the model's outputs: a loss function reads every
output element forward and backward (a 32k-vocabulary cross-entropy is not free).

Issue 24: on an H100, 4 stages of a GPT with an 8192-word vocabulary ran the last stage's
backward at twice the others'; the plan had not counted what the loss costs there. On this CPU
a cross-entropy over 4M logits took 3.3 ms forward and 12.7 backward; priced 2.3 and 9.5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pipesplit
from pipesplit.bench.predict import _stage_nodes
from pipesplit.meta import node_cost, set_node_cost
from pipesplit.models import gpt
from pipesplit.passes.annotate.rates import DeviceRates, priced

RATES = DeviceRates("cpu", forward_op_s=1e-5, backward_op_s=2e-5, flops_per_s=5e10, bytes_per_s=2e10,
                    activation_s=(1e-9, 3e-9), norm_s=(1e-9, 2e-9))


def _gpt(vocab=4096):
    torch.manual_seed(0)
    return gpt(layers=4, dim=32, vocab=vocab, seq=32, heads=2), torch.randint(0, vocab, (2, 32))


def test_only_the_nodes_making_outputs_carry_the_loss():
    model, x = _gpt()
    prog = pipesplit.compile(model, x, num_stages=1, progress=False)
    marked = [(n.name, node_cost(n).loss_elements) for n in _stage_nodes(prog)[0] if node_cost(n).loss_elements]
    assert len(marked) == 1 and marked[0][1] == 2 * 32 * 4096, marked
    (head,) = [n for n in _stage_nodes(prog)[0] if node_cost(n).loss_elements]
    without = dataclasses.replace(node_cost(head), loss_elements=0)
    f, i, w = priced(head, RATES)
    set_node_cost(head, without)  # the same op, no loss behind it
    try:
        f0, i0, w0 = priced(head, RATES)
    finally:
        set_node_cost(head, dataclasses.replace(without, loss_elements=2 * 32 * 4096))
    assert f - f0 == pytest.approx(2 * 32 * 4096 * 1e-9) and i - i0 == pytest.approx(2 * 32 * 4096 * 3e-9)
    assert w == w0


def test_the_planner_gives_the_stage_with_the_loss_less_of_the_rest(monkeypatch):
    """At 2 stages, priced with the loss the cut moves earlier: the last stage, which runs the head
    and the loss, keeps fewer blocks than it does when the loss is left out."""
    import pipesplit.passes.plan.planner as planner

    monkeypatch.setattr(planner, "device_rates", lambda device, largest=None: RATES)
    model, x = _gpt(vocab=8192)
    plan = dict(num_stages=2, schedule="1f1b", num_microbatches=4, progress=False)  # the rate-priced planner
    with_loss = pipesplit.compile(model, x, **plan)
    import pipesplit.passes.annotate.costs as costs

    monkeypatch.setattr(costs, "_mark_loss_inputs", lambda gm: None)
    without = pipesplit.compile(model, x, **plan)
    first = [len(_stage_nodes(p)[0]) for p in (with_loss, without)]
    assert first[0] > first[1], f"stage 0 holds {first[0]} nodes with the loss priced, {first[1]} without"
