"""Built-in schedules with a full backward: GPipe, 1F1B, interleaved 1F1B, looped BFS."""

from __future__ import annotations

from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.registry import register_schedule
from pipesplit.schedules.schedule import Schedule


def fwd(stage: int, microbatch: int) -> Action:
    return Action(stage, ActionKind.FORWARD, microbatch)


def bwd(stage: int, microbatch: int) -> Action:
    return Action(stage, ActionKind.FULL_BACKWARD, microbatch)


def looped_stage_to_rank(num_stages: int, num_ranks: int) -> tuple[int, ...]:
    """Stage s on rank s % num_ranks: each rank holds every num_ranks-th stage."""
    return tuple(s % num_ranks for s in range(num_stages))


@register_schedule("gpipe")
def gpipe(num_stages: int, num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward.

    Rank r holds stage r and keeps all m microbatches' activations alive.
    """
    mbs = range(num_microbatches)
    per_rank = [[fwd(r, m) for m in mbs] + [bwd(r, m) for m in mbs] for r in range(num_ranks)]
    return Schedule("gpipe", num_stages, num_ranks, num_microbatches, tuple(range(num_stages)), tuple(map(tuple, per_rank)))


@register_schedule("1f1b")
def one_f_one_b(num_stages: int, num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm up with forwards, then alternate one forward, one backward.

    Rank r runs p-1-r warm-up forwards, so it holds at most p-r microbatches' activations.
    """
    per_rank = []
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, num_microbatches)
        actions = [fwd(r, m) for m in range(warmup)]
        for k in range(num_microbatches - warmup):
            actions += [fwd(r, warmup + k), bwd(r, k)]
        actions += [bwd(r, m) for m in range(num_microbatches - warmup, num_microbatches)]
        per_rank.append(actions)
    return Schedule("1f1b", num_stages, num_ranks, num_microbatches, tuple(range(num_stages)), tuple(map(tuple, per_rank)))


@register_schedule("interleaved_1f1b", stages_per_rank=None, microbatches_multiple_of_ranks=True)
def interleaved_1f1b(num_stages: int, num_ranks: int, num_microbatches: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v = num_stages / num_ranks chunks per rank.

    Stage s lives on rank s % p. Microbatches go in groups of p: a rank runs the group's
    forwards on chunk 0, then chunk 1, ... (backwards on the last chunk first). Rank r
    warms up with 2(p-1-r) + (v-1)p forwards, then alternates forward and backward.
    """
    p, v, m = num_ranks, num_stages // num_ranks, num_microbatches

    def slot(r: int, i: int, backward: bool) -> Action:
        group, within = divmod(i, p * v)
        chunk = within // p
        stage = (v - 1 - chunk if backward else chunk) * p + r
        microbatch = group * p + within % p
        return bwd(stage, microbatch) if backward else fwd(stage, microbatch)

    per_rank = []
    total = v * m
    for r in range(p):
        warmup = min(total, 2 * (p - 1 - r) + (v - 1) * p if v > 1 else p - 1 - r)
        actions = [slot(r, i, False) for i in range(warmup)]
        for k in range(total - warmup):
            actions += [slot(r, warmup + k, False), slot(r, k, True)]
        actions += [slot(r, i, True) for i in range(total - warmup, total)]
        per_rank.append(actions)
    return Schedule(
        "interleaved_1f1b", num_stages, p, m, looped_stage_to_rank(num_stages, p), tuple(map(tuple, per_rank))
    )


@register_schedule("looped_bfs", stages_per_rank=None)
def looped_bfs(num_stages: int, num_ranks: int, num_microbatches: int) -> Schedule:
    """Looped breadth-first (Lamy-Poirier 2022): stage s on rank s % p; each local stage
    runs all its forwards before the next, then backwards in reverse (last stage first,
    latest microbatch first)."""
    mbs = range(num_microbatches)
    stage_to_rank = looped_stage_to_rank(num_stages, num_ranks)
    per_rank = []
    for r in range(num_ranks):
        local = [s for s in range(num_stages) if stage_to_rank[s] == r]
        actions = [fwd(s, m) for s in local for m in mbs]
        actions += [bwd(s, m) for s in reversed(local) for m in reversed(mbs)]
        per_rank.append(actions)
    return Schedule("looped_bfs", num_stages, num_ranks, num_microbatches, stage_to_rank, tuple(map(tuple, per_rank)))
