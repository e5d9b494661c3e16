"""Moving boundary values between ranks: in-process mailboxes, or torch.distributed point-to-point.

A transport posts a batch of sends and receives without waiting (:meth:`Transport.post`,
one batch of a rank's issued program, :mod:`pipesplit.schedules.issue`) and hands back a
handle to wait on (:meth:`Transport.wait`) or to poll (:meth:`Transport.done`); a rank
posts its batches in the order of its program. Values travel as :class:`Parcel`\\ s: the
tensor and, for in-process hand-offs between CUDA streams, the event its producer recorded.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, Sequence

import torch

from pipesplit.errors import RuntimeCommError
from pipesplit.schedules.rendezvous import Message

__all__ = ["Aborted", "DistTransport", "Like", "LocalTransport", "Message", "Parcel", "Transport"]

Like = tuple[tuple[int, ...], torch.dtype, torch.device]
"""Shape, dtype and device of a value to receive."""


@dataclass
class Parcel:
    """A value in flight; ``event`` marks when its producer's stream had computed it (None: no stream)."""

    value: Any
    event: Any = None


Sends = Sequence[tuple[Message, Parcel, int]]  # (message, what, to rank)
Recvs = Sequence[tuple[Message, int, Like]]  # (message, from rank, what to receive into)


class Transport(Protocol):
    def post(self, rank: int, sends: Sends, recvs: Recvs) -> Any:
        """Post ``sends`` and ``recvs`` of ``rank`` as one batch, without waiting; return its handle."""
        ...

    def wait(self, handle: Any) -> list[Parcel]:
        """Block until the batch has completed (or raise after the timeout); its received parcels in order."""
        ...

    def done(self, handle: Any) -> bool:
        """Whether the batch has completed; never blocks."""
        ...

    def reset(self) -> None:
        """Forget what a failed step left behind."""
        ...


class Aborted(Exception):
    """Raised in a worker when another worker failed first."""


class InProcessTransport:
    """What the local executor's transports share: one condition its rank threads wait on, and
    the first failure of any rank, which wakes every waiter (:meth:`abort`)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._cond = threading.Condition()
        self.failed: BaseException | None = None

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self.failed is None:
                self.failed = error
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._clear()
            self.failed = None

    def exchange(self, rank: int, sends: Sends, recvs: Recvs) -> list[Parcel]:
        """Post one batch and wait for it."""
        return self.wait(self.post(rank, sends, recvs))  # type: ignore[attr-defined,no-any-return]

    def _clear(self) -> None:
        """Forget what the step left behind (after a failure)."""


class LocalTransport(InProcessTransport):
    """Mailboxes shared by the worker threads of one process, matched by message; sends never block."""

    buffered = True  # a send may be posted the moment it is made (see RankComm)

    def __init__(self, timeout: float):
        super().__init__(timeout)
        self._box: dict[Message, Parcel] = {}

    def post(self, rank: int, sends: Sends, recvs: Recvs) -> Recvs:
        if sends:
            with self._cond:
                for msg, parcel, _ in sends:
                    self._box[msg] = parcel
                self._cond.notify_all()
        return recvs

    def wait(self, handle: Recvs) -> list[Parcel]:
        return [self._take(msg, peer) for msg, peer, _ in handle]

    def done(self, handle: Recvs) -> bool:
        with self._cond:
            return all(msg in self._box for msg, _, _ in handle)

    def _take(self, msg: Message, peer: int) -> Parcel:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while msg not in self._box:
                if self.failed is not None:
                    raise Aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeCommError(
                        f"timed out after {self.timeout:.0f}s waiting for the {msg.describe()} from the worker of "
                        f"rank {peer}. That rank is stuck or failed; raise timeout= if its work is just slow."
                    )
                self._cond.wait(min(left, 0.05))
            return self._box.pop(msg)  # the mailbox keeps no reference once the receiver has it

    def _clear(self) -> None:
        self._box.clear()


@dataclass(eq=False)
class _Works:
    """A batch in flight on torch.distributed: its works (each with what it carries) and receive buffers."""

    works: list[tuple[Any, str]]
    bufs: list[torch.Tensor]


class DistTransport:
    """Point-to-point over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

    Each batch goes out through ``dist.batch_isend_irecv`` without tags, so messages between
    two ranks pair in issue order on gloo exactly as on NCCL. Only the batch's works hold
    the sent tensors: they are released once the batch is waited on or seen done.
    """

    def __init__(self, timeout: float, global_ranks: list[int] | None = None):
        import torch.distributed as dist

        self.dist = dist
        self.timeout = timeout
        self.rank = dist.get_rank()
        # pipeline rank -> global rank (a replica of a pp x dp mesh); the identity without one
        self.global_ranks = global_ranks if global_ranks is not None else list(range(dist.get_world_size()))

    def post(self, rank: int, sends: Sends, recvs: Recvs) -> _Works:
        dist = self.dist
        ops, what = [], []
        for msg, parcel, peer in sends:
            ops.append(dist.P2POp(dist.isend, parcel.value.detach().contiguous(), self.global_ranks[peer]))
            what.append(f"the {msg.describe()} to rank {peer}")
        bufs = []
        for msg, peer, (shape, dtype, device) in recvs:
            bufs.append(torch.empty(shape, dtype=dtype, device=device))
            ops.append(dist.P2POp(dist.irecv, bufs[-1], self.global_ranks[peer]))
            what.append(f"the {msg.describe()} from rank {peer}")
        if not ops:
            return _Works([], [])
        works = [w for w in dist.batch_isend_irecv(ops) if w is not None]
        del ops  # from here on only the works hold the sent tensors
        if len(works) == len(what):  # gloo: one work per op
            return _Works(list(zip(works, what)), bufs)
        return _Works([(w, "a batch of " + "; ".join(what)) for w in works], bufs)  # NCCL: one per batch

    def wait(self, handle: _Works) -> list[Parcel]:
        while handle.works:
            self._wait(*handle.works[0])
            handle.works.pop(0)  # completed: drop the work and with it the sent tensor
        return [Parcel(b) for b in handle.bufs]

    def done(self, handle: _Works) -> bool:
        return all(w.is_completed() for w, _ in handle.works)

    def exchange(self, rank: int, sends: Sends, recvs: Recvs) -> list[Parcel]:
        """Post one batch and wait for it."""
        return self.wait(self.post(rank, sends, recvs))

    def _wait(self, work: Any, what: str) -> None:
        rank = self.rank
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # gloo raises on timeouts and on closed connections
            raise RuntimeCommError(
                f"rank {rank} gave up on {what} after at most {self.timeout:.0f}s: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. That rank died or never reached this "
                "point; raise timeout= if it is just slow."
            ) from e
        if ok is False:
            raise RuntimeCommError(f"rank {rank} timed out after {self.timeout:.0f}s on {what}.")

    def reset(self) -> None:
        """Nothing to forget: a failed step's handles die with its RankComm."""
