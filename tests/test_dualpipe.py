"""DualPipeV (golden table, properties, torch's order, bubble, training) and torch's schedule CSV format."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest
import torch

import pipesplit
from pipesplit import compat
from pipesplit.errors import ScheduleError
from pipesplit.schedules import (
    Action,
    ActionKind,
    Schedule,
    StageCost,
    from_torch_actions,
    from_torch_csv,
    get_schedule,
    schedule_info,
    schedule_to_text,
    simulate,
    to_torch_actions,
    to_torch_csv,
    validate,
    with_communication,
)
from pipesplit.schedules.io import tokens
from tests.torch_schedules import schedules_module, torch_loads, torch_schedule
from tests.training import check_training, dot_loss
from tests.zoo import CASE_BY_NAME

F, B, I, W = ActionKind.FORWARD, ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
SIZES = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in sorted({2 * p, 2 * p + 1, 3 * p + 1, 4 * p, 8 * p})]


def dualpipe_v(p: int, m: int) -> Schedule:
    return get_schedule("dualpipe_v", num_ranks=p, num_microbatches=m)


# --- golden table and properties -----------------------------------------------------------


def test_dualpipe_v_golden_p2_m4() -> None:
    # Rank 0 (stages 0 and 3): F0 x3 to fill the V, chunk 1's first microbatch as I + W, then
    # the steady state pairs a forward of one chunk with a backward of the other (joined by &),
    # and the tail splits the last backwards into I with their W deferred.
    s = dualpipe_v(2, 4)
    assert s.num_stages == 4 and s.stage_to_rank == (0, 1, 1, 0)
    assert schedule_to_text(s).splitlines()[4:] == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3&3B1 3F2&0B0 3B2 3F3&0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2&1B0 1F3&2B1 2F3&1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]


@pytest.mark.parametrize("p, m", SIZES)
def test_dualpipe_v_runs_every_pass_once_in_order_with_v_placement(p: int, m: int) -> None:
    s = dualpipe_v(p, m)
    assert validate(s) is s and validate(with_communication(s)).has_communication == (p > 1)
    assert s.stage_to_rank == tuple(min(x, 2 * p - 1 - x) for x in range(2 * p))
    for r, actions in enumerate(s.actions):
        assert {a.stage for a in actions} == {r, 2 * p - 1 - r}
        per_stage = Counter((a.stage, a.kind) for a in actions)
        for stage in (r, 2 * p - 1 - r):
            # m forwards; m backwards, each either B or I (its W comes later).
            assert per_stage[stage, F] == m
            assert per_stage[stage, B] + per_stage[stage, I] == m
            assert per_stage[stage, W] == per_stage[stage, I]
            # Each chunk takes its microbatches in order, forwards and backwards alike.
            for kinds in ((F,), (B, I), (W,)):
                mbs = [a.microbatch for a in actions if a.stage == stage and a.kind in kinds]
                assert mbs == sorted(mbs)
    # Every (stage, microbatch) once, forward before backward before weight-gradient.
    where = {a: (r, i) for r, actions in enumerate(s.actions) for i, a in enumerate(actions)}
    assert len(where) == sum(map(len, s.actions))
    for (f, b) in s.overlap:
        rank, pos = where[f]
        assert where[b] == (rank, pos + 1) and f.kind is F and b.kind is B
        assert {f.stage, b.stage} == set(s.rank_stages(rank)) and f.microbatch != b.microbatch
    # Two pairs per steady-state round (m - 2p + r + 1 rounds on rank r), one per cool-down step
    # (p - 1 - r), less the V tip's first round, whose forward and backward run apart.
    assert len(s.overlap) == sum(2 * (m - 2 * p + r + 1) + (p - 1 - r) for r in range(p)) - 1


def test_dualpipe_v_splits_backward_only_where_it_fills_bubbles() -> None:
    s = dualpipe_v(4, 8)
    kinds = {a.kind for rank in s.actions for a in rank}
    assert kinds == {F, B, I, W}
    # Rank 0 is the first to finish its warm-up: all of chunk 1's warm-up backwards are split.
    first_backwards = [str(a) for a in s.actions[0] if a.kind in (B, I)][:3]
    assert first_backwards == ["7I0", "7I1", "7I2"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_ranks=4, num_microbatches=6),
         r"'dualpipe_v' needs at least as many microbatches as stages \(num_microbatches >= num_stages\), got "
         r"num_microbatches=6 for num_stages=8 \(num_ranks=4\). Use num_microbatches=8 or more, or num_ranks=3 \(num_stages=6\)"),
        (dict(num_stages=8, num_microbatches=1), r"got num_microbatches=1 for num_stages=8.*Use num_microbatches=8 or more\.$"),
        (dict(num_stages=6, num_ranks=2, num_microbatches=8), r"exactly 2 stage\(s\) per rank.*Use num_stages=4 for num_ranks=2, "
                                                         r"or num_ranks=3 for num_stages=6"),
        (dict(num_stages=5, num_microbatches=8), r"num_stages must be a multiple of 2; got num_stages=5"),
    ],
)
def test_dualpipe_v_constraints_name_the_numbers_and_the_fix(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        get_schedule("dualpipe_v", **kwargs)


def test_dualpipe_v_is_registered_with_its_constraints() -> None:
    info = schedule_info("dualpipe_v")
    assert info.constraints.stages_per_rank == 2 and info.constraints.microbatches_at_least_stages
    assert "DualPipeV" in info.description
    assert dualpipe_v(3, 6) == get_schedule("dualpipe_v", num_stages=6, num_microbatches=6)


# --- the same order as torch's ScheduleDualPipeV ----------------------------------------------


def torch_dualpipe_v_rows(p: int, m: int) -> list[list[str]]:
    """torch's ScheduleDualPipeV order for p ranks and m microbatches, as its action strings."""
    order = torch_schedule("ScheduleDualPipeV", p, 2 * p, m).pipeline_order
    return [[str(a) for a in order[r]] for r in range(p)]


@pytest.mark.parametrize("p, m", SIZES)
def test_dualpipe_v_matches_torch_action_for_action(p: int, m: int) -> None:
    # torch writes an overlapped pair as one action, (0F3;3B1)OVERLAP_F_B.
    s = dualpipe_v(p, m)
    ours = [tokens(s, r, pair="({};{})OVERLAP_F_B") for r in range(p)]
    assert ours == torch_dualpipe_v_rows(p, m)


# --- simulated bubble ------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_stage", [1, 2, 4])
def test_dualpipe_v_bubble_against_1f1b_and_zb_v(p: int, m_per_stage: int) -> None:
    # Equal costs: F = I = W = 1 per full stage, so 1/2 per V chunk (same model, same ranks).
    m = 2 * p * m_per_stage
    chunk, stage = StageCost(0.5, 0.5, 0.5), StageCost(1, 1, 1)
    one = simulate(get_schedule("1f1b", num_ranks=p, num_microbatches=m), stage)
    zb_h1 = simulate(get_schedule("zb_h1", num_ranks=p, num_microbatches=m), stage)
    zb_v = simulate(get_schedule("zb_v", num_ranks=p, num_microbatches=m), chunk)
    back_to_back = simulate(dualpipe_v(p, m), chunk)
    overlapped = simulate(dualpipe_v(p, m), chunk, overlap=1)
    # Run as pipesplit's executors run it (each pair forward, then backward), DualPipeV idles
    # far less than 1F1B and ZB-H1 and exactly as little as ZB-V: (p-1) chunk-forwards a rank.
    assert back_to_back.bubble_fraction < zb_h1.bubble_fraction < one.bubble_fraction
    assert back_to_back.step_time == zb_v.step_time
    assert back_to_back.idle == pytest.approx(zb_v.idle)
    assert back_to_back.idle == pytest.approx([0.5 * (p - 1)] * p)
    # With the pairs overlapped, which is what DualPipe is built for, every step is shorter than
    # ZB-V's, and from 3 ranks on the ranks also idle less in total (for 2 ranks: equally).
    assert overlapped.step_time < zb_v.step_time
    assert sum(overlapped.idle) < sum(zb_v.idle) if p >= 3 else sum(overlapped.idle) == pytest.approx(sum(zb_v.idle))
    if p >= 8:
        assert overlapped.bubble_fraction < zb_v.bubble_fraction
    # The price: one chunk-activation more than ZB-V on every rank.
    assert back_to_back.peak_activations == (2 * p + 1,) * p
    assert zb_v.peak_activations == (2 * p,) * p


# --- training through the local runtime ---------------------------------------------------------


@pytest.mark.parametrize("case_name, ranks, m", [("long_skip", 2, 4), ("gpt_tied", 2, 6), ("mlp", 3, 6),
                                                  ("long_skip", 4, 8)])
def test_dualpipe_v_trains_like_gradient_accumulation(case_name: str, ranks: int, m: int) -> None:
    torch.manual_seed(0)
    case = CASE_BY_NAME[case_name]
    model = case.build()
    args, kwargs = case.inputs(2)
    prog = pipesplit.compile(model, args, example_kwargs=kwargs, num_stages=2 * ranks, progress=False)
    pipe = pipesplit.Pipeline(prog, "dualpipe_v", num_microbatches=m, loss_fn=dot_loss, loss_reduction="sum",
                              num_ranks=ranks)
    assert pipe.schedule.overlap and {a.kind for r in pipe.schedule.actions for a in r} == {F, B, I, W}
    check_training(model, pipe, [case.inputs(2 * m), case.inputs(2 * m)], m=m)


def test_pipeline_refuses_too_few_microbatches_for_dualpipe_v() -> None:
    case = CASE_BY_NAME["mlp"]
    prog = pipesplit.compile(case.build(), case.inputs(2)[0], num_stages=4, progress=False)
    with pytest.raises(ScheduleError, match=r"num_microbatches=2 for num_stages=4 \(num_ranks=2\). Use num_microbatches=4"):
        pipesplit.Pipeline(prog, "dualpipe_v", num_microbatches=2, loss_fn=dot_loss, num_ranks=2)


# --- torch's schedule CSV ----------------------------------------------------------------------

BUILTINS = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v", "dualpipe_v")


def build(name: str, p: int, m: int) -> Schedule:
    spr = schedule_info(name).constraints.stages_per_rank or 2
    return get_schedule(name, num_stages=spr * p, num_ranks=p, num_microbatches=m)


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("comm", [False, True])
def test_export_reads_back_in_torchs_own_loader(name: str, comm: bool, tmp_path) -> None:
    s = build(name, 3, 6)
    s = with_communication(s) if comm else s
    path = to_torch_csv(s, tmp_path / f"{name}.csv")
    runtime = torch_loads(path, s.num_ranks, s.num_stages, s.num_microbatches, comm)
    order = runtime.pipeline_order_with_comms if comm else runtime.pipeline_order
    assert [[str(a) for a in order[r]] for r in range(s.num_ranks)] == to_torch_actions(s)
    assert runtime.stage_index_to_group_rank == dict(enumerate(s.stage_to_rank))
    assert from_torch_csv(path, name=s.name) == s
    for waits in (False, True):  # both releases' formats read back
        assert from_torch_csv(to_torch_csv(s, tmp_path / f"{waits}.csv", send_waits=waits), name=s.name) == s


def _flat(row: list[str]) -> list[str]:
    """A row's actions, each overlapped pair ``(a;b)OVERLAP_F_B`` as its two actions."""
    return [a for cell in row for a in (cell[1:cell.index(")")].split(";") if cell.startswith("(") else [cell])]


@pytest.mark.parametrize("name", BUILTINS)
def test_each_send_gets_one_wait_where_torch_2_15_puts_it(name: str) -> None:
    s = with_communication(build(name, 3, 6))
    for rank, row in enumerate(to_torch_actions(s, send_waits=True)):
        flat = _flat(row)
        assert [a for a in flat if "WAIT" not in a] == _flat(to_torch_actions(s, send_waits=False)[rank])
        sends = [a for a in flat if "SEND_" in a and "WAIT" not in a]
        waits = [a for a in flat if "WAIT_SEND_" in a]
        assert sorted(w.replace("WAIT_", "") for w in waits) == sorted(sends), f"rank {rank}: one wait per send"
        for wait in waits:
            send = wait.replace("WAIT_", "")
            assert flat.index(wait) > flat.index(send), f"rank {rank}: {wait} before its send"
            stage, mb = send.split("SEND_")[0], send.split("SEND_")[1][1:]
            backward = [a for a in (f"{stage}B{mb}", f"{stage}I{mb}") if a in flat]
            if "SEND_F" in send and backward:  # right after the backward that proves the peer received it
                assert flat.index(wait) == flat.index(backward[0]) + 1, f"rank {rank}: {wait}"
            else:  # a backward send's, at the end of the row
                assert flat.index(wait) >= len(flat) - len(waits), f"rank {rank}: {wait}"


def test_this_torch_refuses_the_other_releases_format(tmp_path) -> None:
    """torch 2.15 refuses a send without a wait; older torch misreads ``1WAIT_SEND_B5`` as the
    weight backward ``1W`` and refuses it: only the installed torch's format (the default) loads."""
    s = with_communication(build("1f1b", 3, 6))
    newer = compat.torch_csv_send_waits()
    path = to_torch_csv(s, tmp_path / "other.csv", send_waits=not newer)
    with pytest.raises((ValueError, AssertionError), match="no matching wait" if newer else "Backward Weight"):
        torch_loads(path, s.num_ranks, s.num_stages, s.num_microbatches, comm=True)
    assert from_torch_csv(path, name=s.name) == s


def test_export_writes_pairs_as_torch_overlap_actions(tmp_path) -> None:
    s = dualpipe_v(2, 4)
    text = to_torch_csv(s, tmp_path / "d.csv").read_text()
    assert text.splitlines()[0] == ("0F0,0F1,0F2,3F0,3I0,3W0,3F1,(0F3;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B,3B2,"
                                    "(3F3;0B1)OVERLAP_F_B,3B3,0I2,0W2,0I3,0W3")
    parsed = schedules_module()._Action.from_str("(0F3;3B1)OVERLAP_F_B")
    assert [str(a) for a in parsed.sub_actions] == ["0F3", "3B1"]


@pytest.mark.parametrize(
    "cls_name, ours",
    [
        ("ScheduleDualPipeV", ("dualpipe_v", 6, 3, 7)),
        ("ScheduleZBVZeroBubble", ("zb_v", 6, 3, 6)),
        ("ScheduleInterleaved1F1B", ("interleaved_1f1b", 6, 3, 6)),
    ],
)
def test_csv_written_by_torch_loads_and_validates(cls_name: str, ours: tuple, tmp_path) -> None:
    # torch's own class builds its order and writes it with its own _dump_csv.
    name, num_stages, num_ranks, m = ours
    torch_schedule(cls_name, num_ranks, num_stages, m)._dump_csv(str(tmp_path / "compute.csv"), format="compute_only")
    loaded = from_torch_csv(tmp_path / "compute.csv")  # validates
    assert loaded == dataclasses.replace(get_schedule(name, num_stages=num_stages, num_ranks=num_ranks, num_microbatches=m),
                                         name="compute")
    # torch's lowering adds its sends and receives, FSDP's UNSHARD/RESHARD/REDUCE_GRAD, and (2.15) the send waits.
    lowered = torch_loads(tmp_path / "compute.csv", num_ranks, num_stages, m, comm=False)
    lowered._dump_csv(str(tmp_path / "comms.csv"), format="compute_comms")
    with pytest.raises(ScheduleError, match=r"comms.csv'.*Rank 0, cell 0 \('0UNSHARD'\): UNSHARD is torch's FSDP "
                                            r"action.*Pass drop_fsdp=True"):
        from_torch_csv(tmp_path / "comms.csv")
    comms = from_torch_csv(tmp_path / "comms.csv", drop_fsdp=True)  # validates, sends and receives included
    assert comms.has_communication and comms.overlap == loaded.overlap
    assert comms.compute_only().actions == loaded.actions


def test_torch_actions_map_onto_pipesplit_actions() -> None:
    s = from_torch_actions([["0F0", "", "0F1", "0SEND_F0", "0SEND_F1", "0RECV_B1", "(0F2;0I1)OVERLAP_F_B", "0W1",
                             "0SEND_F2", "0RECV_B0", "0B0", "0RECV_B2", "0B2", "0REDUCE_GRAD"],
                            ["1UNSHARD", "1RECV_F0", "1F0", "1RECV_F1", "1F1", "1I1", "1W1", "1SEND_B1", "1B0",
                             "1SEND_B0", "1RECV_F2", "1F2", "1B2", "1SEND_B2", "1RESHARD"]], drop_fsdp=True)
    assert [str(a) for a in s.actions[0]][:7] == ["0F0", "0F1", "0SEND_F0", "0SEND_F1", "0RECV_B1", "0F2", "0I1"]
    assert s.overlap == ((Action.parse("0F2"), Action.parse("0I1")),)
    assert (s.num_stages, s.num_ranks, s.num_microbatches, s.stage_to_rank) == (2, 2, 3, (0, 1))
    assert {a.kind for rank in s.actions for a in rank} == set(ActionKind)


@pytest.mark.parametrize(
    "cell, message",
    [
        ("0RESHARD", r"RESHARD is torch's FSDP action"),
        ("0REDUCE_GRAD", r"REDUCE_GRAD is torch's FSDP action"),
        ("0X0", r"'X' is not an action kind pipesplit can run; known: F, B, I, W, SEND_F"),
        ("0F", r"'0F' names no microbatch; F actions need one, e.g. '0F0'"),
        ("F0", r"cannot read 'F0' as a torch action"),
        ("(0F0;0B0)FUSED", r"torch groups actions only as \(a;b\)OVERLAP_F_B, not 'FUSED'"),
        ("()OVERLAP_F_B", r"an OVERLAP_F_B group with no actions"),
    ],
)
def test_from_torch_refuses_what_pipesplit_cannot_run(cell: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(f"Rank 0, cell 1 ({cell!r}): ") + message):
        from_torch_actions([["0F0", cell, "0B0"]])
