"""CUDA graphs for compiled stages: ``compile={"mode": "reduce-overhead"}`` (or ``"max-autotune"``, or
Inductor's ``"triton.cudagraphs"`` option), the way torch users ask for them.

A pipeline stage is where a host-bound step loses its time: each microbatch's F, I and W launch one
kernel per op. A CUDA graph replays all of an action's kernels in one launch. Inductor's own CUDA
graphs (cudagraph trees) assume one thread stepping through generations: the outputs of a replay
are overwritten by the next replay of that graph, and a pipeline keeps several microbatches in
flight, each holding its forward's saved values until its backward, and hands outputs to other
stages' threads. So pipesplit takes Inductor's CUDA graphs out of the options (``reduce-overhead``
compiles as the default mode, ``max-autotune`` as ``max-autotune-no-cudagraphs``) and captures the
stage's explicit F and I graphs (:mod:`pipesplit.runtime.graphs.stage_graphs`) itself, in **slots**:

- a slot is one microbatch in flight: its F and I graphs, captured into one memory pool, I reading
  F's outputs (the values saved for the backward) where F's replay left them. A microbatch takes a
  free slot at its F and gives it back after its W, so a stage has as many slots as it has
  microbatches in flight (what the schedule holds anyway). W runs as compiled code without a graph:
  its outputs, a gradient per weight, would stay allocated in every slot;
- what leaves the slot is copied out: the stage's outputs (sent on, or read by the loss), the
  inputs' gradients (sent back), a weight's gradient W takes from what I kept. Received activations
  and output gradients are copied into the slot's static inputs;
- a graph reads the parameters and buffers where they were at its capture. An optimizer updates
  them in place; a parameter that moved (``.to``, a new ``nn.Parameter``) retires every slot and
  the next microbatch captures anew.

Capture is for stages on a CUDA device whose tensors are all on it; anything the explicit graphs
refuse (random ops, writes in place, checkpointing, autocast; see ``compile_limits.unsupported``)
runs as plain compiled code, and a capture that fails leaves the stage compiled without graphs:
both are warned once per stage with the reason. Only a GPU confirms the speed; on CPU the whole
path (slots, copies in and out, reuse, retirement, fallback) runs under :class:`EmulatedCapture`,
whose replay overwrites each output in place as a CUDA graph's does, so a slot handed back too early
shows as a wrong gradient in the tests.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from pipesplit.compat import pytree

log = logging.getLogger("pipesplit")

MAX_SLOTS = 64  # microbatches in flight per stage and input shape; beyond it a microbatch runs without graphs
MAX_SHAPES = 4  # input shapes (and trainable sets) per stage whose slots are kept; older ones are captured anew
_MODES = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


def without_inductor_graphs(options: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """``torch.compile`` options with Inductor's CUDA graphs taken out, and whether they asked for
    CUDA graphs (then pipesplit captures its own slots instead)."""
    opts = dict(options)
    asked = False
    if opts.get("mode") in _MODES:
        asked = True
        mode = _MODES[opts.pop("mode")]
        if mode is not None:
            opts["mode"] = mode
    inductor = dict(opts.get("options") or {})
    if "triton.cudagraphs" in inductor:
        asked = asked or bool(inductor["triton.cudagraphs"])
        inductor["triton.cudagraphs"] = False
        opts["options"] = inductor
    return opts, asked


class CudaCapture:
    """Capture and replay with ``torch.cuda.CUDAGraph``: warmed up and captured on one stream per device
    kept for captures (high priority: never one of the stages' streams, which come from torch's pool of
    normal-priority streams), one capture at a time in the process; replayed on the caller's (the
    stage's) stream. A capture that fails leaves the caller on its own stream, ordered after the
    capture stream's work."""

    _streams: dict[torch.device, Any] = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device):
        self.device = device

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[..., Any], inputs: Sequence[Any], pool: Any) -> tuple[Any, Any]:
        with CudaCapture._lock:
            stream = CudaCapture._streams.get(self.device)
            if stream is None:
                stream = CudaCapture._streams[self.device] = torch.cuda.Stream(self.device, priority=-1)
            current = torch.cuda.current_stream(self.device)
            stream.wait_stream(current)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.stream(stream):  # restores the caller's stream however the capture ends
                    fn(*inputs)  # warm-up: lazy initialisation (cuBLAS workspaces) stays out of the graph
                    # thread_local: other stages' threads keep launching meanwhile. Not torch.cuda.graph:
                    # its device-wide synchronize and empty_cache would stall every stage per capture
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        outs = fn(*inputs)
                    finally:
                        graph.capture_end()
            except BaseException:
                # an invalidated capture can leave the allocator routing this stream to the graph's
                # pool: later captures take a new stream
                CudaCapture._streams.pop(self.device, None)
                raise
            finally:
                current.wait_stream(stream)
            return graph, outs

    def replay(self, graph: Any) -> None:
        graph.replay()


class EmulatedCapture:
    """A capture and replay that do to memory what CUDA graphs do, on any device (the tests' CPU):
    the captured call's outputs are the graph's static outputs, and a replay reruns it on the static
    inputs and writes the results into those same tensors."""

    def new_pool(self) -> Any:
        return None

    def capture(self, fn: Callable[..., Any], inputs: Sequence[Any], pool: Any) -> tuple[Any, Any]:
        outs = fn(*inputs)
        return (fn, list(inputs), outs), outs

    def replay(self, graph: Any) -> None:
        fn, inputs, outs = graph
        with torch.no_grad():
            for old, new in zip(tensors_in(outs), tensors_in(fn(*inputs))):  # a saved value may be a tuple (an op's)
                same = (old.data_ptr() == new.data_ptr() and old.shape == new.shape and old.stride() == new.stride())
                if not same:  # not a view of what it was (a saved parameter): writing it would bump its
                    old.copy_(new)  # version, which a real replay does not, and eager stages check


def backend_for(device: torch.device) -> CudaCapture | EmulatedCapture | None:
    """How stages on ``device`` capture (None: they cannot). The tests replace this with
    :class:`EmulatedCapture` on CPU."""
    return CudaCapture(device) if device.type == "cuda" else None


def capture_blocker(device: torch.device, tensors: Sequence[Any]) -> str | None:
    """Why a stage's F/I/W graphs with these parameters, buffers and inputs cannot be captured."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and (t.device != device or t.layout != torch.strided):
            return (f"it reads a tensor of shape {tuple(t.shape)} on {t.device}"
                    f"{'' if t.layout == torch.strided else f' ({t.layout})'}, not on the stage's {device}")
    return None


@dataclass(eq=False)  # compared by identity: its fields hold tensors
class _Slot:
    pool: Any
    inputs: list[torch.Tensor]  # F's static activation inputs
    tangents: list[torch.Tensor] = field(default_factory=list)  # I's and W's static output gradients
    graphs: dict[str, Any] = field(default_factory=dict)  # part label -> captured graph
    outputs: dict[str, Any] = field(default_factory=dict)  # part label -> its static outputs
    owner: object | None = None  # the microbatch holding it (None: free)


class Slots:
    """The captured slots of one stage's F/I/W graphs (one :class:`~pipesplit.runtime.graphs.stage_parts.Parts`)."""

    def __init__(self, parts: Any, run: Callable[..., Any], backend: Any, index: int,
                 exclusive: Callable[[], Any], on_failure: Callable[[str], None]):
        self.parts, self.run, self.backend, self.index = parts, run, backend, index
        self.exclusive = exclusive  # the compiler's gate: a capture runs alone among compiled calls
        self.on_failure = on_failure  # a capture failed: the stage runs without graphs (warned)
        self.slots: list[_Slot] = []
        self.addresses: tuple[int, ...] = ()  # where the parameters and buffers were when the slots were captured
        self.captures = 0
        self.replays = 0
        self.broken = False

    def acquire(self, xs: Sequence[Any]) -> SlotRunner | None:
        """A runner for one microbatch's F, I and W over a free slot, or None (run without graphs)."""
        if self.broken:
            return None
        params = [*self.parts.params(), *self.parts.buffers()]
        addresses = tuple(p.data_ptr() for p in params)
        if addresses != self.addresses:  # a parameter moved: every graph read the old place
            if self.slots:
                log.info("stage %d: a parameter or buffer moved; its %d CUDA graph slot(s) are captured anew",
                         self.index, len(self.slots))
            self.slots = []  # busy ones finish their microbatch through their runners, then go
            self.addresses = addresses
        slot = next((s for s in self.slots if s.owner is None), None)
        if slot is None:
            if len(self.slots) >= MAX_SLOTS:
                return None
            slot = _Slot(self.backend.new_pool(), [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in xs])
            self.slots.append(slot)
        token = object()
        slot.owner = token
        return SlotRunner(self, slot, token)

    def release(self, slot: _Slot, token: object) -> None:
        if slot.owner is token:
            slot.owner = None

    def replay(self, slot: _Slot, label: str, part: Any, inputs: Sequence[Any]) -> Any:
        if label not in slot.graphs:
            start = time.perf_counter()
            # a capture runs the part (the warm-up; the emulation's capture): what it writes in place (a
            # BatchNorm's running statistics) is put back, so the replay below is the one update
            # (aten.native_batch_norm writes them without saying so in its schema: every buffer F reads is kept).
            # Only what changed is copied back: a copy bumps the version of a buffer F only reads, which an
            # eager stage's backward may hold (the fuzzer's seed 8080: a BatchNorm's running variance, saved
            # by its backward, read by a later stage; autograd's "modified by an inplace operation")
            restore = set(_written_placeholders(part))
            if label == "F":
                first = len(self.parts.param_slots)
                restore |= set(range(first, first + len(self.parts.buffer_slots)))
            written = [inputs[k] for k in sorted(restore) if isinstance(inputs[k], torch.Tensor)]
            kept = [t.clone() for t in written]
            try:
                with self.exclusive():
                    slot.graphs[label], slot.outputs[label] = self.backend.capture(
                        lambda *a: self.run(part, *a), inputs, slot.pool)
            finally:  # also when the capture failed after its warm-up: the fallback run is the one update
                with torch.no_grad():
                    for t, old in zip(written, kept):
                        if not _same(t, old):
                            t.copy_(old)
            self.captures += 1
            log.info("stage %d: CUDA graph of %s captured for slot %d in %.3fs", self.index, label,
                     next((k for k, s in enumerate(self.slots) if s is slot), -1), time.perf_counter() - start)
        self.backend.replay(slot.graphs[label])
        self.replays += 1
        return slot.outputs[label]


class SlotRunner:
    """One microbatch's F, I and W over its slot: ``(part, *args) -> outputs``, like the compiled runner
    it stands for (see :class:`~pipesplit.runtime.graphs.stage_graphs.Deferred`). F and I replay the slot's
    graphs. I's graph is captured right after the slot's first F, on the stage's thread, from output
    gradients of zeros (I writes nothing): on a GPU, I itself runs on autograd's device thread, which
    must never wait on the compile gate (a stage tracing its joint graph holds the gate and needs that
    thread). W runs as compiled code without a graph: its outputs, a gradient per weight, would stay
    allocated in every slot (under gpipe, m copies of the stage's gradients)."""

    def __init__(self, slots: Slots, slot: _Slot, token: object):
        self.slots, self.slot, self.token = slots, slot, token

    @property
    def needs_input_capture(self) -> bool:
        return "I" not in self.slot.graphs and not self.slots.broken and _has_ops(self.slots.parts.backward_input)

    def bind(self, record: Any) -> None:
        """Give the slot back when ``record`` goes without its W (a step that raised)."""
        weakref.finalize(record, self.slots.release, self.slot, self.token)

    def release(self) -> None:
        self.slots.release(self.slot, self.token)

    def __call__(self, part: Any, *args: Any, blocking: bool = True) -> Any:
        slots, slot, parts = self.slots, self.slot, self.slots.parts
        label = "F" if part is parts.forward else "I" if part is parts.backward_input else "W"
        if (label == "W" or slots.broken or not _has_ops(part)  # (an I with nothing to launch: a first stage)
                or (not blocking and label not in slot.graphs)):  # autograd's thread does not capture
            with torch.no_grad():
                return slots.run(part, *args, blocking=blocking)
        try:
            with torch.no_grad():
                return self._replay(label, part, args)
        except Exception as e:  # noqa: BLE001 - a capture torch refuses: this stage runs without graphs
            if label in slot.graphs:
                raise  # a replay's own error
            slots.broken = True
            slots.on_failure(f"capturing its {label} graph failed ({type(e).__name__}: {str(e).strip()[:160]})")
            with torch.no_grad():
                return slots.run(part, *args, blocking=blocking)

    def _replay(self, label: str, part: Any, args: Sequence[Any]) -> Any:
        slots, slot, parts = self.slots, self.slot, self.slots.parts
        if label == "F":
            fixed = len(parts.param_slots) + len(parts.buffer_slots)
            _copy_in(slot.inputs, args[fixed:])
            flat = slots.replay(slot, "F", part, [*args[:fixed], *slot.inputs])
            n = parts.num_outputs
            return [*(_copy_out(o) for o in flat[:n]), *flat[n:]]
        num_tangents = sum(parts.differentiable)
        given, tangents = list(args[:len(args) - num_tangents]), args[len(args) - num_tangents:]
        if not slot.tangents:
            slot.tangents = [g.detach().clone(memory_format=torch.contiguous_format) for g in tangents]
        _copy_in(slot.tangents, tangents)
        flat = slots.replay(slot, "I", part, [*given, *slot.tangents])
        n = len(parts.grad_inputs)
        return [*(_copy_out(g) for g in flat[:n]), *flat[n:]]


def _written_placeholders(part: Any) -> list[int]:
    """Positions of the inputs ``part``'s graph writes in place (a buffer's ``add_``, ``copy_``)."""
    places = [n for n in part.graph.nodes if n.op == "placeholder"]
    written: set[Any] = set()
    for node in part.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.add(value)
        for name, value in node.kwargs.items():
            arg = next((a for a in schema.arguments if a.name == name), None)
            if arg is not None and arg.alias_info is not None and arg.alias_info.is_write:
                written.add(value)
    return [k for k, p in enumerate(places) if p in written]


def _same(t: torch.Tensor, old: torch.Tensor) -> bool:
    """``t`` holds what ``old`` holds, a NaN equal to a NaN."""
    if torch.equal(t, old):
        return True
    return (t.is_floating_point() or t.is_complex()) and bool(torch.isclose(t, old, 0.0, 0.0, equal_nan=True).all())


def _has_ops(part: Any) -> bool:
    return any(n.op == "call_function" for n in part.graph.nodes)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, tuples and lists opened (a saved value may be an op's several outputs)."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _copy_in(static: list[Any], given: Sequence[Any]) -> None:
    for s, g in zip(static, given):
        if isinstance(s, torch.Tensor) and s is not g:
            s.copy_(g)


def _copy_out(t: Any) -> Any:
    return t.clone() if isinstance(t, torch.Tensor) else t
