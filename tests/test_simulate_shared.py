"""Ranks sharing one host's cores (pipesplit.schedules.shared): processor sharing, checked against
the plain simulator, hand-worked steps and bounds that hold for every schedule."""

from __future__ import annotations

import pytest

from pipesplit.schedules import StageCost, get_schedule, simulate, with_communication
from pipesplit.schedules.shared import simulate_shared

SCHEDULES = [("gpipe", 4, 4, 8), ("1f1b", 4, 4, 8), ("zb_h1", 4, 4, 8), ("interleaved_1f1b", 8, 4, 8),
             ("looped_bfs", 8, 4, 8), ("zb_v", 8, 4, 8), ("dualpipe_v", 8, 4, 8), ("1f1b", 3, 3, 5)]
COSTS = [StageCost(1.0, 1.2, 0.7), StageCost(0.8, 1.0, 0.9), StageCost(1.3, 1.1, 0.5), StageCost(0.9, 1.4, 0.6)]


def schedule(name: str, stages: int, ranks: int, m: int, comm: bool = False):
    s = get_schedule(name, num_stages=stages, num_ranks=ranks, num_microbatches=m)
    return with_communication(s) if comm else s


def costs(stages: int) -> list[StageCost]:
    return [COSTS[s % len(COSTS)] for s in range(stages)]


@pytest.mark.parametrize("comm", [False, True])
@pytest.mark.parametrize("name, stages, ranks, m", SCHEDULES)
def test_without_a_slowdown_it_is_the_plain_simulator(name, stages, ranks, m, comm):
    s = schedule(name, stages, ranks, m, comm)
    plain = simulate(s, costs(stages), comm_cost=0.25)
    shared = simulate_shared(s, costs(stages), 0.25, slowdown=lambda n: 1.0)
    assert len(shared.events) == len(plain.events)
    for a, b in zip(shared.events, plain.events):
        assert [e.action for e in a] == [e.action for e in b]
        assert [e.start for e in a] == pytest.approx([e.start for e in b], abs=1e-9)
        assert [e.end for e in a] == pytest.approx([e.end for e in b], abs=1e-9)


@pytest.mark.parametrize("name, stages, ranks, m", SCHEDULES)
def test_the_step_lies_between_alone_and_every_action_slowed_by_all_ranks_at_once(name, stages, ranks, m):
    """Each action takes at least its time alone and at most that times slowdown(every rank); a
    rank runs its list in order, so the step is bounded by the two plain simulations."""
    s = schedule(name, stages, ranks, m)

    def slowdown(n: int) -> float:
        return 1.0 + 0.5 * (n - 1)

    alone = simulate(s, costs(stages), comm_cost=0.1).step_time
    worst = slowdown(ranks)
    slowed = [StageCost(c.forward * worst, c.backward_input * worst, c.backward_weight * worst) for c in costs(stages)]
    all_at_once = simulate(s, slowed, comm_cost=0.1).step_time
    shared = simulate_shared(s, costs(stages), 0.1, slowdown=slowdown).step_time
    assert alone < shared < all_at_once


def test_two_ranks_on_one_core_by_hand():
    """gpipe, 2 ranks, 2 microbatches, F = 1, B = 2, one core (slowdown(n) = n): rank 0's F0 runs
    alone (0-1); its F1 and rank 1's F0 share the core (1-3); rank 1's F1 runs alone (3-4), then
    its B0 (4-6); its B1 and rank 0's B0 share the core (6-10); rank 0's B1 runs alone (10-12)."""
    t = simulate_shared(schedule("gpipe", 2, 2, 2), 1.0, slowdown=float)
    spans = {str(e.action): (e.start, e.end) for rank in t.events for e in rank}
    assert spans == {"0F0": (0, 1), "0F1": (1, 3), "1F0": (1, 3), "1F1": (3, 4), "1B0": (4, 6),
                     "1B1": (6, 10), "0B0": (6, 10), "0B1": (10, 12)}
    assert t.step_time == 12.0 and simulate(schedule("gpipe", 2, 2, 2), 1.0).step_time == 9.0
    assert [c.forward for c in t.stage_costs()] == [1.5, 1.5]  # one alone, one shared: the mean


def test_ranks_outside_the_shared_set_run_at_full_speed():
    s = schedule("1f1b", 4, 4, 8)
    plain = simulate(s, costs(4)).step_time
    assert simulate_shared(s, costs(4), slowdown=lambda n: 10.0, shared=()).step_time == pytest.approx(plain)
    one = simulate_shared(s, costs(4), slowdown=lambda n: 10.0 if n > 1 else 1.0, shared={2})
    assert one.step_time == pytest.approx(plain)  # a single sharing rank never runs beside another
    two = simulate_shared(s, costs(4), slowdown=lambda n: 10.0 if n > 1 else 1.0, shared={1, 2})
    assert two.step_time > plain
