"""Activation memory counts each storage once: a view (q, k, v split from one linear's output,
their transposes) or an in-place write allocates nothing new.

On an H100 the estimate for an 8x512 GPT (1f1b, m=4) was 1.9x the allocator's measured peak
(issue 24): summing every node's output counted each view again. Checked here against what
autograd saves for backward, measured with saved-tensor hooks (unique storages).
"""

from __future__ import annotations

import pytest
import torch

import pipesplit
from pipesplit.bench.predict import _stage_nodes
from pipesplit.meta import node_cost
from pipesplit.models import gpt


def _saved_bytes(module, *args, loss=None):
    saved, params = {}, {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(t):
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args)
        if loss is not None:
            loss(out)
    return sum(v for k, v in saved.items() if k not in params)


def test_a_gpts_activation_estimate_is_near_what_autograd_saves():
    torch.manual_seed(0)
    model = gpt(layers=4, dim=128, vocab=512, seq=64, heads=4)
    x, y = torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64))
    prog = pipesplit.compile(model, x, num_stages=1, progress=False)
    nodes = _stage_nodes(prog)[0]
    held = sum(node_cost(n).held_bytes for n in nodes)
    out = sum(node_cost(n).out_bytes for n in nodes)
    saved = _saved_bytes(prog.stages[0].module, x,
                         loss=lambda o: torch.nn.functional.cross_entropy(o[0].flatten(0, 1), y.flatten()))
    assert 0.9 * saved <= held <= 1.4 * saved, (held / saved, out / saved)
    assert out > 1.5 * saved, "the old sum counted views again"


def test_views_and_in_place_writes_hold_nothing_new():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.lin(x).split(8, dim=-1)  # three views of one output
            h = (q.transpose(0, 1) @ k).relu_()  # a new tensor, then written in place
            return h.sum() + v.narrow(-1, 0, 1).sum() + x.view(-1)[0]  # a view of the input holds nothing

    prog = pipesplit.compile(M(), torch.randn(4, 8), num_stages=1, progress=False)
    held = {n.target.__name__: node_cost(n).held_bytes for n in _stage_nodes(prog)[0] if callable(n.target)
            and hasattr(n.target, "__name__")}
    costs = {str(n.target): node_cost(n) for n in _stage_nodes(prog)[0]}
    assert any("linear" in k and c.held_bytes == c.out_bytes > 0 for k, c in costs.items())
    for name in ("split", "transpose", "relu_", "narrow", "view"):
        views = [c for k, c in costs.items() if name in k]
        assert views and all(c.held_bytes == 0 for c in views), (name, views, held)


def _measured_against_planned(schedule, checkpoint, microbatches=4, layers=4, dim=128, rows=4, stages=2, seq=64,
                              vocab=256, split_points=None):
    """Each stage's peak measured in a real Adam step (every storage its thread allocates, live until freed;
    parameters and Adam's state) over its planned peak (``plan.stage_memory_bytes``); ``split_points``: the
    stages cut there, not ``stages`` planned."""
    from pipesplit.bench.stage_memory import measure_pipeline

    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq, heads=4)
    x = torch.randint(0, vocab, (rows, seq))
    split = dict(num_stages=stages) if split_points is None else dict(split_points=split_points)
    prog = pipesplit.compile(model, x, schedule=schedule, num_microbatches=microbatches, checkpoint=checkpoint,
                             progress=False, **split)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=microbatches,
                              loss_fn=lambda o, y: torch.nn.functional.cross_entropy(o.flatten(0, 1), y.flatten()))
    optimizer = torch.optim.Adam(pipe.parameters())

    def batch(i):
        g = torch.Generator().manual_seed(i)
        return (torch.randint(0, vocab, (rows * microbatches, seq), generator=g),), torch.randint(
            0, vocab, (rows * microbatches, seq), generator=g)

    got = measure_pipeline(pipe, batch, optimizer=optimizer, memory_steps=1, timed_steps=0)
    return prog.plan, [m / p for p, m in zip(prog.plan.stage_memory_bytes, got.peak)]


# The planner's figure predicts a step's peak per stage (every storage its thread allocates, live until
# freed; parameters, buffers and Adam's state), from above: measured / predicted within this band
# (0.83-0.94 here; under torchrun the same figure holds 0.77-0.98, tests/memory_check.py).
BAND = (0.8, 1.0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1"])
def test_planned_stage_memory_is_within_the_band_of_a_measured_step(schedule):
    """Plain stages: each storage once, a quarter microbatch for a running backward, what a split backward
    keeps from I to W, the inputs of each microbatch in flight and one receive posted ahead (1f1b 0.86-0.90,
    gpipe 0.83, zb_h1 0.87-0.92). The former budget counted every output (views too) and a whole
    microbatch more: a step measured 0.46-0.48 of it."""
    plan, ratios = _measured_against_planned(schedule, False)
    assert plan.checkpoint == []
    assert all(BAND[0] <= r <= BAND[1] for r in ratios), ratios


def test_a_checkpointed_stages_planned_memory_is_within_the_band():
    """A checkpointed stage holds its inputs and outputs per microbatch in flight, one microbatch's activations
    while it recomputes and its backward's working set (0.83-0.89)."""
    plan, ratios = _measured_against_planned("1f1b", True)
    assert plan.checkpoint == [0, 1]
    assert all(BAND[0] <= r <= BAND[1] for r in ratios), ratios


def test_a_checkpointed_stage_holding_every_microbatch_keeps_their_outputs_too():
    """Under gpipe a checkpointed stage holds all its microbatches, and the runtime keeps each one's
    outputs until its backward (the backward starts from them): counted with the inputs only, a GPT's
    checkpointed stages were predicted under their measured peak (0.83x and 0.75x)."""
    plan, ratios = _measured_against_planned("gpipe", True, microbatches=8, layers=2, dim=128, rows=8)
    assert plan.checkpoint == [0, 1]
    assert all(BAND[0] <= r <= BAND[1] for r in ratios), ratios


def test_a_checkpointed_stage_next_to_a_plain_one_under_zero_bubble_lets_its_recompute_go():
    """Under zb_h1 a checkpointed stage's I kept the recomputed graph for its W, and it stayed until the step
    ended: the bench's GPT (8 x 256, sequence 128, 4 stages, checkpoint [0, 1]) measured stage 1 at 1.24x
    its figure (89 MiB, 58 predicted by the former model). Its whole backward now runs in I: 0.94."""
    plan, ratios = _measured_against_planned("zb_h1", [0, 1], microbatches=8, layers=8, dim=256, stages=4, seq=128)
    assert plan.checkpoint == [0, 1]
    assert all(BAND[0] <= r <= BAND[1] for r in ratios), ratios


def test_a_stage_recomputing_its_first_blocks_is_within_the_band():
    """``checkpoint={0: 1}``: stage 0 recomputes its first block, and holds its inputs per microbatch in flight,
    the rest's activations per unit and the first block's for one microbatch (the figure of
    ``partial_checkpoint.head_bytes``, one formula with the others: ``passes/plan/stage_bytes.py``)."""
    plan, ratios = _measured_against_planned("1f1b", {0: 1})
    assert plan.checkpoint_partial and 0 in plan.checkpoint_partial
    assert all(BAND[0] <= r <= BAND[1] for r in ratios), ratios


def test_a_stage_recomputing_its_first_blocks_under_zero_bubble_holds_microbatches_until_its_i():
    """Under zb_h1 a stage recomputing its head runs its whole backward in I, so it holds a microbatch from
    its forward until its I (stage 1 of 4: 3 microbatches), not until its W (4): counted until W, the
    bench's GPT (8 x 256, sequence 128, 4 stages, ``{0: 1, 1: 1}``) measured stage 1 at 0.79 of its figure
    (74 of 94 MiB); 0.95 now (``objective.split_stages`` gives each split stage's count until I)."""
    plan, ratios = _measured_against_planned("zb_h1", {0: 1, 1: 1}, microbatches=8, layers=8, dim=256, stages=4,
                                             seq=128)
    assert set(plan.checkpoint_partial) == {0, 1}
    assert all(BAND[0] <= r <= BAND[1] for r in ratios), ratios


# A GPT whose logits dominate its last stage and whose 4096-word embedding (tied to its head) dominates its first
_LOGITS_DOMINATE = dict(microbatches=8, layers=8, dim=32, seq=32, vocab=4096,
                        split_points=["blocks.2", "blocks.4", "blocks.6"])


def test_a_last_stage_recomputing_its_head_under_zero_bubble_lets_its_microbatch_go_at_i():
    """Its whole backward runs in I, so nothing is left for W: the runtime let go of the microbatch's input
    leaves, logits and their gradients only at W, and the figure (counting until I) was 1.7x under the
    measured step (a GPT of width 32, vocabulary 4096, zb_h1, ``{3: 1}``: 9.0 MB against 5.25); let go at I,
    with the loss's gradients of the logits counted, under it."""
    plan, ratios = _measured_against_planned("zb_h1", {3: 1}, **_LOGITS_DOMINATE, rows=2)
    assert list(plan.checkpoint_partial) == [3]
    # stage 3's, from above; 0.75 of it in one process, whose stage 3 reads stage 0's tied embedding (its
    # weight and Adam's two moments, 1.5 of the figure's 6.4 MB) where a rank of its own holds a copy (under
    # torchrun 0.94: tests/memory_check.py measures such a GPT in test_distributed.py)
    assert 0.7 <= ratios[3] <= BAND[1]
    # stage 0 (an embedding of 4096 x 32 and little else) measured 1.05 of its figure under zb_h1 while the
    # weight gradient a backward makes before adding it into .grad left the tied embedding out
    assert ratios[0] <= 1.0


def test_the_last_stage_lets_its_logits_go_once_its_loss_has_what_it_needs():
    """The last stage's backward starts from its loss, whose graph keeps what it needs of the logits (cross
    entropy: its log-softmax); the runtime also kept every microbatch's logits until its backward, 8 of them
    under gpipe: a GPT whose logits dominate (width 32, vocabulary 4096) measured 41.1 MB against a 27.7 MB
    figure that counts the loss's keep; 25.1 MB now."""
    _, ratios = _measured_against_planned("gpipe", None, **_LOGITS_DOMINATE, rows=4)
    assert BAND[0] <= ratios[3] <= BAND[1]
