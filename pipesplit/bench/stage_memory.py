"""What each stage of the local executor really holds at its peak, and what its actions really take.

The planner predicts, per stage, the bytes it holds (``plan.stage_memory_bytes``) and the step a
schedule takes when every stage has a device of its own (``plan.predicted_step_s``). Both are
measured here on a :class:`~pipesplit.Pipeline` of CPU stages, one stage per rank:

- **memory**: every storage an op creates on a rank's thread is counted against that rank from
  its creation until it is freed (activations saved for the backward, gradients, scratch), and
  a value one rank hands another is copied into the receiver's own buffer, as a transport
  between devices does (in one process the receiver would otherwise read the sender's). The
  stage's peak is that count's peak plus what is held across steps: its parameters and
  buffers, and the optimizer's state (measured on a real optimizer).
- **time**: each action's CPU seconds on its rank's thread (``time.thread_time``, torch on one
  intra-op thread), which other processes on a shared machine do not inflate; the step on a
  device per stage is the schedule's step simulated with the measured medians. The wall time of
  the step in this process (its ranks sharing this machine's cores) is reported alongside.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from pipesplit.compat import TorchDispatchMode, pytree
from pipesplit.runtime.comm import exchange
from pipesplit.runtime.comm.exchange import RankComm
from pipesplit.runtime.engine import steps
from pipesplit.runtime.engine.pipeline import Pipeline
from pipesplit.runtime.engine.worker import StageWorker
from pipesplit.schedules import Action, ActionKind, StageCost, simulate


class LiveBytes:
    """Bytes of the storages counted against each rank that are still alive, and each rank's peak."""

    def __init__(self, ranks: int) -> None:
        self.live, self.peak = [0] * ranks, [0] * ranks
        self._refs: dict[int, Any] = {}
        self._lock = threading.RLock()  # a storage freed while counting calls _free on this thread

    def count(self, rank: int, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if size == 0 or key in self._refs:
                return
            self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key, size, rank))
            self.live[rank] += size
            self.peak[rank] = max(self.peak[rank], self.live[rank])

    def _freed(self, key: int, size: int, rank: int, _: Any) -> None:
        with self._lock:
            if self._refs.pop(key, None) is not None:
                self.live[rank] -= size

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak = list(self.live)


class _Counting(TorchDispatchMode):
    """Counts every CPU storage an op creates on this thread against ``rank``."""

    def __init__(self, live: LiveBytes, rank: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counter, self.rank = live, rank

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in new_storages(out, (args, kwargs)):
            self.counter.count(self.rank, t)
        return out


def new_storages(out: Any, inputs: Any) -> list[torch.UntypedStorage]:
    """The CPU storages among ``out``'s tensors that none of ``inputs``' tensors already had: a view (a
    parameter's ``t()``) or an in-place write allocates nothing. Counting a parameter's view as new had
    charged a step one copy of the weights it reads (the parameter is counted with what persists)."""
    had = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    return [t.untyped_storage() for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in had]


@dataclass
class Measured:
    """Per stage (= rank): peak bytes in a step beyond what persists, and actions' CPU seconds."""

    step_peak: list[int]  # the most bytes counted against the stage during a step (max over steps)
    persistent: list[int]  # parameters, buffers and optimizer state
    seconds: dict[tuple[int, ActionKind], list[float]] = field(default_factory=dict)
    wall_steps: list[float] = field(default_factory=list)

    @property
    def peak(self) -> list[int]:
        """The stage's measured peak: what persists plus the step's peak."""
        return [a + b for a, b in zip(self.persistent, self.step_peak)]

    def stage_costs(self, num_stages: int) -> list[StageCost]:
        """Median seconds per action kind; a full backward B is charged as its I (W none)."""
        def med(s: int, kind: ActionKind) -> float:
            got = self.seconds.get((s, kind))
            return statistics.median(got) if got else 0.0

        out = []
        for s in range(num_stages):
            b = med(s, ActionKind.FULL_BACKWARD)
            out.append(StageCost(med(s, ActionKind.FORWARD), b + med(s, ActionKind.BACKWARD_INPUT),
                                 med(s, ActionKind.BACKWARD_WEIGHT)))
        return out


def persistent_bytes(pipe: Pipeline, optimizer: torch.optim.Optimizer | None,
                     stages: list[int] | None = None) -> list[int]:
    """Per stage (of ``stages``, default all): parameters and buffers, and the optimizer's state for the
    stage's parameters."""
    state = optimizer.state if optimizer is not None else {}
    out = []
    for stage in (pipe.prog.stages if stages is None else [pipe.prog.stages[s] for s in stages]):
        seen: set[int] = set()
        total = 0
        tensors = [*stage.module.parameters(), *stage.module.buffers()]
        tensors += [v for p in stage.module.parameters() for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        out.append(total)
    return out


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def counting_memory(live: LiveBytes) -> Iterator[None]:
    """While open, each rank of a local Pipeline's step counts what it allocates, and takes its own
    copy of every tensor another rank hands it."""
    run_rank, take = exchange.run_rank, RankComm.take

    def counted_rank(turns: Any, workers: Any, comm: RankComm, data: Any, check: Any = None) -> None:
        with _Counting(live, comm.rank):
            run_rank(turns, workers, comm, data, check)

    def own_copy(self: RankComm, msg: Any) -> Any:
        value = take(self, msg)
        return value.clone() if isinstance(value, torch.Tensor) else value

    with _patched(steps, "run_rank", counted_rank), _patched(RankComm, "take", own_copy):
        yield


@contextlib.contextmanager
def timing_actions(seconds: dict[tuple[int, ActionKind], list[float]]) -> Iterator[None]:
    """While open, every action a StageWorker runs appends its thread's CPU seconds to ``seconds``."""
    run = StageWorker.run

    def timed(self: StageWorker, action: Action, *args: Any, **kwargs: Any) -> None:
        start = time.thread_time()
        run(self, action, *args, **kwargs)
        seconds.setdefault((action.stage, action.kind), []).append(time.thread_time() - start)

    with _patched(StageWorker, "run", timed):
        yield


def measure_pipeline(
    pipe: Pipeline, batch: Callable[[int], tuple[tuple[Any, ...], Any]], *, optimizer: torch.optim.Optimizer | None,
    memory_steps: int = 2, timed_steps: int = 5, warmup: int = 1,
) -> Measured:
    """Run training steps of ``pipe`` (``batch(i)`` gives step ``i``'s inputs and target): ``warmup``
    plain ones, ``memory_steps`` counting memory, ``timed_steps`` timing actions (and the wall step).
    Gradients are let go before each step and the optimizer steps after it, as in training."""
    if any(s.device.type != "cpu" for s in pipe.prog.stages) or pipe.schedule.num_ranks != pipe.prog.num_stages:
        raise ValueError("measure_pipeline measures CPU stages, one per rank")
    i = 0

    def step() -> None:
        nonlocal i
        args, target = batch(i)
        i += 1
        pipe.zero_grad(set_to_none=True)
        pipe.step(*args, target=target)
        if optimizer is not None:
            optimizer.step()

    for _ in range(warmup):
        step()
    k = pipe.prog.num_stages
    live = LiveBytes(k)
    peaks = [0] * k
    for _ in range(memory_steps):
        pipe.zero_grad(set_to_none=True)
        live.reset_peaks()
        with counting_memory(live):
            step()
        peaks = [max(a, b) for a, b in zip(peaks, live.peak)]
    out = Measured(peaks, persistent_bytes(pipe, optimizer))
    with timing_actions(out.seconds):
        for _ in range(timed_steps):
            start = time.perf_counter()
            step()
            out.wall_steps.append(time.perf_counter() - start)
    return out


def measure_rank(
    pipe: Pipeline, batch: Callable[[int], tuple[tuple[Any, ...], Any]], stage: int, *,
    optimizer: torch.optim.Optimizer | None, memory_steps: int = 1, warmup: int = 2,
) -> int:
    """Under torchrun, with one stage on this rank: its peak over ``memory_steps`` training steps (after
    ``warmup`` plain ones): every storage this process allocates during a step (receive buffers posted
    ahead and sends not yet let go of included), plus its parameters, buffers and optimizer state."""
    live, peak = LiveBytes(1), 0

    def step(i: int) -> None:
        args, target = batch(i)
        pipe.zero_grad(set_to_none=True)
        pipe.step(*args, target=target)
        if optimizer is not None:
            optimizer.step()

    for i in range(warmup):
        step(i)
    for i in range(warmup, warmup + memory_steps):
        pipe.zero_grad(set_to_none=True)
        live.reset_peaks()
        with _Counting(live, 0):
            args, target = batch(i)
            pipe.step(*args, target=target)
        if optimizer is not None:
            optimizer.step()
        peak = max(peak, live.peak[0])
    return peak + persistent_bytes(pipe, optimizer, [stage])[0]


def measured_step(pipe: Pipeline, measured: Measured, comm_s: float | list[float] = 0.0) -> float:
    """The schedule's step with a device per stage, from the measured action medians."""
    return simulate(pipe.schedule, measured.stage_costs(pipe.prog.num_stages), comm_cost=comm_s).step_time
