"""Activation checkpointing as a planner decision: which stages recompute their forward, chosen with the cuts.

A checkpointed stage keeps only its inputs and outputs for each microbatch in flight (plus one
microbatch's activations while it recomputes) and pays a second forward before each
backward. Under most schedules the stages hold different numbers of microbatches
(``1f1b``: stage ``s`` of ``p`` holds ``p - s``), so the stages that need it are the ones
holding the most. For a fixed split the best set is plain: checkpoint exactly the stages
that do not fit without it (checkpointing only adds time, and a stage's memory depends on
its own choice alone). With the cuts free, the search solves the chain once for each set
of the form "the ``j`` stages holding the most microbatches" (``j = 0 .. p``; for 1f1b the
first ``j`` stages), those stages' costs weighed with their recompute so they get less
work, then keeps for each split only the stages that need checkpointing, and takes the
lowest simulated step. Megatron's ``--recompute-num-layers`` and torchtitan's per-block AC
are the hand-set counterparts.
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

import numpy as np

from pipesplit.errors import PlanError
from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.partial_checkpoint import check_blocks_choice
from pipesplit.passes.plan.partition import StageLimits, checkpointed_memory_ends, stage_memory_limits

Checkpoint = Union[bool, str, Sequence[int], Mapping[int, int], None]
"""``compile(checkpoint=...)``: ``"auto"`` (the planner chooses), True (every stage), False or None
(no stage, unless ``MemoryModel(checkpoint=True)``), the indices of the stages to checkpoint, or
``{stage: n}``: those stages recompute their first ``n`` blocks (:mod:`pipesplit.passes.plan.partial_checkpoint`)."""


def check_checkpoint(value: Checkpoint) -> None:
    """Raise PlanError unless ``value`` is a checkpoint choice (before any capture)."""
    if value is None or isinstance(value, bool) or value == "auto":
        return
    if isinstance(value, Mapping):
        check_blocks_choice(value)
        return
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
        raise PlanError(f"checkpoint must be 'auto', True, False, a list of stage indices (e.g. [0, 1]) or a dict "
                        f"of stage -> how many of its first blocks recompute (e.g. {{0: 3}}), got {value!r}.")


def fixed_set(value: Checkpoint, num_stages: int, all_of_them: bool = False) -> frozenset[int] | None:
    """The stages ``value`` names, or None for ``"auto"`` (the planner chooses)."""
    if value == "auto":
        return None
    if value is True or (value is None and all_of_them):
        return frozenset(range(num_stages))
    if value is None or value is False:
        return frozenset()
    assert not isinstance(value, (bool, str))
    if isinstance(value, Mapping):  # the stages that recompute some blocks: solved as if checkpointed whole
        value = list(value)
    bad = sorted(s for s in value if not 0 <= s < num_stages)
    if bad:
        raise PlanError(f"checkpoint names stages {bad}; a plan of {num_stages} stages has stages 0..{num_stages - 1}.")
    return frozenset(value)


def candidate_sets(units: Sequence[float]) -> list[frozenset[int]]:
    """No stage, then the ``j`` stages holding the most microbatches (earlier first among equals), up to all."""
    order = sorted(range(len(units)), key=lambda s: (-units[s], s))
    return [frozenset(order[:j]) for j in range(len(units) + 1)]


def needed(memory_plain: Sequence[float], cap: int | None) -> frozenset[int]:
    """The stages over ``cap`` without checkpointing: for a fixed split the best set to checkpoint."""
    if cap is None:
        return frozenset()
    return frozenset(s for s, m in enumerate(memory_plain) if m > cap)


def recompute_scale(seconds: np.ndarray) -> float:
    """How much longer a stage's work is when it runs its forward twice (the whole model's ratio)."""
    f, i, w = seconds.sum(axis=0)
    total = f + i + w
    return float((total + f) / total) if total > 0 else 1.0


def checkpoint_limits(
    chain: Chain, cap: int | None, in_flight: Sequence[int], units: Sequence[float], ckpt: frozenset[int],
    start_lo: np.ndarray | None, start_hi: np.ndarray | None, scale: float,
) -> StageLimits:
    """Per-stage limits when the stages in ``ckpt`` are checkpointed: a plain stage holds all its
    activations x ``units[s]``; a checkpointed one its inputs x ``in_flight[s]`` plus one microbatch's
    activations, and its cost is weighed ``scale`` times (its second forward) against the others'."""
    k = len(in_flight)
    some = bool(ckpt) and len(ckpt) < k  # all or none: every stage alike, the balance needs no weights
    costs = tuple(scale if s in ckpt else 1.0 for s in range(k)) if some else None
    if cap is None:
        return StageLimits(None, start_lo, start_hi, None, costs)
    if not ckpt:
        return StageLimits(stage_memory_limits(chain, cap, units), start_lo, start_hi, None, costs)
    ends = checkpointed_memory_ends(chain, cap, in_flight)
    if len(ckpt) == k:
        return StageLimits(None, start_lo, start_hi, ends, costs)
    n = chain.n
    plain = stage_memory_limits(chain, cap, [units[s] for s in range(k) if s not in ckpt])
    free_lo, free_end = np.zeros(n + 1, dtype=np.int64), np.full(n + 1, n, dtype=np.int64)
    lows, it = [], iter(plain)
    for s in range(k):
        lows.append(free_lo if s in ckpt else next(it))
    return StageLimits(tuple(lows), start_lo, start_hi, tuple(ends[s] if s in ckpt else free_end for s in range(k)),
                       costs)


def describe(ckpt: Sequence[int], num_stages: int) -> str:
    """``"stages 0-2 of 8"``, ``"none of 8 stages"``: which stages a plan checkpoints, for reports."""
    if not ckpt:
        return f"none of {num_stages} stages"
    if len(ckpt) == num_stages:
        return f"all {num_stages} stages"
    runs: list[list[int]] = []
    for s in sorted(ckpt):
        if runs and runs[-1][-1] == s - 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"stage{'s' if len(ckpt) > 1 else ''} {text} of {num_stages}"
