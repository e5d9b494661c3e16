"""The runtime's communication plan and its proof under NCCL's semantics (pipesplit.schedules.rendezvous)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesplit.errors import ScheduleError
from pipesplit.schedules import Schedule, get_schedule, register_schedule, schedule_info, unregister_schedule, validate
from pipesplit.schedules import with_communication
from pipesplit.schedules.issue import check_issued, check_rendezvous, issue, proven
from pipesplit.schedules.rendezvous import Edge, Message, Op, Step, comm_plan

BUILTINS = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v")


def build(name: str, p: int, m: int, v: int = 2) -> Schedule:
    spr = schedule_info(name).constraints.stages_per_rank or v
    if schedule_info(name).constraints.microbatches_multiple_of_ranks:
        m = p * max(1, m // p)
    return get_schedule(name, num_stages=spr * p, num_ranks=p, num_microbatches=m)


def ops_text(step: Step) -> list[str]:
    return [("S" if op.send else "R") + f"{op.message.direction}{op.message.microbatch}@{op.peer}" for op in step.ops]


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16])
def test_builtins_are_proven_under_rendezvous(name: str, p: int, m: int) -> None:
    for v in (2, 3):
        schedule = build(name, p, m, v)
        assert validate(schedule, semantics="rendezvous") is schedule


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_dualpipe_v_is_proven_under_rendezvous(p: int, extra: int) -> None:
    schedule = get_schedule("dualpipe_v", num_stages=2 * p, num_ranks=p, num_microbatches=2 * p + extra)
    assert validate(schedule, semantics="rendezvous") is schedule


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(BUILTINS), st.integers(1, 6), st.integers(1, 12), st.integers(1, 3),
       st.lists(st.tuples(st.integers(0, 11), st.integers(1, 4)), max_size=4))
def test_builtins_are_proven_with_skip_edges(name: str, p: int, m: int, v: int, skips: list[tuple[int, int]]) -> None:
    """Long skips (stage s to s + k) and several tensors per cut, as real programs have."""
    schedule = build(name, p, m, v)
    n = schedule.num_stages
    edges = [Edge(f"h{s}", s, s + 1) for s in range(n - 1)] + [Edge(f"mask{s}", s, s + 1, grad=False) for s in range(n - 1)]
    edges += [Edge(f"skip{s}_{k}", s, s + k) for s, k in skips if s + k < n]
    validate(schedule, semantics="rendezvous", edges=sorted(edges, key=lambda e: (e.src, e.name, e.dst)))


def test_1f1b_plan_posts_what_two_neighbours_exchange_in_one_batch() -> None:
    plan = comm_plan(get_schedule("1f1b", num_stages=2, num_microbatches=3))
    assert [(str(s.action), ops_text(s)) for s in plan[0]] == [
        ("0F0", []), ("0F1", ["SF0@1"]), ("0B0", ["RB0@1", "SF1@1"]), ("0F2", []),
        ("0B1", ["RB1@1", "SF2@1"]), ("0B2", ["RB2@1"]),
    ]
    assert [(str(s.action), ops_text(s)) for s in plan[1]] == [
        ("1F0", ["RF0@0"]), ("1B0", []), ("1F1", ["RF1@0", "SB0@0"]), ("1B1", []),
        ("1F2", ["RF2@0", "SB1@0"]), ("1B2", []), ("None", ["SB2@0"]),
    ]


def test_same_rank_hand_offs_are_not_communication() -> None:
    plan = comm_plan(get_schedule("zb_v", num_stages=4, num_ranks=2, num_microbatches=2))
    for rank, steps in enumerate(plan):
        for step in steps:
            assert all(op.peer != rank for op in step.ops)
    sent = {op.message for steps in plan for step in steps for op in step.ops}
    assert not any({m.src, m.dst} == {1, 2} for m in sent)  # stages 1 and 2 share rank 1


def test_explicit_send_recv_actions_do_not_change_the_plan() -> None:
    schedule = get_schedule("1f1b", num_stages=4, num_microbatches=4)
    assert comm_plan(with_communication(schedule)) == comm_plan(schedule)


def test_naive_order_deadlocks_under_rendezvous_but_not_buffered() -> None:
    schedule = validate(get_schedule("1f1b", num_stages=2, num_microbatches=4))  # fine with buffered sends
    with pytest.raises(ScheduleError) as info:
        check_rendezvous(schedule, comm_plan(schedule, batched=False))
    text = str(info.value)
    assert "deadlocks" in text and "rank 0" in text and "rank 1" in text and "batch" in text
    assert "send the activation 'x0' (stage 0 -> stage 1, microbatch 1) to rank 1" in text


def test_naive_order_is_fine_without_crossing_traffic() -> None:
    gpipe = get_schedule("gpipe", num_stages=3, num_microbatches=4)  # every forward, then every backward
    check_rendezvous(gpipe, comm_plan(gpipe, batched=False))


def _plan(*ranks: list[Step]) -> tuple[tuple[Step, ...], ...]:
    return tuple(tuple(r) for r in ranks)


def test_messages_paired_out_of_order_are_reported() -> None:
    a, b = Message("F", "x", 0, 1, 0), Message("F", "x", 0, 1, 1)
    schedule = get_schedule("gpipe", num_stages=2, num_microbatches=2)
    plan = _plan([Step((Op(True, a, 1), Op(True, b, 1)), None)],
                 [Step((Op(False, b, 0),), None), Step((Op(False, a, 0),), None)])
    with pytest.raises(ScheduleError, match="by order, not by tag") as info:
        check_rendezvous(schedule, plan)
    assert "microbatch 0" in str(info.value) and "microbatch 1" in str(info.value)


def test_a_send_without_its_receive_is_reported() -> None:
    schedule = get_schedule("gpipe", num_stages=2, num_microbatches=1)
    plan = _plan([Step((Op(True, Message("F", "x", 0, 1, 0), 1),), None)], [])
    with pytest.raises(ScheduleError, match="sends 1 message"):
        check_rendezvous(schedule, plan)


def test_user_schedule_is_proven_and_its_order_respected() -> None:
    """Backwards in reverse microbatch order on the last rank: the gradients reach rank 0 in that
    order, and the plan has rank 0 receive them in that order too."""

    @register_schedule("test_reversed_tail", replace=True)
    def reversed_tail(num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[str]]:
        mbs = range(num_microbatches)
        return [[f"{r}F{m}" for m in mbs] + [f"{r}B{m}" for m in reversed(mbs)] for r in range(num_ranks)]

    try:
        schedule = get_schedule("test_reversed_tail", num_stages=3, num_microbatches=4)
        validate(schedule, semantics="rendezvous")
        received = [op.message.microbatch for step in comm_plan(schedule)[0] for op in step.ops if not op.send]
        assert received == [3, 2, 1, 0]
    finally:
        unregister_schedule("test_reversed_tail")


def test_unknown_semantics_is_refused() -> None:
    with pytest.raises(ScheduleError, match="rendezvous"):
        validate(get_schedule("1f1b", num_stages=2, num_microbatches=2), semantics="nccl")


# ------------------------------------------------------------------ what each rank issues (schedules/issue.py)
def posts_text(turn) -> list[list[str]]:
    return [[("S" if op.send else "R") + f"{op.message.direction}{op.message.microbatch}" for op in b] for b in turn.post]


def test_gpipe_posts_receives_ahead_and_never_waits_for_a_send() -> None:
    gpipe = get_schedule("gpipe", num_stages=2, num_microbatches=4)
    program = proven(gpipe, comm_plan(gpipe))
    last = program[1]
    assert str(last[0].action) == "1F0" and posts_text(last[0]) == [["RF0"], ["RF1"]]  # F1's input is on its way
    assert last[0].wait == (0,)  # 1F0 waits for its own input only
    first = program[0]
    assert [t.wait for t in first[:4]] == [(), (), (), ()]  # the first rank runs every forward without waiting
    assert first[-1].action is None and first[-1].wait  # its sends are waited for once, at the end


def test_receives_ahead_everywhere_would_deadlock_1f1b_on_nccl() -> None:
    """Posted ahead on both ranks, a receive holds up the rank's later sends on NCCL's one stream:
    rank 0 waits for a gradient rank 1 posted behind its early receive, which waits for rank 0's
    send behind the early receive of that gradient. The proof finds it; proven() keeps only what holds."""
    schedule = get_schedule("1f1b", num_stages=2, num_microbatches=4)
    plan = comm_plan(schedule)
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        check_issued(schedule, issue(plan, lookahead=1))
    assert "one after another" in str(info.value) and "rank 0" in str(info.value) and "rank 1" in str(info.value)
    program = proven(schedule, plan)
    check_issued(schedule, program)
    assert received_ahead(program[0]), "rank 0 posts its gradient receives ahead: proven safe"
    assert not received_ahead(program[1]), "rank 1 cannot: it would hold up its gradient sends"


def received_ahead(turns) -> list[str]:
    """The receives posted in a turn whose action does not wait for them (they are for a later one)."""
    out, index = [], 0
    for t in turns:
        for b in t.post:
            if index not in t.wait:
                out += [f"R{op.message.direction}{op.message.microbatch}" for op in b if not op.send]
            index += 1
    return out


def test_the_plans_own_points_are_the_fallback() -> None:
    """lookahead=0 without early sends issues exactly the plan's batches at the plan's steps."""
    schedule = get_schedule("zb_v", num_stages=4, num_ranks=2, num_microbatches=4)
    plan = comm_plan(schedule)
    program = issue(plan, lookahead=0, early_sends=False)
    for steps, turns in zip(plan, program):
        assert [s.ops for s in steps if s.ops] == [b for t in turns for b in t.post]
    check_issued(schedule, program)


def test_issue_keeps_pair_order_and_waits_for_every_batch() -> None:
    for name in BUILTINS:
        schedule = build(name, 3, 6)
        program = proven(schedule, comm_plan(schedule))
        for turns in program:
            n = sum(len(t.post) for t in turns)
            assert sorted(i for t in turns for i in t.wait) == list(range(n))  # each batch waited for exactly once
