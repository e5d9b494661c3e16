"""One step under each executor: every rank as a thread of this process (local), or this
process's rank with its data-parallel and tied-weight collectives (distributed)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence

import torch

from pipesplit.passes.split.program import SplitProgram
from pipesplit.runtime.comm.collectives import StepCollectives
from pipesplit.runtime.comm.exchange import RankComm, run_rank
from pipesplit.runtime.engine.threads import RankThreads, autocast_scope, autocast_state
from pipesplit.runtime.comm.transport import Aborted
from pipesplit.runtime.engine.worker import StageWorker, StepData
from pipesplit.schedules.issue import Program, Turn
from pipesplit.state import add_back_grads, set_aside_grads


def run_local_step(plan: Program, workers: dict[int, StageWorker], transport: Any, threads: RankThreads | None,
                   like: Callable[[Any], Any], data: StepData) -> None:
    """Run each rank's part of ``plan`` in its thread of ``threads`` and wait for all of them (one
    rank runs in the caller's thread: a hand-off to a thread and back cost ~0.3 ms a step).

    A rank that fails aborts the transport, which stops the others, and its error is raised
    here once every rank has stopped. So is an interrupt of the caller's wait. The caller's
    autocast state (thread-local in torch) applies in every rank.
    """
    errors: list[BaseException] = []
    autocast = autocast_state()

    def check() -> None:
        if transport.failed is not None:  # another rank failed (or the caller was interrupted)
            raise Aborted()

    def work(rank: int) -> None:
        try:
            with autocast_scope(autocast):
                run_rank(plan[rank], workers, RankComm(rank, transport, like), data, check)
        except Aborted:
            pass
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
            transport.abort(e)

    try:
        try:
            if len(plan) == 1:  # one rank: in the caller's thread, in the state a rank thread starts in
                with torch.inference_mode(False), torch.enable_grad(), _caller_device():
                    work(0)
            else:
                assert threads is not None
                threads.run([functools.partial(work, r) for r in range(len(plan))])
        except BaseException as e:  # e.g. KeyboardInterrupt while waiting: stop the ranks, then re-raise
            transport.abort(e)
            if threads is not None:
                threads.wait()
            raise
    finally:
        transport.reset()
        drop_records(workers)
    for s in (w.stream for w in workers.values() if w.stream is not None):
        s.synchronize()
    if errors:
        raise errors[0]
    route_input_grads(data)


@contextlib.contextmanager
def _caller_device() -> Iterator[None]:
    """Give the caller back its current CUDA device (a stage's action makes its own device current)."""
    if not torch.cuda.is_initialized():
        yield
        return
    with torch.cuda.device(torch.cuda.current_device()):
        yield


def drop_records(workers: dict[int, StageWorker]) -> None:
    """Let go of the microbatch records a failed step left (a finished one has let every record go)."""
    for w in workers.values():
        for record in w.saved.values():
            record.release()
        w.saved.clear()


def run_distributed_step(prog: SplitProgram, coll: StepCollectives, turns: Sequence[Turn], comm: RankComm,
                         workers: dict[int, StageWorker], data: StepData, timeout: float) -> None:
    """Run this rank's part of a step, then the collectives: the data-parallel gradient sum of this
    step's gradients only (earlier ones are set aside and added back), the running statistics of the
    global batch on every replica (in training mode, forward-only passes too), and the tied weights'."""
    params = coll.summed_params() if data.training else []
    earlier = set_aside_grads(params)  # the collectives sum this step's gradients only
    for w in workers.values():
        w.backwards_done = 0
    prog.defer_tied_gradients(True)  # stages of this rank sharing a weight: summed in stage order
    stats = None
    try:
        stats = coll.begin_statistics()
        run_rank(turns, workers, comm, data)
        coll.finish_data_parallel(timeout)
        coll.finish_statistics(stats, len(data.inputs))
        stats = None
        if data.training:
            sum_input_grads(data, coll)
    finally:
        coll.restore_statistics(stats)  # a step that failed leaves them as they were
        prog.defer_tied_gradients(False)
        comm.transport.reset()
        drop_records(workers)
    if data.training:
        coll.reduce_tied()
        add_back_grads(params, earlier)


def sum_input_grads(data: StepData, coll: StepCollectives) -> None:
    """Under torchrun: every rank ends the step with each input's whole gradient, as the model's
    backward gives it. A rank has the gradients of its own stages' reads for its replica's
    microbatches; per input that requires grad, those (zeros where none) are summed over the
    pipeline and data-parallel groups, then added into the caller's tensor. Every rank must pass
    the same inputs with the same ``requires_grad``."""
    total: dict[tuple[int, int], torch.Tensor] = {}
    for m, _, where, g in sorted(data.input_grads, key=lambda t: t[:3]):
        total[(m, where)] = g if (m, where) not in total else total[(m, where)] + g
    data.input_grads.clear()
    for where, x in enumerate(data.whole):
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            continue
        mine = [(data.inputs[m][where], g.to(x.device)) for (m, w), g in total.items() if w == where]
        full = torch.zeros_like(x)
        for piece, g in mine:
            if piece is x:  # an unbatched input: every microbatch reads it whole
                full += g
        cut = [(piece, g) for piece, g in mine if piece is not x]
        if cut:  # through the cut into microbatches: each piece's rows of the whole tensor
            (through,) = torch.autograd.grad([p for p, _ in cut], [x], [g for _, g in cut])
            full += through
        summed = full.to(coll.device)
        coll.dist.all_reduce(summed, group=coll.layout.pp_group)
        if coll.layout.dp_group is not None:
            coll.dist.all_reduce(summed, group=coll.layout.dp_group)
        torch.autograd.backward([x], [summed.to(x.device)])


def route_input_grads(data: StepData) -> None:
    """Add the step's input gradients into the caller's tensors as the model's backward would: through
    each microbatch's own tensor (a view of the caller's, or the whole tensor for an unbatched input),
    so ``x.grad`` accumulates the sum over microbatches and a view or a non-leaf passes its gradient
    on to what it came from. One backward for all microbatches: a graph they share upstream (``x =
    a * b`` before the step) is walked once. Gradients of one input are summed in (microbatch,
    stage) order, the same under every schedule."""
    if not data.input_grads:
        return
    total: dict[tuple[int, int], torch.Tensor] = {}
    for m, _, where, g in sorted(data.input_grads, key=lambda t: t[:3]):
        total[(m, where)] = g if (m, where) not in total else total[(m, where)] + g
    data.input_grads.clear()
    pieces = [data.inputs[m][where] for m, where in total]
    torch.autograd.backward(pieces, [g.to(p.device) for p, g in zip(pieces, total.values())])
