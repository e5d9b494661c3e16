"""The local executor under NCCL's semantics (transport="rendezvous"), senders' buffers, and rank devices."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

import pipesplit
from pipesplit.runtime.comm import distributed
from pipesplit.runtime.comm.exchange import program_edges
from pipesplit.runtime.comm.rendezvous import RendezvousTransport
from pipesplit.runtime.comm.transport import LocalTransport, Parcel
from pipesplit.schedules.issue import issue, proven
from pipesplit.schedules.rendezvous import Message, comm_plan
from tests.training import check_training, dot_loss
from tests.zoo import CASE_BY_NAME

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v", "dualpipe_v"]
MULTI = {"interleaved_1f1b", "looped_bfs", "zb_v", "dualpipe_v"}  # several stages per rank


def _pipe(model_name: str, schedule: str, stages: int = 4, **kw):
    torch.manual_seed(0)
    case = CASE_BY_NAME[model_name]
    model = case.build()
    args, kwargs = case.inputs(2)
    prog = pipesplit.compile(model, args, example_kwargs=kwargs, num_stages=stages, progress=False)
    kw.setdefault("num_ranks", 2 if schedule in MULTI else None)
    pipe = pipesplit.Pipeline(prog, schedule, loss_fn=dot_loss, loss_reduction="sum", **kw)
    return model, case, pipe


# ------------------------------------------------------------------ training under rendezvous
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model_name", ["long_skip", "gpt_tied"])
def test_every_schedule_trains_through_the_rendezvous_transport(schedule, model_name):
    """A send waits for its receive and messages pair in order: the runtime's plan neither deadlocks
    nor mismatches, and the step still equals gradient accumulation (skip edges, tied weights)."""
    model, case, pipe = _pipe(model_name, schedule, num_microbatches=4, transport="rendezvous", timeout=60)
    assert isinstance(pipe.transport, RendezvousTransport)
    check_training(model, pipe, [case.inputs(8), case.inputs(8)], m=4)
    pipe.eval()
    out = pipe(*case.inputs(8)[0], **case.inputs(8)[1])
    assert out is not None and pipe.transport.in_flight() == []


# ------------------------------------------------------------------ a bad order is caught
def test_naive_order_times_out_in_the_rendezvous_transport():
    """The order the runtime used before (each send alone, right after its producer) deadlocks 1F1B
    under NCCL's semantics: the validator says so, and the transport fails instead of hanging."""
    _, case, pipe = _pipe("mlp", "1f1b", stages=2, num_microbatches=4, transport="rendezvous", timeout=1.0)
    naive = comm_plan(pipe.schedule, program_edges(pipe.prog), batched=False)
    with pytest.raises(pipesplit.ScheduleError, match="deadlocks"):
        pipesplit.schedules.issue.check_rendezvous(pipe.schedule, naive)
    pipe._plans["train"] = issue(naive, 0)
    start = time.monotonic()
    with pytest.raises(pipesplit.RuntimeCommError) as info:
        pipe.step(*case.inputs(8)[0], target=torch.randn(8, 4))
    assert time.monotonic() - start < 15
    text = str(info.value)
    assert "timed out" in text and "rank 1" in text and "rank 0" in text and "deadlock" in text
    pipe._plans["train"] = proven(pipe.schedule, comm_plan(pipe.schedule, program_edges(pipe.prog)))  # recovers
    assert pipe.step(*case.inputs(8)[0], target=torch.randn(8, 4)) is not None


def test_receives_ahead_on_every_rank_time_out_as_the_proof_says():
    """What proven() refuses (1F1B with every rank posting receives ahead) hangs under NCCL's semantics:
    the transport that imposes them fails within the timeout instead."""
    _, case, pipe = _pipe("mlp", "1f1b", stages=2, num_microbatches=4, transport="rendezvous", timeout=1.0)
    plan = comm_plan(pipe.schedule, program_edges(pipe.prog))
    with pytest.raises(pipesplit.ScheduleError, match="deadlocks"):
        pipesplit.schedules.issue.check_issued(pipe.schedule, issue(plan, lookahead=1))
    pipe._plans["train"] = issue(plan, lookahead=1)
    with pytest.raises(pipesplit.RuntimeCommError, match="timed out"):
        pipe.step(*case.inputs(8)[0], target=torch.randn(8, 4))


def _threads(*jobs):
    errors: list[BaseException | None] = [None] * len(jobs)

    def run(i, job):
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - collected for the test
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return errors


def test_two_ranks_that_both_send_first_time_out_naming_each_other():
    t = RendezvousTransport(timeout=0.5)
    to_1, to_0 = Message("F", "x", 0, 1, 0), Message("B", "x", 0, 1, 0)

    def rank(me, peer, out, into):
        t.exchange(me, [(out, Parcel(torch.ones(2)), peer)], [])  # unbatched blocking send first
        t.exchange(me, [], [(into, peer, ((2,), torch.float32, torch.device("cpu")))])

    errors = _threads(lambda: rank(0, 1, to_1, to_0), lambda: rank(1, 0, to_0, to_1))
    assert all(isinstance(e, pipesplit.RuntimeCommError) for e in errors), errors
    assert "until rank 1 posts" in str(errors[0]) and "until rank 0 posts" in str(errors[1])
    assert any("is itself blocked" in str(e) for e in errors)  # the first to give up sees the other waiting
    t.reset()
    got = {}

    def batched(me, peer, out, into):  # the same ops, posted together: fine
        got[me] = t.exchange(me, [(out, Parcel(torch.full((2,), float(me))), peer)],
                             [(into, peer, ((2,), torch.float32, torch.device("cpu")))])[0].value

    assert _threads(lambda: batched(0, 1, to_1, to_0), lambda: batched(1, 0, to_0, to_1)) == [None, None]
    assert got[0].tolist() == [1.0, 1.0] and got[1].tolist() == [0.0, 0.0]


def test_messages_posted_in_different_orders_are_an_error_not_a_wrong_tensor():
    t = RendezvousTransport(timeout=5)
    a, b = Message("F", "x", 0, 1, 0), Message("F", "x", 0, 1, 1)
    like = ((1,), torch.float32, torch.device("cpu"))
    errors = _threads(lambda: t.exchange(0, [(a, Parcel(torch.zeros(1)), 1), (b, Parcel(torch.ones(1)), 1)], []),
                      lambda: t.exchange(1, [], [(b, 0, like), (a, 0, like)]))
    assert any(isinstance(e, pipesplit.RuntimeCommError) and "pair in the order" in str(e) for e in errors), errors


def test_a_ranks_batches_run_one_after_another_as_on_one_nccl_stream():
    """A receive posted early holds up the rank's later batches: two ranks that each post a receive
    before the send the other is waiting for deadlock, even though posting never blocks."""
    like = ((1,), torch.float32, torch.device("cpu"))
    a, b = Message("B", "x", 0, 1, 0), Message("F", "x", 0, 1, 1)  # a: rank 1 -> 0, b: rank 0 -> 1

    def run(t, first_rank1):
        def rank0():
            t.post(0, [], [(a, 1, like)])
            t.wait(t.post(0, [(b, Parcel(torch.ones(1)), 1)], []))

        def rank1():
            batches = [lambda: t.post(1, [], [(b, 0, like)]), lambda: t.post(1, [(a, Parcel(torch.zeros(1)), 0)], [])]
            handles = [post() for post in (batches if first_rank1 == "receive" else batches[::-1])]
            for h in handles:
                t.wait(h)

        return _threads(rank0, rank1)

    errors = run(RendezvousTransport(timeout=0.5), "receive")
    assert all(isinstance(e, pipesplit.RuntimeCommError) for e in errors), errors
    assert run(RendezvousTransport(timeout=5), "send") == [None, None]  # rank 1 sends first: no cycle


# ------------------------------------------------------------------ senders free their buffers
class Tracking:
    """Wraps a transport: after every batch, how many tensors ever sent are still alive."""

    def __init__(self, transport):
        self.inner, self.sent, self.alive_after = transport, [], []

    def post(self, rank, sends, recvs):
        self.sent += [weakref.ref(p.value) for _, p, _ in sends]
        return self.inner.post(rank, sends, recvs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("transport", ["auto", "rendezvous"])
def test_nothing_keeps_sent_tensors_alive_after_the_step(transport):
    _, case, pipe = _pipe("long_skip", "1f1b", num_microbatches=4, transport=transport)
    pipe.transport = tracking = Tracking(pipe.transport)
    pipe.step(*case.inputs(8)[0], target=torch.randn(8, 16))
    assert tracking.sent, "nothing was sent"
    assert [r for r in tracking.sent if r() is not None] == []


def test_rendezvous_sender_holds_nothing_once_its_batch_returns():
    t = RendezvousTransport(timeout=5)
    msg, like = Message("F", "x", 0, 1, 0), ((4,), torch.float32, torch.device("cpu"))
    refs, got = [], []

    def send():
        value = torch.ones(4)
        refs.append(weakref.ref(value))
        t.exchange(0, [(msg, Parcel(value), 1)], [])

    _threads(send, lambda: got.extend(t.exchange(1, [], [(msg, 0, like)])))
    assert refs[0]() is not None and got[0].value is refs[0]()  # alive only through the receiver
    got.clear()
    assert refs[0]() is None and t.in_flight() == []


def test_local_mailbox_lets_go_when_the_receiver_takes_it():
    t = LocalTransport(timeout=5)
    msg, value = Message("F", "x", 0, 1, 0), torch.ones(3)
    ref = weakref.ref(value)
    t.exchange(0, [(msg, Parcel(value), 1)], [])
    del value
    (parcel,) = t.exchange(1, [], [(msg, 0, None)])
    assert t._box == {}
    del parcel
    assert ref() is None


# ------------------------------------------------------------------ one device per rank
def test_pick_device_gives_each_rank_its_own_gpu():
    cuda = torch.device
    assert distributed.pick_device("nccl", True, 8, 5) == cuda("cuda", 5)
    assert distributed.pick_device(None, True, 2, 1) == cuda("cuda", 1)
    assert distributed.pick_device(None, False, 0, 1) == cuda("cpu")
    assert distributed.pick_device("gloo", True, 8, 5) == cuda("cpu")
    assert distributed.pick_device("cpu:gloo,cuda:nccl", True, 8, 5) == cuda("cuda", 5)  # torch's default on GPUs
    with pytest.raises(pipesplit.PipesplitError, match="--nproc-per-node 2"):
        distributed.pick_device("nccl", True, 2, 2)
    with pytest.raises(pipesplit.PipesplitError, match="gloo"):
        distributed.pick_device("nccl", False, 0, 0)


def test_init_device_sets_local_rank_current(monkeypatch):
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert distributed.init_device("nccl") == torch.device("cuda", 3)
    assert calls == [torch.device("cuda", 3)]
    assert distributed.init_device("gloo") == torch.device("cpu") and len(calls) == 1
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(pipesplit.PipesplitError, match="LOCAL_RANK"):
        distributed.init_device("nccl")


def test_init_device_without_cuda_stays_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device without CUDA"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.init_device() == torch.device("cpu")


def test_stages_compiled_for_any_gpu_go_to_the_ranks_gpu():
    gpu = torch.device("cuda", 2)
    for compiled in ("cuda", "cuda:0", "cuda:2", "cuda:7"):
        assert distributed.rank_device(torch.device(compiled), gpu) == gpu
    assert distributed.rank_device(torch.device("cpu"), gpu) == torch.device("cpu")
    with pytest.raises(pipesplit.PipesplitError, match="no GPU"):
        distributed.rank_device(torch.device("cuda", 0), None)


def test_move_stages_keeps_the_objects_and_shared_memory():
    """Stand-in for a GPU on CPU: moving to 'meta' changes only where the data lives."""
    torch.manual_seed(0)
    case = CASE_BY_NAME["gpt_tied"]
    prog = pipesplit.compile(case.build(), case.inputs(2)[0], num_stages=2, progress=False)
    before = {id(t) for t in prog.stage_entries[1].values()}
    params = list(prog.stages[1].module.parameters())
    distributed.move_stages(prog, [1], torch.device("meta"))
    assert prog.stages[1].device == torch.device("meta")
    assert {id(t) for t in prog.stage_entries[1].values()} == before  # optimizers keep their parameters
    assert all(p.device.type == "meta" for p in params)
    assert all(t.device.type == "meta" for t in prog.stage_entries[1].values())
    assert all(t.device.type == "cpu" for t in prog.stage_entries[0].values())


def test_place_rank_moves_gpu_stages_to_the_ranks_gpu_and_refuses_what_the_backend_cannot_move(monkeypatch):
    """The placement a distributed Pipeline does, with the process group and CUDA mocked."""
    from types import SimpleNamespace

    moves = []
    monkeypatch.setattr(distributed, "move_stages", lambda prog, stages, device: moves.append((stages, device)))

    def under(backend, device):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: backend)
        monkeypatch.setattr(distributed, "init_device", lambda b: torch.device(device))

    def stage(i, device):
        return SimpleNamespace(index=i, device=torch.device(device))

    under("nccl", "cuda:1")  # rank 1 of a machine, program compiled with devices=["cuda:0", "cuda:1", "cuda", ...]
    assert distributed.place_rank(None, [stage(1, "cuda:1"), stage(3, "cuda:0"), stage(5, "cuda")]) == torch.device("cuda", 1)
    assert moves == [([3, 5], torch.device("cuda", 1))]
    with pytest.raises(pipesplit.PipesplitError, match="NCCL moves CUDA tensors only"):
        distributed.place_rank(None, [stage(0, "cpu")])
    under("gloo", "cpu")
    with pytest.raises(pipesplit.PipesplitError, match="CPU tensors only"):
        distributed.place_rank(None, [stage(0, "cuda:0")])
    assert distributed.place_rank(None, [stage(0, "cpu")]) == torch.device("cpu")
    under("cpu:gloo,cuda:nccl", "cuda:0")  # torch's default backend on GPU machines: CPU stages go over gloo
    assert distributed.place_rank(None, [stage(0, "cpu")]) == torch.device("cpu")
