"""Tests for pipesplit.schedules: actions, golden tables, registry, validate, io."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesplit.errors import ScheduleError
from pipesplit.schedules import (
    Action,
    ActionKind,
    Schedule,
    get_schedule,
    list_schedules,
    load_schedule,
    register_schedule,
    save_schedule,
    schedule_from_csv,
    schedule_from_text,
    schedule_info,
    schedule_to_csv,
    schedule_to_text,
    unregister_schedule,
    validate,
    with_communication,
)

BUILTINS = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v")


def rows(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, rank)) for rank in schedule.actions]


def edit(schedule: Schedule, rank: int, actions: str) -> Schedule:
    """``schedule`` with rank ``rank``'s list replaced by the given text."""
    lists = list(schedule.actions)
    lists[rank] = tuple(Action.parse(t) for t in actions.split())
    return dataclasses.replace(schedule, actions=tuple(lists))


def build(name: str, p: int, m: int, v: int = 2) -> Schedule:
    """The built-in ``name`` for p ranks and m microbatches (v stages per rank where free)."""
    spr = schedule_info(name).constraints.stages_per_rank or v
    return get_schedule(name, num_stages=spr * p, num_ranks=p, num_microbatches=m)


def valid_m(name: str, p: int, m: int) -> int:
    return p * max(1, m // p) if schedule_info(name).constraints.microbatches_multiple_of_ranks else m


# --- actions -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ActionKind))
def test_action_text_round_trip(kind: ActionKind) -> None:
    action = Action(12, kind, 305)
    assert str(action) == f"12{kind.value}305"
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    "text, expected",
    [("2F0", (2, ActionKind.FORWARD, 0)), ("1B3", (1, ActionKind.FULL_BACKWARD, 3)),
     ("0I2", (0, ActionKind.BACKWARD_INPUT, 2)), ("0W2", (0, ActionKind.BACKWARD_WEIGHT, 2)),
     ("2SEND_F0", (2, ActionKind.SEND_F, 0)), ("3RECV_F0", (3, ActionKind.RECV_F, 0)),
     ("1SEND_B4", (1, ActionKind.SEND_B, 4)), ("0RECV_B4", (0, ActionKind.RECV_B, 4))],
)
def test_action_parse_examples(text: str, expected: tuple[int, ActionKind, int]) -> None:
    assert Action.parse(text) == Action(*expected)


@pytest.mark.parametrize("bad", ["2X0", "F0", "2F", "", "2f0", "1SEND_F", "-1F0", "1 F0", "1FF0"])
def test_action_parse_rejects_malformed_text_quoting_it(bad: str) -> None:
    with pytest.raises(ScheduleError, match=f"Cannot parse action {bad!r}"):
        Action.parse(bad)


def test_action_rejects_negative_indices() -> None:
    with pytest.raises(ScheduleError, match="stage must be an int >= 0"):
        Action(-1, ActionKind.FORWARD, 0)


@pytest.mark.parametrize(
    "text, peer, match",
    [("2SEND_F0", 3, "3RECV_F0"), ("3RECV_F0", 2, "2SEND_F0"),
     ("1SEND_B4", 0, "0RECV_B4"), ("0RECV_B4", 1, "1SEND_B4")],
)
def test_comm_peer_is_derived_from_the_chain(text: str, peer: int, match: str) -> None:
    action = Action.parse(text)
    assert action.is_comm and action.peer_stage == peer
    assert str(action.matching()) == match
    assert Action.parse("2F0").peer_stage is None


def test_peer_rank_follows_stage_to_rank() -> None:
    s = get_schedule("zb_v", num_ranks=2, num_microbatches=1)  # stages 0,1,2,3 on ranks 0,1,1,0
    assert s.peer_rank(Action.parse("2SEND_F0")) == 0
    assert s.peer_rank(Action.parse("1RECV_F0")) == 0
    assert s.peer_rank(Action.parse("1F0")) is None
    with pytest.raises(ScheduleError, match="talks to stage 4, outside 0..3"):
        s.peer_rank(Action.parse("3SEND_F0"))


# --- golden tables -----------------------------------------------------------------------


def test_1f1b_golden_p4_m8() -> None:
    assert rows(get_schedule("1f1b", num_stages=4, num_ranks=4, num_microbatches=8)) == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    ]


def test_gpipe_golden_all_forwards_then_all_backwards() -> None:
    assert rows(get_schedule("gpipe", num_ranks=3, num_microbatches=3)) == [
        "0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2", "2F0 2F1 2F2 2B0 2B1 2B2",
    ]


def test_interleaved_golden_p2_v2_m4() -> None:
    # Hand-derived from Megatron's rule: rank r warms up with 2(p-1-r) + (v-1)p forwards,
    # chunks advance every p microbatches, backwards start from the last chunk.
    s = get_schedule("interleaved_1f1b", num_stages=4, num_ranks=2, num_microbatches=4)
    assert s.stage_to_rank == (0, 1, 0, 1)
    assert rows(s) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_looped_bfs_golden_p2_v2_m2() -> None:
    s = get_schedule("looped_bfs", num_stages=4, num_ranks=2, num_microbatches=2)
    assert rows(s) == ["0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0", "1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0"]


def test_zb_h1_golden_p3_m4() -> None:
    # Rank r: 1F1B order of F and I; W starts after the r-th I; deferred W's at the end.
    assert rows(get_schedule("zb_h1", num_ranks=3, num_microbatches=4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ]


def test_zb_v_golden_p2_m4() -> None:
    s = get_schedule("zb_v", num_ranks=2, num_microbatches=4)
    assert s.num_stages == 4 and s.stage_to_rank == (0, 1, 1, 0)
    assert rows(s) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
    ]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"])
def test_full_backward_schedules_use_b_and_zero_bubble_ones_use_i_w(name: str) -> None:
    kinds = {a.kind for rank in build(name, 3, 6).actions for a in rank}
    assert kinds == {ActionKind.FORWARD, ActionKind.FULL_BACKWARD}
    for zb in ("zb_h1", "zb_v"):
        kinds = {a.kind for rank in build(zb, 3, 6).actions for a in rank}
        assert kinds == {ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}


# --- every built-in validates ------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16])
def test_builtins_validate_on_a_grid(name: str, p: int, m: int) -> None:
    s = build(name, p, valid_m(name, p, m))
    assert validate(s) is s
    assert validate(with_communication(s)).has_communication == (p > 1)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(BUILTINS),
    p=st.integers(1, 6),
    m=st.integers(1, 14),
    v=st.integers(1, 4),
)
def test_builtins_validate_for_random_sizes(name: str, p: int, m: int, v: int) -> None:
    s = build(name, p, valid_m(name, p, m), v)
    validate(s)
    validate(with_communication(s))
    assert sum(len(r) for r in s.actions) == s.num_stages * s.num_microbatches * (
        3 if name.startswith("zb") else 2
    )


# --- communication -----------------------------------------------------------------------


def test_with_communication_golden_p2_m2() -> None:
    s = with_communication(get_schedule("1f1b", num_ranks=2, num_microbatches=2))
    assert rows(s) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    ]
    assert with_communication(s) == s
    assert s.compute_only() == get_schedule("1f1b", num_ranks=2, num_microbatches=2)


def test_with_communication_keeps_same_rank_handoffs_local() -> None:
    # ZB-V puts stages p-1 and p on the same rank: no send/recv between them.
    s = with_communication(get_schedule("zb_v", num_ranks=2, num_microbatches=2))
    comm = {str(a) for rank in s.actions for a in rank if a.is_comm}
    assert {"0SEND_F0", "1RECV_F0", "2SEND_F0", "3RECV_F0", "1SEND_B0", "0RECV_B0"} <= comm
    assert not {"1SEND_F0", "2RECV_F0", "2SEND_B0", "1RECV_B0"} & comm
    assert not with_communication(get_schedule("looped_bfs", num_stages=3, num_ranks=1, num_microbatches=2)).has_communication


# --- overlapped pairs ----------------------------------------------------------------------


def paired(schedule: Schedule, *pairs: str) -> Schedule:
    """``schedule`` with the given ``"F&B"`` overlapped pairs."""
    return dataclasses.replace(schedule, overlap=tuple(tuple(map(Action.parse, p.split("&"))) for p in pairs))


def test_overlapped_pair_validates_round_trips_and_lowers_as_one_unit(tmp_path) -> None:
    s = validate(paired(get_schedule("1f1b", num_ranks=2, num_microbatches=2), "0F1&0B0"))
    assert s.overlap == ((Action.parse("0F1"), Action.parse("0B0")),)
    assert s.overlap_partner == {Action.parse("0F1"): Action.parse("0B0")}
    assert schedule_to_text(s).splitlines()[-2:] == ["0F0 0F1&0B0 0B1", "1F0 1B0 1F1 1B1"]
    assert schedule_from_text(schedule_to_text(s)) == s
    assert schedule_from_csv(schedule_to_csv(s)) == s
    assert load_schedule(save_schedule(s, tmp_path / "s.csv")) == s
    # The pair's recv comes before it and its sends after it, so the pair stays adjacent.
    comm = validate(with_communication(s))
    assert schedule_to_text(comm).splitlines()[-2] == "0F0 0SEND_F0 0RECV_B0 0F1&0B0 0SEND_F1 0RECV_B1 0B1"
    assert comm.compute_only() == s and with_communication(comm) == comm


@pytest.mark.parametrize(
    "pairs, message",
    [
        (["0F1&0B1"], r"overlapped pair 0F1&0B1 overlaps a forward and a backward of the same microbatch 1"),
        (["0F0&0B1"], r"0F0 \(rank 0, position 0\) and 0B1 \(rank 0, position 3\) must be next to each other"),
        (["0B0&0F1"], r"overlapped pair 0B0&0F1 must be a forward followed by a B or I pass, got FULL_BACKWARD"),
        (["0F1&0B0", "1F1&0B0"], r"0B0 is in two overlapped pairs \(overlapped pair 0F1&0B0 and overlapped pair "
                                 r"1F1&0B0\)"),
        (["0F1&0B5"], r"overlapped pair 0F1&0B5 names 0B5, which is not in the schedule"),
    ],
)
def test_validate_rejects_bad_overlapped_pairs(pairs: list[str], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(paired(get_schedule("1f1b", num_ranks=2, num_microbatches=2), *pairs))


def test_validate_rejects_a_pair_that_deadlocks_only_when_overlapped() -> None:
    # Run one after the other this order is fine; overlapped, 0F1 would wait for 0B0's input 1B0,
    # which rank 1 only runs after 1F1, which needs 0F1.
    s = get_schedule("gpipe", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match=r"0F1 \(rank 0, position 1\) \(overlapped with 0B0\) can never run: "
                       r"it waits on 1B0, .*rank 1 is stuck at 1F1 \(rank 1, position 1\), which waits on 0F1"):
        validate(paired(s, "0F1&0B0"))


def test_pair_tokens_join_exactly_two_actions() -> None:
    with pytest.raises(ScheduleError, match=r"Rank 0, position 1: '0F1&0B0&0B1' joins 3 actions"):
        schedule_from_text("0F0 0F1&0B0&0B1\n1F0 1B0 1F1 1B1")


# --- validate rejects ----------------------------------------------------------------------


@pytest.fixture
def one_f_one_b() -> Schedule:
    return get_schedule("1f1b", num_ranks=4, num_microbatches=8)


def test_validate_rejects_missing_action(one_f_one_b: Schedule) -> None:
    broken = edit(one_f_one_b, 2, " ".join(str(a) for a in one_f_one_b.actions[2] if str(a) != "2B5"))
    with pytest.raises(ScheduleError, match="missing 2B5"):
        validate(broken)


def test_validate_rejects_missing_forward(one_f_one_b: Schedule) -> None:
    broken = edit(one_f_one_b, 1, " ".join(str(a) for a in one_f_one_b.actions[1] if str(a) != "1F6"))
    with pytest.raises(ScheduleError, match="missing 1F6"):
        validate(broken)


def test_validate_rejects_duplicate(one_f_one_b: Schedule) -> None:
    broken = edit(one_f_one_b, 0, rows(one_f_one_b)[0] + " 0F3")
    with pytest.raises(ScheduleError, match=r"duplicate 0F3: at rank 0, position 3 and at rank 0, position 16"):
        validate(broken)


def test_validate_rejects_wrong_dependency_order(one_f_one_b: Schedule) -> None:
    broken = edit(one_f_one_b, 3, "3B0 3F0 " + rows(one_f_one_b)[3][8:])
    with pytest.raises(ScheduleError, match=r"3B0 \(rank 3, position 0\) can never run: it waits on 3F0, "
                       r"which comes later on the same rank \(position 1\)"):
        validate(broken)


def test_validate_rejects_forward_before_previous_stage() -> None:
    s = schedule_from_text("0F0 0F1 0B0 0B1\n1F1 1F0 1B0 1B1", check=False)
    validate(s)  # F1 before F0 on rank 1 is fine: rank 0 runs both forwards first
    deadlock = schedule_from_text("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1", check=False)
    with pytest.raises(ScheduleError, match=r"0B0 \(rank 0, position 1\) can never run: it waits on 1B0.*"
                       r"rank 1 is stuck at 1F1 \(rank 1, position 0\), which waits on 0F1"):
        validate(deadlock)


def test_validate_rejects_action_on_wrong_rank(one_f_one_b: Schedule) -> None:
    moved = edit(one_f_one_b, 3, " ".join(str(a) for a in one_f_one_b.actions[3] if str(a) != "3F0"))
    moved = edit(moved, 0, "3F0 " + rows(one_f_one_b)[0])
    wrong = r"3F0 \(rank 0, position 0\) is on the wrong rank: stage 3 belongs to rank 3"
    with pytest.raises(ScheduleError, match=wrong):
        validate(moved)


def test_validate_rejects_deadlocking_send_recv_order() -> None:
    s = with_communication(get_schedule("1f1b", num_ranks=2, num_microbatches=1))
    assert rows(s)[0] == "0F0 0SEND_F0 0RECV_B0 0B0"
    # Waiting for the gradient before sending the activation that produces it: a cycle.
    broken = edit(s, 0, "0RECV_B0 0F0 0SEND_F0 0B0")
    with pytest.raises(ScheduleError, match=r"0RECV_B0 \(rank 0, position 0\) can never run: it waits on "
                       r"1SEND_B0, which never runs. Deadlock: .*rank 1 is stuck at 1RECV_F0"):
        validate(broken)


def test_validate_rejects_missing_and_needless_comm() -> None:
    s = with_communication(get_schedule("1f1b", num_ranks=2, num_microbatches=1))
    with pytest.raises(ScheduleError, match="missing 1RECV_F0"):
        validate(edit(s, 1, "1F0 1B0 1SEND_B0"))
    local = with_communication(get_schedule("zb_v", num_ranks=2, num_microbatches=1))
    text = rows(local)[1].replace("1F0", "1F0 1SEND_F0", 1)
    needless = r"1SEND_F0 \(rank 1, position \d+\) is not needed: stages 1 and 2 are both on rank 1"
    with pytest.raises(ScheduleError, match=needless):
        validate(edit(local, 1, text))


def test_validate_rejects_mixed_and_half_split_backwards() -> None:
    z = get_schedule("zb_h1", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="0B1 .* is mixed with 0I1"):
        validate(edit(z, 0, rows(z)[0] + " 0B1"))
    with pytest.raises(ScheduleError, match="missing 0W1"):
        validate(edit(z, 0, rows(z)[0].replace(" 0W1", "")))
    with pytest.raises(ScheduleError, match="missing 0I1"):
        validate(edit(z, 0, rows(z)[0].replace(" 0I1", "")))


def test_validate_rejects_out_of_range_indices(one_f_one_b: Schedule) -> None:
    with pytest.raises(ScheduleError, match=r"0F9 \(rank 0, position 16\) names microbatch 9.*0..7"):
        validate(edit(one_f_one_b, 0, rows(one_f_one_b)[0] + " 0F9"))


def test_schedule_rejects_inconsistent_shape() -> None:
    with pytest.raises(ScheduleError, match="stage_to_rank has 2 entries but num_stages is 3"):
        Schedule("x", 3, 2, 1, (0, 1), ((), ()))
    with pytest.raises(ScheduleError, match="1 action lists for num_ranks=2"):
        Schedule("x", 2, 2, 1, (0, 1), ((),))
    with pytest.raises(ScheduleError, match="stage 1 appears on rank 0 and on rank 1"):
        Schedule.from_lists("x", [["0F0", "1F0"], ["1B0"]])


# --- registry ----------------------------------------------------------------------------


def test_list_schedules_has_the_builtins() -> None:
    assert set(BUILTINS) <= set(list_schedules())


def test_unknown_schedule_lists_names_and_suggests() -> None:
    with pytest.raises(ScheduleError, match=r"Unknown schedule '1fb1'. Did you mean '1f1b'\? Known schedules: .*gpipe"):
        get_schedule("1fb1", num_ranks=2, num_microbatches=2)


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("1f1b", dict(num_stages=6, num_ranks=4, num_microbatches=4),
         r"exactly 1 stage\(s\) per rank.*num_stages=6, num_ranks=4"),
        ("zb_v", dict(num_stages=6, num_ranks=4, num_microbatches=4), r"exactly 2 stage\(s\) per rank.*Use num_stages=8"),
        ("looped_bfs", dict(num_stages=6, num_ranks=4, num_microbatches=4), r"multiple of num_ranks.*Use num_stages=4 or 8"),
        ("interleaved_1f1b", dict(num_stages=8, num_ranks=4, num_microbatches=6),
         r"num_microbatches=6, num_ranks=4.*Use num_microbatches=4 or 8"),
        ("interleaved_1f1b", dict(num_ranks=4, num_microbatches=4), "give both num_stages and num_ranks"),
        ("gpipe", dict(num_ranks=2, num_microbatches=0), "num_microbatches must be an int >= 1, got 0"),
    ],
)
def test_constraints_are_checked_before_building(name: str, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        get_schedule(name, **kwargs)


def test_user_registered_schedule_end_to_end() -> None:
    calls: list[tuple[int, int, int]] = []

    @register_schedule("test_user_gpipe_reversed", min_microbatches=2)
    def reversed_gpipe(num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[str]]:
        """GPipe with the backwards in reverse microbatch order."""
        calls.append((num_stages, num_ranks, num_microbatches))
        mbs = range(num_microbatches)
        return [[f"{r}F{m}" for m in mbs] + [f"{r}B{m}" for m in reversed(mbs)] for r in range(num_ranks)]

    try:
        assert "test_user_gpipe_reversed" in list_schedules()
        assert schedule_info("test_user_gpipe_reversed").description.startswith("GPipe with the backwards")
        s = get_schedule("test_user_gpipe_reversed", num_ranks=3, num_microbatches=4)
        assert s.name == "test_user_gpipe_reversed" and s.stage_to_rank == (0, 1, 2)
        assert rows(s)[2] == "2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0"
        with pytest.raises(ScheduleError, match="needs num_microbatches >= 2, got 1"):
            get_schedule("test_user_gpipe_reversed", num_ranks=3, num_microbatches=1)
        assert calls == [(3, 3, 4)]  # the constraint failed before the function ran
        with pytest.raises(ScheduleError, match="already registered"):
            register_schedule("test_user_gpipe_reversed")(reversed_gpipe)
    finally:
        unregister_schedule("test_user_gpipe_reversed")
    assert "test_user_gpipe_reversed" not in list_schedules()


def test_user_schedule_that_is_invalid_or_wrong_size_is_rejected() -> None:
    @register_schedule("test_user_broken")
    def broken(num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[str]]:
        return [[f"{r}B0", f"{r}F0"] for r in range(num_ranks)]  # ignores num_microbatches too

    @register_schedule("test_user_wrong_size")
    def wrong_size(num_stages: int, num_ranks: int, num_microbatches: int) -> Schedule:
        return Schedule.from_lists("w", [[f"{r}F0", f"{r}B0"] for r in range(num_ranks)])

    try:
        with pytest.raises(ScheduleError, match=r"0B0 \(rank 0, position 0\) can never run: it waits on 0F0"):
            get_schedule("test_user_broken", num_ranks=2, num_microbatches=1)
        with pytest.raises(ScheduleError, match=r"returned .* = \(2, 2, 1\), but \(2, 2, 3\) were requested"):
            get_schedule("test_user_wrong_size", num_ranks=2, num_microbatches=3)
        with pytest.raises(ScheduleError, match="missing 0F1: rank 0 never runs the forward of microbatch 1"):
            get_schedule("test_user_broken", num_ranks=2, num_microbatches=2)
    finally:
        unregister_schedule("test_user_broken")
        unregister_schedule("test_user_wrong_size")


# --- io ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("comm", [False, True])
def test_text_and_csv_round_trip(name: str, comm: bool, tmp_path) -> None:
    s = build(name, 3, 6)
    s = with_communication(s) if comm else s
    assert schedule_from_text(schedule_to_text(s)) == s
    assert schedule_from_csv(schedule_to_csv(s)) == s
    for suffix in (".txt", ".csv"):
        assert load_schedule(save_schedule(s, tmp_path / f"sched{suffix}")) == s


def test_hand_written_text_infers_sizes_and_accepts_commas(tmp_path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("0F0, 0F1, 0B0, 0B1\n\n1F0 1B0,1F1 1B1\n")
    s = load_schedule(path)
    assert (s.name, s.num_stages, s.num_ranks, s.num_microbatches, s.stage_to_rank) == ("mine", 2, 2, 2, (0, 1))
    (tmp_path / "bad.csv").write_text("0F0,0B0\n1F0,1Q0\n")
    with pytest.raises(ScheduleError, match=r"bad.csv.*Rank 1, position 1: Cannot parse action '1Q0'"):
        load_schedule(tmp_path / "bad.csv")


def test_loading_validates(tmp_path) -> None:
    path = tmp_path / "s.txt"
    path.write_text("0F0 0B0\n1B0 1F0\n")
    with pytest.raises(ScheduleError, match="1B0 .* can never run"):
        load_schedule(path)
    assert load_schedule(path, check=False).actions[1][0] == Action.parse("1B0")
