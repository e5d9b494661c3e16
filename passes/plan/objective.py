"""What a plan really costs: stage times, communication, memory and the schedule's step time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from pipesplit.checks import number
from pipesplit.errors import PlanError
from pipesplit.schedules import ActionKind, Schedule, StageCost, simulate

# Sustained rates for turning FLOPs into seconds when nothing was profiled; only the
# ratios between stages matter for balance, absolute values only for comm trade-offs.
DEFAULT_FLOPS_PER_S = {"cpu": 5e10, "cuda": 2e14, "mps": 5e12}
# (latency seconds, bandwidth bytes/s) between two devices of these kinds.
DEFAULT_LINKS = {
    ("cpu", "cpu"): (5e-5, 5e9),  # gloo / shared memory between processes
    ("cuda", "cuda"): (1e-5, 1e11),  # NVLink-class peer-to-peer
    ("cpu", "cuda"): (1e-5, 2e10),  # PCIe
}


@dataclass(frozen=True)
class CommModel:
    """Time to move a boundary: ``latency_s + bytes / bandwidth``.

    Left as None, both come from ``DEFAULT_LINKS`` by device kind. Planning assumes
    every stage runs on its own device or process, so each cut is a real transfer.
    """

    latency_s: float | None = None  # seconds per message
    bandwidth: float | None = None  # bytes per second

    def __post_init__(self) -> None:
        number("CommModel(latency_s=...)", self.latency_s, none=True, error=PlanError, example="1e-5 (10 us)")
        number("CommModel(bandwidth=...)", self.bandwidth, above=True, none=True, error=PlanError,
               example="25e9 (bytes per second)")

    def seconds(self, nbytes: float, src: str, dst: str, messages: int = 1) -> float:
        """Seconds to send ``nbytes`` in ``messages`` messages between devices of these kinds."""
        if nbytes <= 0 and messages == 0:
            return 0.0
        kinds = tuple(sorted((torch.device(src).type, torch.device(dst).type)))
        lat, bw = DEFAULT_LINKS.get(kinds, DEFAULT_LINKS[("cpu", "cpu")])  # type: ignore[arg-type]
        lat = self.latency_s if self.latency_s is not None else lat
        bw = self.bandwidth if self.bandwidth is not None else bw
        return messages * lat + nbytes / bw


# A running backward's working set, in one microbatch's activations: the gradients it makes while it
# frees the activations it has used (and a checkpointed stage's the same, over the one microbatch it
# recomputes). Measured on a GPT's stages (benchmarks/bench_memory.py, every new storage counted, a
# parameter's view no longer taken for one): 0.1-0.45 of a microbatch; with what a stage receives
# counted (passes/plan/stage_bytes.py) a quarter keeps every stage measured 0.77-1.0 of its figure, in one
# process and under torchrun (tests/test_activation_memory.py, tests/memory_check.py).
BACKWARD_WORKING_SET = 0.25

# Optimizer state per parameter, in moments (tensors the size of the parameter): SGD keeps none, SGD
# with momentum one, Adam/AdamW two; Adafactor factors its second moment into a row and a column
# (a few bytes per matrix row, counted as none) and keeps no first moment by default.
OPTIMIZER_MOMENTS = {"sgd": 0.0, "momentum": 1.0, "adam": 2.0, "adamw": 2.0, "adafactor": 0.0}


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a stage holds during training.

    parameters x (1 + grad_factor + optimizer_factor) + activations of one microbatch x
    the microbatches the schedule keeps in flight on that stage, a quarter more for a running
    backward's working set (``BACKWARD_WORKING_SET``), and with a split backward one more per
    microbatch between its I and its W (:func:`activation_units_per_stage`). A microbatch's
    activations count each storage once (a node's ``held_bytes``); what a stage receives is added
    by :func:`pipesplit.passes.plan.stage_bytes.stage_bytes`. With checkpointing, only the
    stage inputs and outputs of in-flight microbatches are kept, plus one microbatch's full
    activations during its recompute and its backward's working set.

    ``optimizer`` names the optimizer instead of ``optimizer_factor`` (``"sgd"``,
    ``"momentum"``, ``"adam"``, ``"adamw"``, ``"adafactor"``); ``master_weights`` is mixed
    precision as trained in practice: bf16/fp16 weights and gradients, with an fp32 copy of
    the weights and fp32 optimizer moments (AdamW: 2 + 2 + 4 + 8 = 16 bytes per parameter).

    >>> MemoryModel(optimizer="adamw", master_weights=True).bytes_per_param(2)
    16.0
    >>> MemoryModel(optimizer="sgd").bytes_per_param(4), MemoryModel().bytes_per_param(4)
    (8.0, 16.0)
    """

    optimizer_factor: float = 2.0  # Adam keeps two moments per parameter
    grad_factor: float = 1.0
    checkpoint: bool = False
    optimizer: str | None = None
    master_weights: bool = False

    def __post_init__(self) -> None:
        if self.optimizer is not None and self.optimizer not in OPTIMIZER_MOMENTS:
            raise PlanError(f"MemoryModel(optimizer={self.optimizer!r}) is not one it knows the state of; use one of "
                            f"{sorted(OPTIMIZER_MOMENTS)}, or optimizer_factor= (state bytes per parameter byte).")
        number("MemoryModel(optimizer_factor=...)", self.optimizer_factor, error=PlanError, example="2.0 for Adam")
        number("MemoryModel(grad_factor=...)", self.grad_factor, error=PlanError, example="1.0")
        if not isinstance(self.checkpoint, bool):
            raise PlanError(f"MemoryModel(checkpoint=...) must be True or False, got {self.checkpoint!r}.")

    @property
    def state_factor(self) -> float:
        """Bytes held per byte of trainable parameter: the weight, its gradient, optimizer state
        (for fp32 parameters; :meth:`state_factor_for` for others)."""
        return self.state_factor_for(4)

    def state_factor_for(self, itemsize: int) -> float:
        """Bytes held per byte of a trainable parameter of ``itemsize`` bytes an element."""
        return self.bytes_per_param(itemsize) / itemsize

    def bytes_per_param(self, itemsize: int = 4) -> float:
        """Training state per trainable parameter of ``itemsize`` bytes: weight, gradient, master copy, moments."""
        if self.optimizer is None and not self.master_weights:
            return itemsize * (1.0 + self.grad_factor + self.optimizer_factor)
        moments = OPTIMIZER_MOMENTS[self.optimizer] if self.optimizer is not None else self.optimizer_factor
        master = 4.0 if self.master_weights else 0.0
        return itemsize * (1.0 + self.grad_factor) + master + moments * (4.0 if self.master_weights else itemsize)

    def training_state_factor(self, with_optimizer: bool) -> "float | Callable[[int], float]":
        """What ``build_chain`` multiplies trainable parameter bytes by: per element size, with or without
        the optimizer's state (planning without a schedule counts weights and gradients only)."""
        if with_optimizer:
            return self.state_factor_for
        return lambda itemsize: 1.0 + self.grad_factor

    def stage_bytes(self, param_bytes: float, act_bytes: float, input_bytes: float, in_flight: int,
                    units: float | None = None) -> float:
        return self.held_bytes(param_bytes * self.state_factor, act_bytes, input_bytes, in_flight, units)

    def held_bytes(self, state_bytes: float, act_bytes: float, input_bytes: float, in_flight: int,
                   units: float | None = None, checkpointed: bool | None = None) -> float:
        """Like :meth:`stage_bytes` with ``state_bytes`` already counting gradients and optimizer state.

        ``units``: one microbatch's activations' worth of memory the stage holds at its peak
        (:func:`activation_units_per_stage`); ``in_flight`` when not given. ``checkpointed``:
        whether this stage recomputes its forward (default ``self.checkpoint``); then
        ``input_bytes`` is what it keeps of each microbatch in flight: its inputs, to recompute
        from, and its outputs, which its backward starts from.
        """
        if self.checkpoint if checkpointed is None else checkpointed:  # one microbatch recomputed, and its backward
            return state_bytes + input_bytes * in_flight + act_bytes * (1 + BACKWARD_WORKING_SET)
        return state_bytes + act_bytes * (in_flight if units is None else units)

    def partial_bytes(self, state_bytes: float, head_bytes: float, tail_bytes: float, input_bytes: float,
                      in_flight: int, units: float | None = None) -> float:
        """A stage recomputing only its first blocks: its inputs per microbatch in flight, the tail's
        activations (with what crosses into it) per unit, the head's for one microbatch while it recomputes."""
        return state_bytes + input_bytes * in_flight + tail_bytes * (in_flight if units is None else units) + head_bytes


@dataclass
class StageFigures:
    """Per-stage figures of a plan under a schedule."""

    costs: list[StageCost]  # seconds per microbatch
    comm: list[float]  # seconds per microbatch at each cut (len = stages - 1)
    memory: list[float]  # bytes
    in_flight: list[int]
    extra: dict[str, float] = field(default_factory=dict)


def in_flight_per_stage(schedule: Schedule) -> list[int]:
    """The most microbatches whose activations a stage holds at once, from action order.

    A microbatch is held from its forward until its full backward (B) or, for split
    backwards, its weight-gradient pass (W) on that stage.
    """
    return _most_held(schedule, (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_WEIGHT))


def _most_held(schedule: Schedule, ends: tuple[ActionKind, ...]) -> list[int]:
    """Per stage, the most microbatches held at once from a forward until an action of a kind in ``ends``."""
    peak = [0] * schedule.num_stages
    for actions in schedule.actions:
        held = [0] * schedule.num_stages
        for a in actions:
            if a.kind is ActionKind.FORWARD:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind in ends:
                held[a.stage] -= 1
    return peak


def activation_units_per_stage(schedule: Schedule) -> list[float]:
    """The most memory a stage holds at once for its activations, in one microbatch's activations.

    The microbatches in flight (:func:`in_flight_per_stage`), plus, while a backward (B or
    I) runs, its working set (``BACKWARD_WORKING_SET`` of a microbatch: the gradients it makes
    as it frees what it has used), plus, with a split backward, the gradients kept at the
    weight-consuming operations from a microbatch's I until its W (at most one more per such
    microbatch). Measured against a real step in ``tests/memory_check.py`` and
    ``benchmarks/bench_memory.py``.

    >>> from pipesplit.schedules import get_schedule
    >>> one_f_one_b = get_schedule("1f1b", num_stages=4, num_microbatches=8)
    >>> in_flight_per_stage(one_f_one_b), activation_units_per_stage(one_f_one_b)
    ([4, 3, 2, 1], [4.25, 3.25, 2.25, 1.25])
    """
    peak = [0.0] * schedule.num_stages
    for actions in schedule.actions:
        held, waiting = [0] * schedule.num_stages, [0] * schedule.num_stages  # waiting: I ran, W not yet
        for a in actions:
            s = a.stage
            if a.kind is ActionKind.FORWARD:
                held[s] += 1
                peak[s] = max(peak[s], held[s] + waiting[s])
            elif a.kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT):
                peak[s] = max(peak[s], held[s] + waiting[s] + BACKWARD_WORKING_SET)
                if a.kind is ActionKind.FULL_BACKWARD:
                    held[s] -= 1
                else:  # what it keeps for W counts from here, until W
                    waiting[s] += 1
                    peak[s] = max(peak[s], held[s] + waiting[s])
            elif a.kind is ActionKind.BACKWARD_WEIGHT:
                held[s] -= 1
                waiting[s] = max(waiting[s] - 1, 0)
    return peak


def split_stages(schedule: Schedule) -> dict[int, int]:
    """The stages whose backward ``schedule`` splits into an input-gradient (I) and a weight-gradient (W)
    action, each with the most microbatches it holds at once from a forward until its I: what such a
    stage holds when it runs its whole backward in I, as a stage that recomputes does (the runtime's
    ``StageWorker.backward_input``), where :func:`in_flight_per_stage` counts until W.

    >>> from pipesplit.schedules import get_schedule
    >>> zb = get_schedule("zb_h1", num_stages=4, num_microbatches=8)
    >>> in_flight_per_stage(zb), split_stages(zb)
    ([4, 4, 4, 4], {0: 4, 1: 3, 2: 2, 3: 1})
    """
    stages = {a.stage for actions in schedule.actions for a in actions if a.kind is ActionKind.BACKWARD_WEIGHT}
    until_i = _most_held(schedule, (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT))
    return {s: until_i[s] for s in sorted(stages)}


def step_time(schedule: Schedule, figures: StageFigures) -> float:
    """The simulated step time of ``schedule`` with these stage and cut costs."""
    comm: float | Sequence[float] = figures.comm if figures.comm else 0.0
    return simulate(schedule, figures.costs, comm_cost=comm).step_time
