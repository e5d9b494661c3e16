"""Stages as compiled code: ``Pipeline(prog, ..., compile=True)`` (or a dict of ``torch.compile``
options) runs every stage's forward, and the backward AOT autograd derives from it, as code
``torch.compile`` generated (Inductor by default).

Each stage module (and, under a schedule that splits the backward, each stage's F, I and W
graphs, see :mod:`pipesplit.runtime.graphs.stage_graphs`) is compiled once and the compiled callable
reused across steps; torch's own guards recompile it for a new microbatch
shape. The first call of each stage at each microbatch size is timed and logged (the compile
time), and kept in :attr:`StageCompiler.seconds`.

What exact means here: a compiled stage computes what the eager stage does up to the
reassociation of floating-point sums that AOT autograd's decompositions and Inductor's fused
kernels make: tests hold losses and gradients to 1e-3 relative (norm of the difference) in
float32 and Inductor's to 1e-5 on a GPT; a gradient that is zero up to rounding (a bias before
BatchNorm) compares against a floor of 1e-4 of the largest one. Random ops keep pipesplit's per-(stage, microbatch) streams: a compiled
step is reproducible run to run under ``torch.manual_seed``, but Inductor draws dropout masks
with its own generator code, so they differ from the eager stages' masks.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
import time
import weakref
from typing import Any, Callable, Hashable, Iterator, Mapping

import torch

from pipesplit.errors import PipesplitError
from pipesplit.units import human_seconds
from pipesplit.runtime.graphs.cuda_graphs import without_inductor_graphs
from pipesplit.runtime.graphs.compile_limits import compile_blocker, failure

log = logging.getLogger("pipesplit")

_ALLOWED = [p for p in inspect.signature(torch.compile).parameters if p != "model"]


class StageCompiler:
    """``torch.compile`` with ``options`` for each stage module, made once per module."""

    def __init__(self, options: bool | Mapping[str, Any], progress: bool = True):
        opts = {} if options is True else dict(options)  # type: ignore[arg-type]
        unknown = sorted(set(opts) - set(_ALLOWED))
        if unknown:
            raise PipesplitError(f"compile= options {unknown} are not torch.compile's; it takes {_ALLOWED} "
                                 "(e.g. compile={'mode': 'max-autotune'} or compile={'backend': 'aot_eager'}).")
        # CUDA graphs (mode="reduce-overhead", ...): pipesplit captures its own per microbatch in flight
        # (runtime/graphs/cuda_graphs.py); Inductor's cudagraph trees are taken out of the options
        self.options, self.graphs = without_inductor_graphs(opts)
        self._compiled: weakref.WeakKeyDictionary[torch.nn.Module, Callable[..., Any]] = weakref.WeakKeyDictionary()
        self._timed: set[tuple[int, int, Hashable, bool]] = set()
        self._gate = _CompileGate()
        # (stage, microbatch size, or (size, other sizes) where a length varies) -> first call, compile included
        self.seconds: dict[tuple[int, Hashable], float] = {}
        self.progress = progress  # say on stderr what compiles, as it goes (see _say)
        self._fresh: list[float] = []  # first calls since the last step_done: their seconds
        self.eager: list[int] = []  # stages that run eager, all or their split backward (warn_eager_stage says why)
        self.ungraphed: list[int] = []  # stages that run compiled without the CUDA graphs asked for (warn_no_graphs)
        # module -> (the outputs a gradient comes back for, why it runs eager or None): see blocked()
        self._blocked: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, ...], str | None]] = \
            weakref.WeakKeyDictionary()

    def run(self, module: torch.nn.Module, stage: int, microbatch_size: Hashable, *args: Any, blocking: bool = True) -> Any:
        """``module`` compiled, on ``args``. ``blocking=False`` (autograd's device thread, which a
        stage tracing its joint graph under the gate may be waiting for): never wait on the gate nor
        compile; while the gate is held, or before the first compile, the graph runs uncompiled."""
        fn = self._compiled.get(module)
        if fn is None:
            fn = self._compiled[module] = torch.compile(module, **self.options)
        key = (id(module), stage, microbatch_size, torch.is_grad_enabled())
        if key in self._timed:
            if blocking:
                with self._gate.shared():
                    return fn(*args)
            with self._gate.try_shared() as entered:
                if entered:
                    return fn(*args)
            return module(*args)
        if not blocking:
            return module(*args)
        # Compiling traces with FX, which torch flags process-wide: a compiled stage called from
        # another thread meanwhile raises "FX to symbolically trace a dynamo-optimized function"
        # (seen on torch 2.10). A first call therefore runs alone.
        with self._gate.exclusive():
            what = _graph_words(module, stage, microbatch_size)
            self._say(f"pipesplit: compile=True: compiling {what} (torch.compile{f' {self.options}' if self.options else ''})"
                      " ...", end="")
            start = time.perf_counter()
            try:
                out = fn(*args)
            except BaseException:
                self._say(" failed")
                raise
            self._timed.add(key)
            seconds = time.perf_counter() - start
            self._fresh.append(seconds)
            self._say(f" {human_seconds(seconds)}")
        self.seconds[(stage, microbatch_size)] = self.seconds.get((stage, microbatch_size), 0.0) + seconds
        log.info("stage %d%s compiled for microbatches of %s in %.2fs (torch.compile%s, first call)", stage,
                 f" {part}" if (part := getattr(module, "pipesplit_part", "")) else "", microbatch_size, seconds,
                 f" {self.options}" if self.options else "")
        return out

    def step_done(self, seconds: float) -> None:
        """After a step: where it compiled, say how many graphs and the step's whole time, which
        includes what compiles lazily inside it (AOT autograd's backward graphs at their first call)."""
        if not self._fresh:
            return
        n, compiling = len(self._fresh), sum(self._fresh)
        self._fresh.clear()
        log.info("pipesplit: compile=True: %d graph(s) compiled in %.2fs; the step took %.2fs", n, compiling, seconds)
        self._say(f"pipesplit: compile=True: compiled {n} graph{'s' if n > 1 else ''} ({human_seconds(compiling)} "
                  f"in their first calls); the step took {human_seconds(seconds)} in all, backward graphs compiled "
                  "at their first call included. Later steps at these shapes reuse the code.")

    def _say(self, text: str, end: str = "\n") -> None:
        """One line on stderr, as it happens (``Pipeline(progress=False)`` hides them)."""
        if self.progress:
            print(text, end=end, file=sys.stderr, flush=True)

    def blocked(self, module: torch.nn.Module, stage: int, live: tuple[int, ...]) -> bool:
        """Whether ``module`` must run eager (:func:`pipesplit.runtime.graphs.compile_limits.compile_blocker`, or
        its compiled code failed before); ``live``: the outputs a gradient comes back for. Warned once."""
        known = self._blocked.get(module)
        if known is None or known[0] != live:
            known = self._blocked[module] = (live, compile_blocker(module, live))
        if known[1] is not None:
            self.warn_eager_stage(stage, known[1])
        return known[1] is not None

    def failed(self, module: torch.nn.Module, stage: int, error: Exception) -> None:
        """``module``'s compiled code raised (the fuzzer: a raw view error in AOT autograd's wrapper,
        BatchNorm in eval mode on a transposed input): it runs eager from now on, warned."""
        why = f"its compiled code failed ({failure(error)})"
        self._blocked[module] = (self._blocked[module][0] if module in self._blocked else (), why)
        self.warn_eager_stage(stage, why)

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Alone among compiled calls (a trace, like a compile, is process-wide)."""
        return self._gate.exclusive()

    def warn_eager_stage(self, stage: int, why: str) -> None:
        """Once per stage: it runs eager (all of it, or its split backward), and why."""
        _warn_once(self.eager, stage, f"runs eager: {why}. The other stages run compiled")

    def warn_no_graphs(self, stage: int, why: str) -> None:
        """Once per stage: CUDA graphs were asked for, and this stage runs compiled without them, and why."""
        _warn_once(self.ungraphed, stage, f"runs compiled without CUDA graphs: {why}")


def _graph_words(module: torch.nn.Module, stage: int, microbatch_size: Hashable) -> str:
    """``stage 2's F graph, microbatches of 4, training``: what a first call compiles, in words
    (``microbatch_size``: the size, or ``(size, other sizes...)`` where a length varies)."""
    part = getattr(module, "pipesplit_part", "")
    graph = {"F": "forward graph", "I": "input-gradient graph", "W": "weight-gradient graph",
             "head": "recomputed head", "tail": "graph after its recomputed head"}.get(part, "module")
    mode = "with gradients" if torch.is_grad_enabled() else "without gradients"
    if isinstance(microbatch_size, tuple):
        size = f"microbatches of {microbatch_size[0]}, other sizes {list(microbatch_size[1:])}"
    else:
        size = f"microbatches of {microbatch_size}"
    return f"stage {stage}'s {graph}, {size}, {mode}"


def _warn_once(said: list[int], stage: int, what: str) -> None:
    """``pipesplit: compile=...: stage {stage} {what}.``, unless ``said`` lists the stage already."""
    if stage in said:
        return
    said.append(stage)
    import warnings

    warnings.warn(f"pipesplit: compile=...: stage {stage} {what}.", stacklevel=3)


class _CompileGate:
    """Any number of compiled calls at once, or one first call (a compile, a trace, a CUDA graph
    capture) alone. The thread holding it alone may call compiled code inside (a capture compiles)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._owner: int | None = None  # the thread running alone

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        if self._owner == threading.get_ident():
            yield
            return
        with self._cond:
            self._cond.wait_for(lambda: self._owner is None)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def try_shared(self) -> Iterator[bool]:
        """As :meth:`shared` if nothing runs alone now (yields True), else at once, outside (False)."""
        if self._owner == threading.get_ident():
            yield True
            return
        with self._cond:
            entered = self._owner is None
            if entered:
                self._running += 1
        try:
            yield entered
        finally:
            if entered:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:
            yield
            return
        with self._cond:
            self._cond.wait_for(lambda: self._owner is None and self._running == 0)
            self._owner = me
        try:
            yield
        finally:
            with self._cond:
                self._owner = None
                self._cond.notify_all()
