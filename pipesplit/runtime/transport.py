"""Moving boundary values between ranks: in-process mailboxes, or torch.distributed point-to-point."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from pipesplit.errors import RuntimeCommError


@dataclass(frozen=True)
class Message:
    """What one send carries: boundary ``name`` from stage ``src`` to ``dst`` for a microbatch.

    ``direction`` is ``"F"`` for activations (src -> dst) and ``"B"`` for their gradients
    (travelling back from dst to src).
    """

    direction: str
    name: str
    src: int
    dst: int
    microbatch: int

    def describe(self) -> str:
        what = "activation" if self.direction == "F" else "gradient of"
        return f"{what} {self.name!r} (stage {self.src} -> stage {self.dst}, microbatch {self.microbatch})"


class Transport(Protocol):
    def send(self, msg: Message, value: Any, peer: int) -> None: ...
    def recv(self, msg: Message, peer: int, like: tuple[tuple[int, ...], torch.dtype, torch.device] | None) -> Any: ...
    def flush(self) -> None: ...


class Aborted(Exception):
    """Raised in a worker when another worker failed first."""


class LocalTransport:
    """Mailboxes shared by the worker threads of one process; sends never block."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._box: dict[Message, Any] = {}
        self._cond = threading.Condition()
        self.failed: BaseException | None = None

    def send(self, msg: Message, value: Any, peer: int) -> None:
        event = None
        if isinstance(value, torch.Tensor) and value.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(value.device))
        with self._cond:
            self._box[msg] = (value, event)
            self._cond.notify_all()

    def recv(self, msg: Message, peer: int, like: Any = None) -> Any:
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
            value, event = self._box.pop(msg)
        if event is not None:
            stream = torch.cuda.current_stream(value.device)
            stream.wait_event(event)
            value.record_stream(stream)  # the producer's allocator must not reuse it while we compute
        return value

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self.failed is None:
                self.failed = error
            self._cond.notify_all()

    def flush(self) -> None:
        pass


class DistTransport:
    """Point-to-point over ``torch.distributed`` (gloo on CPU, NCCL on GPU); sends are async."""

    def __init__(
        self,
        timeout: float,
        tags: dict[tuple[str, str, int, int], int],
        n_tags: int,
        global_ranks: list[int] | None = None,  # pipeline rank -> global rank (a data-parallel mesh)
        rank: int | None = None,  # this process's pipeline rank
    ):
        import torch.distributed as dist

        self.dist = dist
        self.timeout = timeout
        self.tags, self.n_tags = tags, n_tags
        self.rank = dist.get_rank() if rank is None else rank
        self.global_ranks = global_ranks if global_ranks is not None else list(range(dist.get_world_size()))
        self._pending: list[tuple[Any, torch.Tensor, Message, int]] = []
        self._local: dict[Message, Any] = {}  # hand-offs between two stages of this rank

    def _tag(self, msg: Message) -> int:
        return self.tags[(msg.direction, msg.name, msg.src, msg.dst)] + self.n_tags * msg.microbatch

    def send(self, msg: Message, value: Any, peer: int) -> None:
        if peer == self.rank:
            self._local[msg] = value
            return
        tensor = value.detach().contiguous()
        work = self.dist.isend(tensor, dst=self.global_ranks[peer], tag=self._tag(msg))
        self._pending.append((work, tensor, msg, peer))

    def recv(self, msg: Message, peer: int, like: Any = None) -> Any:
        if peer == self.rank:
            if msg not in self._local:
                raise RuntimeCommError(f"rank {self.rank} needs the {msg.describe()} before its own stage made it.")
            return self._local.pop(msg)
        shape, dtype, device = like
        buf = torch.empty(shape, dtype=dtype, device=device)
        work = self.dist.irecv(buf, src=self.global_ranks[peer], tag=self._tag(msg))
        self._wait(work, msg, peer, "from")
        return buf

    def _wait(self, work: Any, msg: Message, peer: int, way: str) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # gloo raises on timeouts and on closed connections
            raise RuntimeCommError(
                f"rank {self.dist.get_rank()} gave up on the {msg.describe()} {way} rank {peer} "
                f"after at most {self.timeout:.0f}s: {str(e).splitlines()[0] if str(e) else type(e).__name__}. "
                f"Rank {peer} died or never reached this point; raise timeout= if it is just slow."
            ) from e
        if ok is False:
            raise RuntimeCommError(f"rank {self.dist.get_rank()} timed out on the {msg.describe()} {way} rank {peer}.")

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for work, _tensor, msg, peer in pending:
            self._wait(work, msg, peer, "to")
