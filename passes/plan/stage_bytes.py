"""The bytes one stage holds at its peak under a schedule: one formula for the planner's figures
(:func:`pipesplit.passes.plan.step_planner.figures_for`) and the partial-checkpointing search
(:func:`pipesplit.passes.plan.partial_checkpoint.head_bytes`).

What the figure predicts is a step under torchrun, one rank per stage, which also bounds the same
step in one process (measured on a GPT, ``benchmarks/bench_memory.py --torchrun``). Besides what
:class:`~pipesplit.passes.plan.objective.MemoryModel` counts of the stage's own nodes, a stage holds
the values it receives: each microbatch's inputs until its backward (the leaves its input
gradients are taken at), and one receive posted ahead of the action that takes it (an input, or
its outputs' gradient: ``pipesplit.schedules.issue.LOOKAHEAD`` = 1 action), the larger of the two;
the last stage, what the loss keeps per microbatch (taken as the outputs' size: cross entropy's
log-softmax), and at the start of its backward the loss's two gradients of that size (of the
log-softmax, then of the outputs) where they exceed the working set its backward counts later (the
larger of the two moments, not their sum: a GPT whose logits are small measured 0.84 of the sum, one
whose logits dominate 1.08 of the working set alone), but not the logits themselves once its loss
has what it needs of them (the runtime lets them go after the forward); and a backward's weight
gradient before it is added into the parameter's ``.grad`` (the largest node's parameters, a tied
weight's among them).
What it sends is let go of once its receiver has it (:mod:`pipesplit.schedules.releases`).

A backward's working set is a quarter of a microbatch's activations, and at least the gradient of the
stage's largest activation (one block of width 64, whose 4x-wide hidden is 40% of its activations,
measured 1.068 of the figure under torchrun that counted the quarter only; 1.00 now). Known not to hold
from above by a hair there: such a stage also holds the input gradient it last sent until its receiver
has it, which is not counted (a stage of two blocks or more covers it with its quarter). Loose where the
loss keeps less than cross entropy (a regression's mean squared error: 0.61-0.66 of the figure).
"""

from __future__ import annotations

import numpy as np

from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.objective import BACKWARD_WORKING_SET, MemoryModel


def stage_bytes(
    chain: Chain, memory: MemoryModel, state: float, a: int, b: int, in_flight: int, units: float | None, *,
    checkpointed: bool = False, head: int | None = None, act_sum: np.ndarray | None = None, split: int | None = None,
) -> float:
    """Bytes stage ``[a, b)`` of ``chain`` holds at its peak: its training ``state``, and its activations
    for the microbatches in flight (``in_flight``; ``units``: :func:`activation_units_per_stage`), all
    of them recomputed (``checkpointed``) or its head ``[a, head)`` only. ``act_sum``: the chain's
    activations summed up to each position (computed when not given). ``split``: where the schedule
    splits this stage's backward into I and W, the most microbatches it holds from a forward until its I
    (:func:`~pipesplit.passes.plan.objective.split_stages`); a stage that recomputes (all of it, or its
    head) then runs its whole backward in I and lets the microbatch go there, so it holds that many, and
    none waits for its W: its units are at most those and one backward's working set."""
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    if act_sum is None:
        act_sum = np.concatenate([[0], np.cumsum(act)])
    if split is not None and (head is not None or checkpointed):  # its whole backward in I: nothing waits for W
        in_flight = min(in_flight, split)
        units = None if units is None else min(units, in_flight + BACKWARD_WORKING_SET)
    inputs = float(chain.cut_bytes[a]) if a > 0 else 0.0
    last = b >= chain.n
    outputs = float(chain.output_bytes if last else chain.cut_bytes[b])
    ahead = max(inputs, outputs) if not last else inputs  # the last stage receives no gradient
    # a backward's weight gradient, made before it is added into .grad: the largest node's parameters, a
    # parameter several nodes read (a tied embedding) among them (left out, a GPT of width 32 whose 4096-word
    # embedding is tied to its head measured its first stage at 1.05 of the figure under zb_h1)
    ahead += max(float((chain.mem[a:b] - act[a:b]).max(initial=0)),
                 float(max(chain.shared_in(a, b), default=0))) / memory.state_factor
    # what the program returns and nothing saves (a head's logits): the last stage's backward starts from its loss,
    # whose graph keeps what it needs of it, so the runtime lets it go after the forward (and a recompute, which
    # stops once it has made what the backward reads, does not make it again); but a backward split into I and W
    # keeps the weight ops' outputs, a head's logits among them, until W (a GPT whose logits dominate, zb_h1:
    # 1.64 of the figure that left them out)
    whole_split = split is not None and head is None and not checkpointed
    returned = chain.returned if last and chain.returned is not None and not whole_split else None

    def kept(lo: int, hi: int) -> np.ndarray:
        """The activations of ``[lo, hi)`` a microbatch holds: less what the last stage lets go after its forward."""
        return act[lo:hi] if returned is None else act[lo:hi] - returned[lo:hi]

    def at_least(lo: int, hi: int, region: float) -> float:
        """What a backward's working set over ``region`` bytes of ``[lo, hi)`` has beyond its quarter: the gradient
        of the largest activation, made while it is still held (one block of width 64, its 4x-wide hidden 40% of
        its activations, measured 1.07 of the figure that counted the quarter only)."""
        return max(0.0, float(kept(lo, hi).max(initial=0)) - BACKWARD_WORKING_SET * region)

    made = float(act_sum[b] - act_sum[a]) - (0.0 if returned is None else float(returned[a:b].sum()))

    if head is not None and not checkpointed:
        tail = float(kept(head, b).sum()) + float(chain.cut_bytes[head])
        floor = at_least(head, b, tail)
        held = memory.partial_bytes(state, float(act_sum[head] - act_sum[a]), tail, inputs, in_flight, units) + floor
        running = BACKWARD_WORKING_SET * tail + floor + float(act_sum[head] - act_sum[a])
    elif checkpointed:  # it keeps its outputs of each microbatch in flight too (its backward starts from their
        # gradients); the last stage, what its loss keeps of them (below)
        floor = at_least(a, b, made)
        held = memory.held_bytes(state, made, inputs + (0.0 if last else outputs), in_flight, units,
                                 checkpointed=True) + floor
        running = made * (1 + BACKWARD_WORKING_SET) + floor
    else:
        floor = at_least(a, b, made) if units is not None else 0.0
        held = memory.held_bytes(state, made, 0.0, in_flight, units, checkpointed=False) + inputs * in_flight + floor
        running = BACKWARD_WORKING_SET * made + floor if units is not None else 0.0
    if last:
        held += outputs * in_flight + max(0.0, 2 * outputs - running)
    return held + ahead
