"""Tests for pipesplit.schedules.simulate: bubbles against the literature, memory, charts."""

from __future__ import annotations

import dataclasses

import pytest

from pipesplit.errors import ScheduleError
from pipesplit.schedules import (
    Action,
    Schedule,
    StageCost,
    Timeline,
    get_schedule,
    schedule_from_text,
    simulate,
    with_communication,
)
from pipesplit.schedules.execute import backward_index, requirements

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16, 32)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name: str, p: int, m: int) -> None:
    # Uniform stages, F = 1, B = 2F, no comm: the textbook (p-1)/(m+p-1), exactly.
    t = simulate(get_schedule(name, num_ranks=p, num_microbatches=m), 1.0)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert t.step_time == pytest.approx(3.0 * (m + p - 1))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_bubble_matches_megatron_analysis(p: int, v: int, rounds: int) -> None:
    # Narayanan et al. 2021: bubble time / ideal time = (p-1)/(v*m). As idle / total that
    # is (p-1)/(v*m + p-1). With m a multiple of p, no comm and each chunk costing 1/v of
    # a full stage, the simulation hits it exactly (checked for p<=4, v<=4, m<=4p).
    m = p * rounds
    s = get_schedule("interleaved_1f1b", num_stages=p * v, num_ranks=p, num_microbatches=m)
    t = simulate(s, 1.0 / v)
    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
    if v > 1:
        gpipe = simulate(get_schedule("gpipe", num_ranks=p, num_microbatches=m), 1.0)
        assert t.bubble_fraction < gpipe.bubble_fraction


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_looped_bfs_matches_interleaved_bubble_without_comm(p: int) -> None:
    # Breadth-first has the same compute bubble (its gain is fewer, larger transfers),
    # at the price of holding all v*m activations.
    m, v = 2 * p, 2
    bfs = simulate(get_schedule("looped_bfs", num_stages=v * p, num_ranks=p, num_microbatches=m), 0.5)
    assert bfs.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
    assert bfs.peak_activations == (v * m,) * p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 8])
def test_zb_h1_bubble_is_a_third_of_1f1b(p: int, m_per_p: int) -> None:
    # F = I = W = 1 (B = 2). Qi et al.: 1F1B idles (p-1)(F+B) = 3(p-1) per rank, ZB-H1
    # (p-1)(F+I-W) = p-1. Our ZB-H1 reaches that bound exactly for m >= p, so the idle
    # *time* ratio is exactly 1/3.
    m = p * m_per_p
    one = simulate(get_schedule("1f1b", num_ranks=p, num_microbatches=m), StageCost(1, 1, 1))
    zb = simulate(get_schedule("zb_h1", num_ranks=p, num_microbatches=m), StageCost(1, 1, 1))
    assert zb.idle == pytest.approx([p - 1.0] * p)
    assert one.idle == pytest.approx([3.0 * (p - 1)] * p)
    # As fractions the ratio is (3m+3p-3) / (3(3m+p-1)) = 1/3 + 2(p-1)/(3(3m+p-1)): the
    # excess over 1/3 shrinks like 1/m; at m = 8p it is below 0.03 for every p tested.
    ratio = zb.bubble_fraction / one.bubble_fraction
    assert ratio == pytest.approx((3 * m + 3 * p - 3) / (3 * (3 * m + p - 1)), abs=1e-9)
    if m_per_p == 8:
        assert abs(ratio - 1 / 3) < 0.03


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_h1_keeps_1f1b_peak_activation_memory(p: int) -> None:
    m = 3 * p
    one = simulate(get_schedule("1f1b", num_ranks=p, num_microbatches=m), 1.0)
    zb = simulate(get_schedule("zb_h1", num_ranks=p, num_microbatches=m), 1.0)
    assert max(zb.peak_activations) == max(one.peak_activations) == p
    # Activations are released when W ends, not I: rank r keeps the inputs of its r
    # deferred W passes, so every rank (not just rank 0) peaks at p.
    assert zb.peak_activations == (p,) * p
    assert one.peak_activations == tuple(p - r for r in range(p))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_p", [2, 4])
def test_zb_v_bubble_is_below_zb_h1(p: int, m_per_p: int) -> None:
    # Same model: ZB-H1 with p stages of cost 1, ZB-V with 2p half-size stages.
    m = p * m_per_p
    h1 = simulate(get_schedule("zb_h1", num_ranks=p, num_microbatches=m), 1.0)
    zv = simulate(get_schedule("zb_v", num_ranks=p, num_microbatches=m), 0.5)
    assert sum(zv.busy) == pytest.approx(sum(h1.busy))
    assert zv.bubble_fraction < h1.bubble_fraction
    # Only the unavoidable start-up remains: rank p-1 waits (p-1) half-stage forwards
    # before its first action; every rank idles exactly that long, half ZB-H1's idle.
    assert zv.idle == pytest.approx([(p - 1) * 0.5] * p)
    # Peak memory: 2p half-size activations, i.e. 1F1B's p full-stage ones.
    assert max(zv.peak_activations) == 2 * p


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_peak_in_flight_1f1b_versus_gpipe(p: int, m: int) -> None:
    one = simulate(get_schedule("1f1b", num_ranks=p, num_microbatches=m), 1.0)
    gpipe = simulate(get_schedule("gpipe", num_ranks=p, num_microbatches=m), 1.0)
    for r in range(p):
        assert one.peak_activations[r] <= p - r
        assert one.peak_activations[r] == min(p - r, m)
    assert gpipe.peak_activations == (m,) * p


def test_events_respect_ranks_and_dependencies() -> None:
    s = with_communication(get_schedule("zb_v", num_ranks=3, num_microbatches=6))
    t = simulate(s, [StageCost(1.0 + 0.1 * i, 0.7, 0.4) for i in range(6)], comm_cost=0.25)
    end = {e.action: e.end for rank in t.events for e in rank}
    backward_of = backward_index(s)
    for rank, events in enumerate(t.events):
        assert [e.action for e in events] == list(s.actions[rank])
        for before, after in zip(events, events[1:]):
            assert before.end <= after.start + 1e-12
        for e in events:
            for dep in requirements(e.action, s, backward_of):
                assert end[dep] <= e.end + 1e-12
    assert t.of("0F0").start == 0.0


def test_comm_actions_reproduce_implicit_handoffs_and_cost_shows_up() -> None:
    costs = [StageCost(1.0, 1.5, 0.5), StageCost(2.0, 1.0, 1.0)]
    s = get_schedule("1f1b", num_ranks=2, num_microbatches=1)
    implicit = simulate(s, costs, comm_cost=0.3)
    explicit = simulate(with_communication(s), costs, comm_cost=0.3)
    # F0 + cut + F1 + B1 + cut + B0
    assert implicit.step_time == pytest.approx(1.0 + 0.3 + 2.0 + 2.0 + 0.3 + 2.0)
    assert explicit.step_time == pytest.approx(implicit.step_time)
    compute = {e.action: (e.start, e.end) for r in explicit.events for e in r if e.action.is_compute}
    assert compute == {e.action: (e.start, e.end) for r in implicit.events for e in r}
    # A recv holds its rank while it waits: rank 1 waits 1.3 for the first activation.
    assert explicit.of("1RECV_F0")[1:] == pytest.approx((0.0, 1.3))


def test_same_rank_handoffs_are_free() -> None:
    # Looped on one rank: no cut crosses ranks, so comm cost changes nothing.
    s = get_schedule("looped_bfs", num_stages=3, num_ranks=1, num_microbatches=2)
    assert simulate(s, 1.0, comm_cost=[5.0, 7.0]).step_time == simulate(s, 1.0).step_time == 18.0


def test_per_boundary_comm_cost() -> None:
    s = get_schedule("gpipe", num_ranks=3, num_microbatches=1)
    t = simulate(s, 1.0, comm_cost=[0.5, 2.0])
    assert t.step_time == pytest.approx(3 * 1 + 3 * 2 + 2 * (0.5 + 2.0))


def test_slowest_stage_bounds_the_step() -> None:
    costs = [1.0, 3.0, 1.0, 1.0]
    t = simulate(get_schedule("1f1b", num_ranks=4, num_microbatches=16), costs)
    assert t.step_time >= 16 * 3 * 3.0
    assert t.busy[1] == pytest.approx(16 * 9.0)


@pytest.mark.parametrize(
    "costs, comm, message",
    [
        ([1.0, 1.0], 0.0, "got 2 stage costs for 3 stages"),
        ([1.0, -1.0, 1.0], 0.0, "cost of stage 1 is -1.0"),
        (1.0, [0.1], "got 1 comm costs for 2 stage boundaries"),
        (1.0, [0.1, float("nan")], "comm cost of boundary 1"),
    ],
)
def test_bad_costs_are_rejected(costs: object, comm: object, message: str) -> None:
    s = get_schedule("gpipe", num_ranks=3, num_microbatches=2)
    with pytest.raises(ScheduleError, match=message):
        simulate(s, costs, comm)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="StageCost.forward must be a finite number >= 0"):
        StageCost(-1.0, 1.0, 1.0)


def test_simulate_validates_first() -> None:
    bad = schedule_from_text("0B0 0F0", check=False)
    with pytest.raises(ScheduleError, match="can never run"):
        simulate(bad, 1.0)


def test_to_text_gantt() -> None:
    t = simulate(get_schedule("gpipe", num_ranks=2, num_microbatches=2), 1.0)
    assert t.to_text(width=9).splitlines() == [
        "gpipe: 2 ranks, 2 stages, 2 microbatches; step 9 time units, bubble 33.3%",
        "rank 0 |Ff...BBbb|",
        "rank 1 |.FfBBbb..|",
    ]
    big = simulate(get_schedule("zb_v", num_ranks=4, num_microbatches=8), 0.5).to_text(width=60)
    lines = big.splitlines()
    assert len(lines) == 5 and len({len(line) for line in lines[1:]}) == 1
    assert len(lines[1]) <= len("rank 0 |") + 60 + 1
    assert set("".join(lines[1:])) <= set("rank0123 |FfIiWw.")
    with pytest.raises(ScheduleError, match="width must be an int >= 1"):
        simulate(get_schedule("gpipe", num_ranks=2, num_microbatches=2), 1.0).to_text(width=0)


def test_to_text_draws_equal_actions_equally_wide() -> None:
    """`pipesplit schedule zb_h1 --stages 4` drew 27 time units in 80 columns: some blocks 2 columns wide, others 3."""
    import itertools

    t = simulate(get_schedule("zb_h1", num_ranks=4, num_microbatches=8), 1.0)
    text = t.to_text(width=80)
    assert text.splitlines()[0].endswith("step 27 time units, bubble 11.1%")
    runs: dict[str, set[int]] = {}
    for line in text.splitlines()[1:]:
        for letter, run in itertools.groupby(line.split("|")[1]):
            if letter != ".":
                runs.setdefault(letter.upper(), set()).add(len(list(run)))
    assert runs == {"F": {2}, "I": {2}, "W": {2}}, runs  # 80 // 27 = 2 columns per time unit
    assert len(text.splitlines()[1]) == len("rank 0 |") + 54 + 1


def test_timelines_carry_their_unit(tmp_path) -> None:
    """"step 0.217046" (seconds) and an axis saying "time": every figure now says its unit."""
    import dataclasses

    t = simulate(get_schedule("gpipe", num_ranks=2, num_microbatches=2), 0.0125)
    assert "step 0.1125 time units" in t.to_text()
    assert "step 112 ms," in dataclasses.replace(t, unit="s").to_text()
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    dataclasses.replace(t, unit="s").draw(ax)
    assert ax.get_xlabel() == "time (s)"


def test_plot_writes_png(tmp_path) -> None:
    t = simulate(with_communication(get_schedule("zb_h1", num_ranks=4, num_microbatches=8)), 1.0, 0.1)
    path = t.plot(tmp_path / "zb_h1.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_timeline_of_empty_rank_and_zero_costs() -> None:
    s = Schedule.from_lists("idle", [["0F0", "0B0"], []], stage_to_rank=[0])
    t = simulate(s, 0.0)
    assert isinstance(t, Timeline) and t.step_time == 0.0 and t.bubble_fraction == 0.0
    assert t.peak_activations == (1, 0)


def test_overlapped_pair_starts_when_both_inputs_are_ready_and_takes_the_longer_action() -> None:
    # 1F1B over 2 ranks, F = 1, B = 2, with 0F1 overlapped with 0B0. Back to back (overlap=0)
    # nothing changes. Fully overlapped the pair waits for 0B0's input (1B0 ends at 4), takes
    # max(1, 2) = 2, split 1:2 in the chart, and both results are ready at 6.
    plain = get_schedule("1f1b", num_ranks=2, num_microbatches=2)
    s = dataclasses.replace(plain, overlap=((Action.parse("0F1"), Action.parse("0B0")),))
    assert simulate(s, 1.0).events == simulate(plain, 1.0).events
    assert simulate(s, 1.0).step_time == 9.0
    t = simulate(s, 1.0, overlap=1)
    assert (t.of("0F1").start, t.of("0F1").end, t.of("0B0").end) == pytest.approx((4.0, 4 + 2 / 3, 6.0))
    assert t.of("1F1").start == 6.0 and t.step_time == 11.0
    assert t.busy[0] == pytest.approx(1 + 2 + 2)
    half = simulate(s, 1.0, overlap=0.5)
    assert half.of("0B0").end == pytest.approx(4 + 2.5)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "1", True])
def test_simulate_rejects_bad_overlap(bad) -> None:
    with pytest.raises(ScheduleError, match="overlap must be a number from 0"):
        simulate(get_schedule("1f1b", num_ranks=2, num_microbatches=2), 1.0, overlap=bad)
