"""Random streams per (stage, microbatch): the same seed gives the same dropout masks under any
schedule, executor or activation checkpointing.

torch's default generators are process-global, and a pipeline runs stages concurrently
(threads, or processes that each draw in their own order), so a random op's draw would
depend on timing. The split pass routes every random op of a stage graph through
:func:`seeded`. Outside a :func:`random_stream` block it calls the op as it is (``prog(x)``
draws from torch's default generator exactly like the model does); inside one, it runs
the op on the stream's own generator state, swapped into the default generator under a
lock, and puts the caller's state back: the user's RNG does not move.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.fx as fx

from pipesplit.compat import OpOverload
from pipesplit.devices import concrete_device

_MASK = (1 << 64) - 1
_local = threading.local()
_lock = threading.Lock()

# The ops whose randomness a drop probability ``p`` of 0 switches off.
_DROPOUTS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"}


def stream_seed(step_seed: int, stage: int, microbatch: int) -> int:
    """A well-mixed 63-bit seed for one (stage, microbatch) of a step (splitmix64 finaliser)."""
    z = (step_seed * 0x9E3779B97F4A7C15 + stage * 0xBF58476D1CE4E5B9 + microbatch * 0x94D049BB133111EB + 1) & _MASK
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * mult) & _MASK
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class _Stream:
    """Generator states of one stream: CPU always, plus the stage's CUDA device when it has one
    (made on the first random op, so a stage without any pays nothing)."""

    def __init__(self, seed: int, device: torch.device):
        self.seed, self.device = seed, device
        self._states: dict[Any, torch.Tensor] | None = None

    @property
    def states(self) -> dict[Any, torch.Tensor]:
        if self._states is None:
            self._states = {}
            for key in _keys(self.device):
                g = torch.Generator(device="cpu" if key == "cpu" else f"cuda:{key}")
                g.manual_seed(self.seed)
                self._states[key] = g.get_state()
        return self._states


def _keys(device: torch.device) -> list[Any]:
    if device.type == "cuda":
        return ["cpu", device.index if device.index is not None else torch.cuda.current_device()]
    return ["cpu"]


def _default(key: Any) -> torch.Generator:
    return torch.default_generator if key == "cpu" else torch.cuda.default_generators[key]


@contextmanager
def random_stream(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Random ops of stage graphs run in this thread draw from a stream seeded with ``seed``.

    >>> import torch
    >>> with random_stream(7):
    ...     a = seeded(torch.ops.aten.rand.default, [3])
    >>> with random_stream(7):
    ...     b = seeded(torch.ops.aten.rand.default, [3])
    >>> torch.equal(a, b)
    True
    """
    prev = getattr(_local, "stream", None)
    _local.stream = _Stream(seed, concrete_device(device))
    try:
        yield
    finally:
        _local.stream = prev


def stream_copy() -> _Stream | None:
    """The current thread's stream as it stands now (None outside :func:`random_stream`), to replay from."""
    stream: _Stream | None = getattr(_local, "stream", None)
    if stream is None:
        return None
    copy = _Stream(stream.seed, stream.device)
    if stream._states is not None:
        copy._states = {key: state.clone() for key, state in stream._states.items()}
    return copy


@contextmanager
def resumed_stream(start: _Stream | None) -> Iterator[None]:
    """Random ops draw again from ``start`` (a :func:`stream_copy`), which is left as it was; outside any
    stream (``start`` None) they draw from torch's default generator, as a stage run outside a step does."""
    prev = getattr(_local, "stream", None)
    _local.stream = None
    if start is not None:
        _local.stream = _Stream(start.seed, start.device)
        if start._states is not None:
            _local.stream._states = {key: state.clone() for key, state in start._states.items()}
    try:
        yield
    finally:
        _local.stream = prev


def seeded(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run random ``op`` on the current thread's stream (or torch's default generator if none). On a
    stream, an op that writes none of its arguments draws over them made contiguous: a dropout fills its
    mask in memory order, and a value can reach a stage in another layout than the model's (a transport
    delivers it contiguous; export's recorded strides may differ from eager's), so the masks follow the
    values alone and equal under any executor."""
    stream: _Stream | None = getattr(_local, "stream", None)
    if stream is None:
        return op(*args, **kwargs)
    if not _writes(op):
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    with _lock:
        saved = {key: _default(key).get_state() for key in stream.states}
        try:
            for key, state in stream.states.items():
                _default(key).set_state(state)
            out = op(*args, **kwargs)
            for key in stream.states:
                stream.states[key] = _default(key).get_state()
        finally:
            for key, state in saved.items():
                _default(key).set_state(state)
    return out


_WRITES: dict[Any, bool] = {}


def _writes(op: Any) -> bool:
    """Whether ``op`` writes one of its arguments (``bernoulli_``, an ``out=`` variant); read from its
    schema once per op (every dropout of every microbatch asks). A plain dict, not ``functools.lru_cache``:
    Dynamo warns on tracing into one (a compiled stage's random op runs here)."""
    known = _WRITES.get(op)
    if known is None:
        schema = getattr(op, "_schema", None)
        known = _WRITES[op] = schema is None or any(a.alias_info is not None and a.alias_info.is_write
                                                    for a in schema.arguments)
    return known


def _is_random(node: fx.Node) -> bool:
    op = node.target
    if node.op != "call_function" or not isinstance(op, OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    name = op._schema.name.split("::")[-1]
    if name.startswith("scaled_dot_product") or name.startswith("_scaled_dot_product"):
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return bool(p != 0.0)
    for i, arg in enumerate(op._schema.arguments):  # dropout, RReLU & co. draw only in training mode
        if arg.name in ("train", "training") and (node.args[i] if len(node.args) > i
                                                  else node.kwargs.get(arg.name, arg.default_value)) is False:
            return False
    if name in _DROPOUTS:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        return bool(p != 0.0)
    return True


def seed_random_ops(graph: fx.Graph) -> int:
    """Route every random op of ``graph`` through :func:`seeded`, in place; returns how many."""
    count = 0
    for node in graph.nodes:
        if _is_random(node):
            node.args = (node.target, *node.args)
            node.target = seeded
            count += 1
    return count
