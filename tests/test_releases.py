"""A rank lets go of what it sent once its receiver provably has it (pipesplit/schedules/releases.py)."""

from __future__ import annotations

import pytest

from pipesplit.schedules import get_schedule
from pipesplit.schedules.issue import check_issued, proven
from pipesplit.schedules.rendezvous import comm_plan


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb_h1", "interleaved_1f1b"])
def test_a_send_is_released_only_after_its_receiver_waited_for_it(name):
    """Each release is sound (the receiver's wait for that send came before the message that tells the
    sender so was posted), and most sends go before the step's end: on gloo, which cannot poll a send,
    every tensor a rank sent stayed alive until the last turn (a 4-rank GPT's middle rank held 1.41x
    its figure under torchrun, tests/memory_check.py)."""
    kw = dict(num_stages=8, num_ranks=4) if name.startswith("interleaved") else dict(num_stages=4)
    schedule = get_schedule(name, num_microbatches=8, **kw)
    program = proven(schedule, comm_plan(schedule))
    check_issued(schedule, program)
    batches = [[ops for t in turns for ops in t.post] for turns in program]
    waited_at = []  # rank -> batch -> turn that waits for it
    for turns, bs in zip(program, batches):
        at = [len(turns) - 1] * len(bs)
        for k, t in enumerate(turns):
            for i in t.wait:
                at[i] = min(at[i], k)
        waited_at.append(at)
    recv_at = {op.message: (r, i) for r, bs in enumerate(batches) for i, ops in enumerate(bs) for op in ops
               if not op.send}
    posted_at = [[k for k, t in enumerate(turns) for _ in t.post] for turns in program]  # rank -> batch -> turn
    sent_by = {op.message: (r, i) for r, bs in enumerate(batches) for i, ops in enumerate(bs) for op in ops if op.send}
    released = total = 0
    for r, turns in enumerate(program):
        sends = [i for i, ops in enumerate(batches[r]) if ops and all(op.send for op in ops)]
        total += len(sends)
        for k, t in enumerate(turns):
            for i in t.release:
                released += 1
                assert i in sends and k < waited_at[r][i]
                for op in batches[r][i]:  # the receiver had it: its wait came at or before a turn whose
                    q, j = recv_at[op.message]  # later post reached this rank by turn k
                    assert waited_at[q][j] < len(program[q]) - 1 or k == len(turns) - 1
                    # a message from q, posted in a turn after the one q waited for this send in (a turn posts
                    # before it waits), that this rank waited for by turn k
                    told = [c for m, (rr, c) in recv_at.items() if rr == r and sent_by[m][0] == q
                            and posted_at[q][sent_by[m][1]] > waited_at[q][j]]
                    assert any(waited_at[r][c] <= k for c in told), (name, r, k, op.message)
    assert released >= total // 2, (released, total)
