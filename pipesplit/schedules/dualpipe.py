"""DualPipeV (DeepSeek-V3's DualPipe cut in half): a V of two chunks per rank, F&B pairs overlapped."""

from __future__ import annotations

from collections import deque

from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.registry import register_schedule
from pipesplit.schedules.schedule import Schedule
from pipesplit.schedules.zero_bubble import v_stage_to_rank

F, B, I, W = (ActionKind.FORWARD, ActionKind.FULL_BACKWARD,  # noqa: E741
              ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


class _VRank:
    """One rank's list for its two chunks, each pass taking the chunk's next microbatch.

    Chunk 0 is stage r (the V going down), chunk 1 stage 2p-1-r (coming back up). A
    backward is full (B) or split (I now, W later); split ones queue their W, oldest first.
    """

    def __init__(self, stages: tuple[int, int]) -> None:
        self.stages = stages
        self.next = {(chunk, kind): 0 for chunk in (0, 1) for kind in (F, B)}
        self.weights: deque[Action] = deque()
        self.actions: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []

    def _take(self, chunk: int, kind: ActionKind) -> Action:
        slot = (chunk, F if kind is F else B)  # B and I share the chunk's backward count
        action = Action(self.stages[chunk], kind, self.next[slot])
        self.next[slot] += 1
        if kind is I:
            self.weights.append(Action(action.stage, W, action.microbatch))
        self.actions.append(action)
        return action

    def forward(self, chunk: int) -> None:
        self._take(chunk, F)

    def backward(self, chunk: int, split: bool = False) -> None:
        self._take(chunk, I if split else B)

    def weight(self) -> None:
        """The oldest deferred weight-gradient pass, if any."""
        if self.weights:
            self.actions.append(self.weights.popleft())

    def overlapped(self, forward_chunk: int) -> None:
        """A forward of ``forward_chunk`` overlapped with a full backward of the other chunk."""
        f = self._take(forward_chunk, F)
        self.pairs.append((f, self._take(1 - forward_chunk, B)))


def dualpipe_v_rank(p: int, m: int, r: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
    """Rank ``r``'s actions and overlapped pairs in DualPipeV for ``p`` ranks, ``m`` >= 2p microbatches."""
    rank = _VRank((r, 2 * p - 1 - r))
    below = p - 1 - r  # ranks after this one on the way down
    for _ in range(2 * below):  # 1. fill the V's first leg
        rank.forward(0)
    for _ in range(r + 1):  # 2. both chunks forward
        rank.forward(0)
        rank.forward(1)
    for _ in range(below):  # 3. zero-bubble warm-up: chunk 1 turns forwards into I + W
        rank.backward(1, split=True)
        rank.weight()
        rank.forward(1)
    for i in range(m - 2 * p + r + 1):  # 4. steady state: F0&B1, F1&B0
        if i == 0 and r == p - 1:  # the V's tip: running them apart shortens the bubble
            rank.forward(0)
            rank.backward(1)
        else:
            rank.overlapped(0)
        rank.overlapped(1)
    for _ in range(below):  # 5. chunk 0 has no forwards left
        rank.backward(1)
        rank.overlapped(1)
    for k in range(2 * (r + 1)):  # 6. drain B1, B0 alternately; the second half split
        rank.backward(1 - k % 2, split=k >= r + 1)
    for _ in range(below):  # 7. chunk 0's last input-gradients, each after a deferred W
        rank.weight()
        rank.backward(0, split=True)
    while rank.weights:  # 8. the remaining weight-gradients
        rank.weight()
    return rank.actions, rank.pairs


@register_schedule("dualpipe_v", stages_per_rank=2, microbatches_at_least_stages=True)
def dualpipe_v(num_stages: int, num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek 2024): a V of two stages per rank, F&B pairs overlapped; m >= num_stages.

    Rank r holds stages r and 2p-1-r. After warming up both chunks (chunk 1 already
    splitting its backward into I and W), the steady state runs a forward of one chunk
    paired with a full backward of the other (``F0&B1``, ``F1&B0``); the pairs are in
    :attr:`Schedule.overlap`, so a runtime that overlaps them (or ``simulate(...,
    overlap=1)``) hides one chunk's work behind the other's. The drain splits the last
    backwards into I, with their W passes deferred into the tail. pipesplit's executors
    run each pair forward first, then backward. The order matches torch 2.13's
    ``ScheduleDualPipeV`` action for action.
    """
    per_rank, pairs = [], []
    for r in range(num_ranks):
        actions, overlapped = dualpipe_v_rank(num_ranks, num_microbatches, r)
        per_rank.append(actions)
        pairs += overlapped
    return Schedule("dualpipe_v", num_stages, num_ranks, num_microbatches, v_stage_to_rank(num_ranks), tuple(map(tuple, per_rank)), tuple(pairs))
