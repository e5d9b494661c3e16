"""An in-process transport that imposes NCCL's point-to-point semantics on the local executor.

``Pipeline(..., transport="rendezvous")`` runs the worker threads through it, so an order
that NCCL would deadlock on, or pair wrongly, fails on a CPU here:

* a send completes only when the peer has posted the matching receive (no buffering);
* messages between two ranks match in the order they were posted, per direction: the
  k-th send from rank a to rank b meets the k-th receive at b from a, whatever it carries
  (no tags); a mismatch is an error, where NCCL would hand over the wrong tensor;
* the ops of one batch are posted together, and a rank's batches run one after another,
  as on NCCL's one stream per communicator: a batch's ops can meet their partners only
  once every batch the rank posted before it has completed.

Posting never blocks (:meth:`post`); :meth:`wait` does, until the batch has completed. A
batch that is still waiting after ``timeout`` seconds raises RuntimeCommError naming the
peer it waits on and what that peer is blocked on itself.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pipesplit.errors import RuntimeCommError
from pipesplit.runtime.comm.transport import Aborted, InProcessTransport, Parcel, Recvs, Sends
from pipesplit.schedules.rendezvous import Message, Op


@dataclass(eq=False)
class _Posted:
    op: Op
    rank: int
    parcel: Parcel | None = None  # a send's payload until it meets its receive; then the receive's
    done: bool = False


@dataclass(eq=False)
class _Batch:
    rank: int
    ops: list[_Posted] = field(default_factory=list)
    running: bool = False  # its ops are out for matching (every earlier batch of the rank completed)

    @property
    def done(self) -> bool:
        return all(p.done for p in self.ops)


class RendezvousTransport(InProcessTransport):
    """Rendezvous sends, FIFO matching per ordered rank pair, no tags, one batch at a time per rank (see the module)."""

    def __init__(self, timeout: float):
        super().__init__(timeout)
        self._sends: dict[tuple[int, int], deque[_Posted]] = {}  # (from, to) -> running sends not yet met
        self._recvs: dict[tuple[int, int], deque[_Posted]] = {}  # (from, to) -> running receives not yet met
        self._queue: dict[int, deque[_Batch]] = {}  # rank -> its batches not completed, the running one first

    def post(self, rank: int, sends: Sends, recvs: Recvs) -> _Batch:
        batch = _Batch(rank, [_Posted(Op(True, msg, peer), rank, parcel) for msg, parcel, peer in sends]
                       + [_Posted(Op(False, msg, peer), rank) for msg, peer, _ in recvs])
        if batch.ops:
            with self._cond:
                self._queue.setdefault(rank, deque()).append(batch)
                self._settle()
                self._cond.notify_all()
        return batch

    def wait(self, batch: _Batch) -> list[Parcel]:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while not batch.done:
                if self.failed is not None:
                    raise Aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out(batch.rank)
                self._cond.wait(min(left, 0.05))
        return [p.parcel for p in batch.ops if not p.op.send]  # type: ignore[misc]

    def done(self, batch: _Batch) -> bool:
        with self._cond:
            return batch.done

    def _settle(self) -> None:
        """Start each rank's oldest batch, match what can meet, retire completed batches; until nothing moves."""
        moved = True
        while moved:
            moved = False
            for queue in self._queue.values():
                while queue and queue[0].running and queue[0].done:
                    queue.popleft()
                    moved = True
                if queue and not queue[0].running:
                    queue[0].running = True
                    moved = True
                    for p in queue[0].ops:
                        pair = (p.rank, p.op.peer) if p.op.send else (p.op.peer, p.rank)
                        (self._sends if p.op.send else self._recvs).setdefault(pair, deque()).append(p)
                        self._match(pair)

    def _match(self, pair: tuple[int, int]) -> None:
        """Pair the oldest unmet send and receive of ``pair``, as long as both exist."""
        sends, recvs = self._sends.get(pair), self._recvs.get(pair)
        while sends and recvs:
            s, r = sends.popleft(), recvs.popleft()
            if s.op.message != r.op.message:
                error = RuntimeCommError(
                    f"rank {pair[0]}'s next message to rank {pair[1]} is the {s.op.message.describe()}, but rank "
                    f"{pair[1]}'s next receive from rank {pair[0]} expects the {r.op.message.describe()}. Without "
                    "tags (NCCL) the messages between two ranks pair in the order they are posted, so this would "
                    "hand over the wrong tensor; both ranks must post them in the same order "
                    "(validate(schedule, semantics='rendezvous') checks a schedule for this)."
                )
                self.failed = error
                self._cond.notify_all()
                raise error
            r.parcel, s.parcel = s.parcel, None  # the sender keeps no reference to what it sent
            s.done = r.done = True

    def _running(self, rank: int) -> _Batch | None:
        queue = self._queue.get(rank)
        return queue[0] if queue else None

    def _timed_out(self, rank: int) -> RuntimeCommError:
        running = self._running(rank)
        assert running is not None  # a rank waiting on a batch has one not completed
        stuck = next(p for p in running.ops if not p.done)
        peer = stuck.op.peer
        theirs = self._running(peer)
        doing = (f"rank {peer} is itself blocked in a batch that must [{'; '.join(str(p.op) for p in theirs.ops)}]"
                 if theirs else f"rank {peer} has no communication in flight (still computing, or finished)")
        return RuntimeCommError(
            f"rank {rank} timed out after {self.timeout:.0f}s: it cannot {stuck.op} until rank {peer} posts "
            f"the matching {'receive' if stuck.op.send else 'send'} (a send completes only when its receive is "
            f"posted, as with NCCL), and {doing}. If the two wait on each other this is a deadlock: post the sends "
            "and receives the ranks exchange in one batch, or reorder them; raise timeout= if rank "
            f"{peer} is just slow."
        )

    def _clear(self) -> None:
        self._sends.clear()
        self._recvs.clear()
        self._queue.clear()

    def in_flight(self) -> list[Message]:
        """The messages posted and not met yet (for tests and diagnostics)."""
        with self._cond:
            return [p.op.message for q in self._queue.values() for b in q for p in b.ops if not p.done]
