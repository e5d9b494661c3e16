"""One rank's communication during a step: the plan's batches, the sends held for them, local hand-offs."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch

from pipesplit.errors import RuntimeCommError
from pipesplit.runtime.transport import Like, Parcel, Transport
from pipesplit.schedules.rendezvous import Edge, Message, Step


def program_edges(prog: Any) -> tuple[Edge, ...]:
    """The tensors crossing between the stages of a SplitProgram, in the order the plan sends them:
    by source stage, its output order, then consumer stage. Sizes derived on every rank do not travel."""
    tensors = [b for b in prog.boundaries if b.kind == "tensor"]
    tensors.sort(key=lambda b: (b.src, prog.stages[b.src].outputs.index(b.name), b.dst))
    return tuple(Edge(b.name, b.src, b.dst, bool(b.requires_grad)) for b in tensors)


class RankComm:
    """What one rank's stages send and receive in one step, in the order of its plan.

    Stages hand their outputs over with :meth:`put` and take their inputs with :meth:`take`;
    :meth:`post` runs the next step of the plan through the transport. A value for a stage of
    another rank waits in the outbox until the plan's batch that sends it; a value for a
    stage of this rank goes straight to the inbox. The plan, not the stages, decides when a
    message moves, so the order the transport sees is the one the plan was proven for; a
    stage that puts or takes something the plan does not move is a bug, reported as one.

    A buffered transport (the local executor's mailboxes: sends never block, messages are
    matched by name) gets each send as soon as it is made instead, so no receiver waits on
    the plan's meeting point; the plan still checks that the stages made what it sends.
    """

    def __init__(self, rank: int, transport: Transport, like: Callable[[Message], Like]):
        self.rank, self.transport, self.like = rank, transport, like
        self.eager = bool(getattr(transport, "buffered", False))
        self._outbox: dict[Message, Parcel] = {}
        self._inbox: dict[Message, Parcel] = {}
        self._sent: set[Message] = set()  # sent eagerly, not yet reached in the plan

    def put(self, msg: Message, value: Any, peer: int, event: Any = None) -> None:
        """Hand ``msg`` (produced on a stream that recorded ``event``) to the stage on rank ``peer``."""
        if peer == self.rank:
            self._inbox[msg] = Parcel(value, event)
        elif self.eager:
            self.transport.exchange(self.rank, [(msg, Parcel(value, event), peer)], [])
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

    def post(self, step: Step) -> None:
        """Post the step's ops as one batch; return once all have completed."""
        sends, recvs = [], []
        for op in step.ops:
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
        if not sends and not recvs:
            return
        got = self.transport.exchange(self.rank, sends, recvs)
        for (msg, _, _), parcel in zip(recvs, got):
            self._inbox[msg] = parcel

    def finish(self) -> None:
        """Check that every value made was sent and every value received was used."""
        if self._outbox or self._inbox or self._sent:
            left = [f"unsent: {m.describe()}" for m in self._outbox] + [f"unused: {m.describe()}" for m in self._inbox]
            left += [f"sent outside the plan: {m.describe()}" for m in self._sent]
            raise RuntimeCommError(f"rank {self.rank} ended the step with {'; '.join(left[:4])}"
                                   f"{' ...' if len(left) > 4 else ''}: the plan and the stages disagree (a pipesplit bug).")


def run_rank(steps: Sequence[Step], workers: Mapping[int, Any], comm: RankComm, data: Any,
             check: Callable[[], None] | None = None) -> None:
    """Run one rank's plan: post each step's batch, then run its action on its stage's worker.

    ``check`` runs before every step (the local executor stops there when another rank failed).
    """
    for step in steps:
        if check is not None:
            check()
        begin = time.perf_counter()
        comm.post(step)
        if step.action is not None:
            workers[step.action.stage].run(step.action, data, comm, begin)
    comm.finish()
