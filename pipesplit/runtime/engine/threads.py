"""The local executor's rank threads, and the thread-local state they take from the caller."""

from __future__ import annotations

import queue
import threading
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch


def autocast_state() -> list[tuple[str, torch.dtype, bool]]:
    """The caller's enabled autocast regions: (device type, dtype, weight cache)."""
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(k, torch.get_autocast_dtype(k), torch.is_autocast_cache_enabled()) for k in kinds
            if torch.is_autocast_enabled(k)]


@contextmanager
def autocast_scope(state: list[tuple[str, torch.dtype, bool]]) -> Iterator[None]:
    with ExitStack() as stack:
        for kind, dtype, cache in state:
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
        yield


def _serve(inbox: queue.SimpleQueue[Any], done: queue.SimpleQueue[Any]) -> None:
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            job()
        finally:
            del job  # hold no reference to the pipeline between steps, so it can be collected
            done.put(None)


def _stop(inboxes: list[queue.SimpleQueue[Any]]) -> None:
    for box in inboxes:
        box.put(None)


class RankThreads:
    """One long-lived daemon thread per rank of the local executor, reused by every step.

    A fresh thread per step made a one-stage CPU step ~10-20% slower than the plain
    model: glibc gives each new thread its own malloc arena, whose memory goes back to
    the OS when the thread ends, so every step page-faulted its activations in again
    (~10k minor faults per step instead of ~1k). The threads stop when the Pipeline is
    garbage-collected.
    """

    def __init__(self, n: int):
        self._inboxes: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(n)]
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0  # jobs handed out and not finished yet
        for r, box in enumerate(self._inboxes):
            threading.Thread(target=_serve, args=(box, self._done), daemon=True, name=f"pipesplit-rank-{r}").start()
        weakref.finalize(self, _stop, self._inboxes)

    def run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run ``jobs[r]`` on thread ``r``, all at once; return when every one has finished."""
        for box, job in zip(self._inboxes, jobs):
            box.put(job)
            self._pending += 1
        self.wait()

    def wait(self) -> None:
        """Block until every job handed out so far has finished."""
        while self._pending:
            self._done.get()
            self._pending -= 1
