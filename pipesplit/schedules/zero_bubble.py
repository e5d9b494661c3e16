"""Zero-bubble schedules (Qi et al. 2023): backward split into input-grad I and weight-grad W."""

from __future__ import annotations

from collections import deque

from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.registry import register_schedule
from pipesplit.schedules.schedule import Schedule

F, I, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # noqa: E741


@register_schedule("zb_h1")
def zb_h1(num_stages: int, num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split, rank r deferring r weight-gradient passes.

    Forwards and input-gradients follow 1F1B (so the input-gradient critical path is as
    short as possible); rank r starts emitting W only after its r-th I and flushes the
    deferred W passes at the end, filling the cool-down bubble. With F = I = W the bubble
    per rank is (p-1)F instead of 1F1B's 3(p-1)F, and no rank holds more than p
    microbatches' activations (1F1B's peak, reached on rank 0).
    """
    per_rank = []
    m = num_microbatches
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, m)
        actions = [Action(r, F, k) for k in range(warmup)]
        pending: deque[int] = deque()
        for k in range(m):
            if warmup + k < m:
                actions.append(Action(r, F, warmup + k))
            actions.append(Action(r, I, k))
            pending.append(k)
            if k >= r:
                actions.append(Action(r, W, pending.popleft()))
        actions += [Action(r, W, k) for k in pending]
        per_rank.append(actions)
    return Schedule("zb_h1", num_stages, num_ranks, m, tuple(range(num_stages)), tuple(map(tuple, per_rank)))


def v_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """V shape over 2p stages: rank r holds stage r and stage 2p-1-r."""
    down = list(range(num_ranks))
    return tuple(down + down[::-1])


class _Chunks:
    """Emits a rank's actions for its two V chunks, counting each chunk's F, I and W."""

    def __init__(self, stages: tuple[int, int], num_virtual: int) -> None:
        self.stages = stages
        self.num_virtual = num_virtual
        self.count = {(c, k): 0 for c in (0, 1) for k in (F, I, W)}
        self.actions: list[Action] = []

    def emit(self, code: str) -> None:
        """Emit e.g. ``"F0"``: the next forward of chunk 0."""
        kind, chunk = ActionKind(code[0]), int(code[1])
        microbatch = self.count[chunk, kind]
        self.count[chunk, kind] += 1
        self.actions.append(Action(self.stages[chunk], kind, microbatch))

    def run(self, *codes: str, times: int = 1) -> None:
        for _ in range(times):
            for code in codes:
                self.emit(code)

    def left(self, chunk: int, kind: ActionKind) -> int:
        return self.num_virtual - self.count[chunk, kind]


@register_schedule("zb_v", stages_per_rank=2)
def zb_v(num_stages: int, num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V: two stages per rank in a V (rank r holds stages r and 2p-1-r), near-zero bubble.

    Chunk 0 (stage r) warms up deepest on rank 0; chunk 1 (stage 2p-1-r) turns each
    forward straight into I and W on the way back up. The steady state interleaves
    ``F0 I0 W0 F1 I1 W1``; the cool-down runs the remaining input-gradients before the
    weight-gradients. The pattern needs at least 2p-1 microbatches to fill the V, so it
    is built for ``max(m, 2p-1)`` virtual microbatches and the extra ones are dropped,
    which keeps the order (and its freedom from deadlock) for the real ones.
    """
    p, m = num_ranks, num_microbatches
    num_virtual = max(m, 2 * p - 1)
    per_rank = []
    for r in range(p):
        rank = _Chunks((r, 2 * p - 1 - r), num_virtual)
        rank.run("F0", times=2 * (p - r) - 1)
        rank.run("F1", "F0", times=r)
        rank.run("F1", "I1", "W1", times=p - r)
        while rank.left(1, F) > 0:
            if rank.left(0, F) > 0:
                rank.emit("F0")
            rank.run("I0", "W0", "F1", "I1", "W1")
        rank.run("I0", "I1", times=r)
        rank.run("I0", "W0", times=p - r)
        rank.run("W1", times=rank.left(1, W))
        rank.run("W0", times=rank.left(0, W))
        per_rank.append([a for a in rank.actions if a.microbatch < m])
    return Schedule("zb_v", num_stages, p, m, v_stage_to_rank(p), tuple(map(tuple, per_rank)))
