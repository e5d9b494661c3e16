"""One rank's communication during a step: its issued program's batches, the sends held for them, local hand-offs."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch

from pipesplit.errors import RuntimeCommError
from pipesplit.runtime.comm.transport import Like, Parcel, Transport
from pipesplit.schedules.issue import Turn
from pipesplit.schedules.rendezvous import Edge, Message, Op


def program_edges(prog: Any) -> tuple[Edge, ...]:
    """The tensors crossing between the stages of a SplitProgram, in the order the plan sends them:
    by source stage, its output order, then consumer stage. Sizes derived on every rank do not travel."""
    tensors = [b for b in prog.boundaries if b.kind == "tensor"]
    tensors.sort(key=lambda b: (b.src, prog.stages[b.src].outputs.index(b.name), b.dst))
    return tuple(Edge(b.name, b.src, b.dst, bool(b.requires_grad)) for b in tensors)


class RankComm:
    """What one rank's stages send and receive in one step, in the order of its issued program.

    Stages hand their outputs over with :meth:`put` and take their inputs with :meth:`take`;
    :meth:`turn` posts a turn's batches through the transport and waits for the ones its
    action needs (:class:`pipesplit.schedules.issue.Turn`). A value for a stage of another
    rank waits in the outbox until the batch that sends it; a value for a stage of this rank
    goes straight to the inbox. The program, not the stages, decides when a message moves,
    so the order the transport sees is the one that was proven; a stage that puts or takes
    something the program does not move is a bug, reported as one. Sends are not waited
    for: :meth:`release` drops those that completed (and with them the sent tensors), the
    last turn waits for the rest.

    A buffered transport (the local executor's mailboxes: sends never block, messages are
    matched by name) gets each send as soon as it is made instead; the program still
    checks that the stages made what it sends.
    """

    def __init__(self, rank: int, transport: Transport, like: Callable[[Message], Like]):
        self.rank, self.transport, self.like = rank, transport, like
        self.eager = bool(getattr(transport, "buffered", False))
        self._outbox: dict[Message, Parcel] = {}
        self._inbox: dict[Message, Parcel] = {}
        self._sent: set[Message] = set()  # sent eagerly, not yet reached in the program
        self._posted = 0  # batches this step has posted, empty ones included: the plan numbers them so
        self._in_flight: dict[int, tuple[Any, list[Message]]] = {}  # number -> (handle, receives), not yet waited

    def put(self, msg: Message, value: Any, peer: int, event: Any = None) -> None:
        """Hand ``msg`` (produced on a stream that recorded ``event``) to the stage on rank ``peer``."""
        if peer == self.rank:
            self._inbox[msg] = Parcel(value, event)
        elif self.eager:
            self.transport.wait(self.transport.post(self.rank, [(msg, Parcel(value, event), peer)], []))
            self._sent.add(msg)
        else:
            self._outbox[msg] = Parcel(value, event)

    def take(self, msg: Message) -> Any:
        """The value of ``msg``, usable on the current CUDA stream."""
        parcel = self._inbox.pop(msg, None)
        if parcel is None:
            raise RuntimeCommError(
                f"rank {self.rank} needs the {msg.describe()}, which neither arrived nor was made by a stage of "
                "this rank: the communication plan and the stages disagree (a pipesplit bug; please report it)."
            )
        value, event = parcel.value, parcel.event
        if event is not None:  # made on another stream: wait for it, and keep the producer from reusing it
            stream = torch.cuda.current_stream(value.device)
            stream.wait_event(event)
            value.record_stream(stream)
        return value

    def turn(self, turn: Turn) -> None:
        """Post the turn's batches (never blocks), wait for the batches its action needs, then let go of the
        sends known complete by now (their receivers have them: waiting returns at once)."""
        for ops in turn.post:
            self._post(ops)
        for i in turn.wait:
            self._wait(i)
        for i in turn.release:
            self._wait(i)

    def _post(self, ops: Sequence[Op]) -> None:
        sends, recvs = [], []
        for op in ops:
            if not op.send:
                recvs.append((op.message, op.peer, self.like(op.message)))
            elif op.message in self._sent:
                self._sent.remove(op.message)
            elif op.message in self._outbox:
                sends.append((op.message, self._outbox.pop(op.message), op.peer))
            else:
                raise RuntimeCommError(
                    f"rank {self.rank} must send the {op.message.describe()} to rank {op.peer} now, but none of its "
                    "stages has made it: the communication plan and the stages disagree (a pipesplit bug)."
                )
        if sends or recvs:
            self._in_flight[self._posted] = (self.transport.post(self.rank, sends, recvs), [m for m, _, _ in recvs])
        self._posted += 1

    def _wait(self, i: int) -> None:
        batch = self._in_flight.pop(i, None)  # from here on nothing here holds the batch (its sent tensors)
        if batch is None:
            return
        handle, recvs = batch
        for msg, parcel in zip(recvs, self.transport.wait(handle)):
            self._inbox[msg] = parcel

    def release(self) -> None:
        """Let go of every batch that has completed (its receives move to the inbox): from then on nothing
        here holds its sent tensors."""
        for i in [i for i, (handle, _) in self._in_flight.items() if self.transport.done(handle)]:
            self._wait(i)

    def finish(self) -> None:
        """Check that every value made was sent, every batch waited for, and every value received used."""
        if self._outbox or self._inbox or self._sent or self._in_flight:
            left = [f"unsent: {m.describe()}" for m in self._outbox] + [f"unused: {m.describe()}" for m in self._inbox]
            left += [f"sent outside the plan: {m.describe()}" for m in self._sent]
            left += [f"batch {i + 1} never waited for" for i in self._in_flight]
            raise RuntimeCommError(f"rank {self.rank} ended the step with {'; '.join(left[:4])}"
                                   f"{' ...' if len(left) > 4 else ''}: the plan and the stages disagree (a pipesplit bug).")


def run_rank(turns: Sequence[Turn], workers: Mapping[int, Any], comm: RankComm, data: Any,
             check: Callable[[], None] | None = None) -> None:
    """Run one rank's issued program: each turn's batches and waits, then its action on its stage's worker.

    ``check`` runs before every turn (the local executor stops there when another rank failed).
    """
    for turn in turns:
        if check is not None:
            check()
        begin = time.perf_counter()
        comm.turn(turn)
        if turn.action is not None:
            workers[turn.action.stage].run(turn.action, data, comm, begin)
            comm.release()
    comm.finish()
