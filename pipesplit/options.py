"""How :func:`pipesplit.compile` plans a split, as one frozen value that checks itself.

The planner's options (the stage count, the cost model, the memory cap, the schedule it
plans for with its communication and memory models, and how it searches) travel together:
build a :class:`PlannerOptions` once, reuse and vary it with ``dataclasses.replace``, and
pass it as ``compile(model, x, planner=opts)``. The same options as keywords of
``compile`` still work; the two forms cannot be mixed in one call. A bad value fails where
the options are built, before any (slow) capture.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Sequence

from pipesplit.checks import name_list, number
from pipesplit.errors import PipesplitError, PlanError
from pipesplit.passes.plan.checkpointing import Checkpoint, check_checkpoint
from pipesplit.passes.plan.lengths import parse_plan_lengths
from pipesplit.passes.plan.objective import CommModel, MemoryModel
from pipesplit.passes.plan.planner import ORDER_CHOICES, RECOMPUTE_CHOICES, CostSpec, check_choice, cost_function
from pipesplit.schedules import Schedule, schedule_info
from pipesplit.deprecation import num_keywords

Recompute = Literal["auto", "never"]
Order = Literal["auto", "program"]


def check_num_stages(num_stages: Any) -> None:
    if num_stages is None:
        return
    if isinstance(num_stages, bool) or not isinstance(num_stages, numbers.Integral):
        raise PlanError(
            f"num_stages must be a whole number of stages, got {num_stages!r} ({type(num_stages).__name__}); "
            "pass an int, e.g. num_stages=2."
        )
    if num_stages < 1:
        raise PlanError(f"num_stages must be at least 1, got {num_stages}.")


@dataclass(frozen=True)
class PlannerOptions:
    """What the planner balances, under which limits, and for which schedule.

    >>> import dataclasses
    >>> opts = PlannerOptions(num_stages=4, schedule="1f1b", num_microbatches=8)
    >>> dataclasses.replace(opts, num_stages=2).num_stages
    2
    >>> PlannerOptions(recompute="sometimes")
    Traceback (most recent call last):
    ...
    pipesplit.errors.PlanError: recompute must be 'auto' or 'never', got 'sometimes'.
    """

    num_stages: int | None = None
    """Stages to cut into (default 1)."""
    cost: CostSpec = "flops"
    """``"flops"``, ``"params"``, ``"profile"``, ``"hybrid"``, ``"uniform"``, a callable ``node -> float``
    or an object with ``node_cost(node, costs)``; see :func:`pipesplit.compile`."""
    max_stage_memory: int | None = None
    """Bytes a stage may hold (with ``schedule``: optimizer state and every microbatch in flight too)."""
    slack: float = 0.05
    """Fraction above the optimal bottleneck the planner may spend to send fewer bytes."""
    schedule: str | Schedule | None = None
    """Plan for this schedule's simulated step time (``"1f1b"``, ``"zb_h1"``, ...)."""
    num_microbatches: int | None = None
    """Microbatches per step for ``schedule`` (default 4 x stages)."""
    num_ranks: int | None = None
    """Ranks for schedules with several stages per rank."""
    pins: Mapping[str, int] | None = None
    """``{"module.path": stage}``: keep that module whole in that stage."""
    no_split: tuple[str, ...] = ()
    """Module paths (wildcards allowed) no cut may enter."""
    comm: CommModel | None = None
    """Link latency and bandwidth that price the boundaries (defaults per device kind)."""
    memory: MemoryModel | None = None
    """Optimizer and gradient factors and checkpointing, for the memory estimate."""
    recompute: Recompute = "auto"
    """``"auto"`` rebuilds cheap input-derived values in each stage instead of sending them."""
    order: Order = "auto"
    """``"auto"`` also tries the as-late-as-possible order of the nodes; ``"program"`` does not."""
    refine: int = 0
    """Rounds of re-planning from measured stage times (``cost="profile"`` or ``"hybrid"``)."""
    checkpoint: Checkpoint = None
    """Activation checkpointing: ``"auto"`` (chosen per stage with the cuts, to fit ``max_stage_memory``
    at the lowest simulated step), True (every stage), False, or stage indices; None: as ``memory``."""
    plan_lengths: Mapping[int, float] | Sequence[int] | None = None
    """Lengths of the one dynamic dimension besides the batch (declared in ``dynamic_dims``) to plan for: a list
    (equal weights) or ``{length: weight}``; with ``schedule``, the split with the lowest expected simulated step
    over them (:mod:`pipesplit.passes.plan.lengths`). Kept as ``{length: weight}``, the weights summing to 1."""

    def __post_init__(self) -> None:
        check_num_stages(self.num_stages)
        # a bare string is one module path, not its characters; a list is kept as a tuple
        object.__setattr__(self, "no_split", name_list("no_split", self.no_split, error=PlanError))
        if self.pins is not None:
            object.__setattr__(self, "pins", _pins(self.pins))  # the caller's dict may change later
        if (not isinstance(self.slack, (int, float)) or isinstance(self.slack, bool) or not self.slack >= 0
                or self.slack == float("inf")):  # nan fails >= 0
            raise PlanError(f"slack must be a fraction >= 0 of the optimal bottleneck, got {self.slack!r}.")
        number("max_stage_memory", self.max_stage_memory, above=True, integer=True, none=True, error=PlanError,
               example="16 * 2**30 (bytes)")
        number("num_microbatches", self.num_microbatches, minimum=1, integer=True, none=True, error=PlanError,
               example="8")
        number("num_ranks", self.num_ranks, minimum=1, integer=True, none=True, error=PlanError, example="2")
        number("refine", self.refine, integer=True, error=PlanError, example="2 (rounds)")
        for name, value, kind in (("comm", self.comm, CommModel), ("memory", self.memory, MemoryModel)):
            if value is not None and not isinstance(value, kind):
                raise PlanError(f"{name}= takes a pipesplit.{kind.__name__} or None, got {value!r}; "
                                f"e.g. {name}=pipesplit.{kind.__name__}("
                                + ("bandwidth=25e9)." if kind is CommModel else "checkpoint=True)."))
        if self.refine < 0 or (self.refine and not (isinstance(self.cost, str) and self.cost in ("profile", "hybrid"))):
            raise PlanError(
                f"refine={self.refine!r}: refining corrects profiled times with measured ones, so it needs a number "
                f"of rounds >= 0 and cost='profile' or 'hybrid' (got cost={self.cost!r})."
            )
        check_checkpoint(self.checkpoint)
        if isinstance(self.checkpoint, list):
            object.__setattr__(self, "checkpoint", tuple(self.checkpoint))  # frozen: the caller's list may change
        object.__setattr__(self, "plan_lengths", parse_plan_lengths(self.plan_lengths))
        if self.plan_lengths is not None and self.schedule is None:
            raise PlanError(f"plan_lengths={self.plan_lengths} plans for the expected simulated step of a schedule over "
                            "those lengths; give the schedule too: schedule='1f1b' (and num_microbatches=).")
        if self.plan_lengths is not None and isinstance(self.cost, str) and self.cost in ("profile", "hybrid"):
            raise PlanError(f"plan_lengths prices each length from its FLOPs and bytes, but cost={self.cost!r} times the "
                            "nodes at the example's length only; use cost='flops' (the default) with plan_lengths.")
        check_choice("recompute", self.recompute, RECOMPUTE_CHOICES)
        check_choice("order", self.order, ORDER_CHOICES)
        cost_function(self.cost)  # an unknown cost name fails here, not after the capture
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            schedule_info(self.schedule)  # so does an unknown schedule


def _pins(pins: Any) -> dict[str, int]:
    """``pins`` as a dict of module path -> stage index, refused by entry otherwise."""
    if not isinstance(pins, Mapping):
        raise PlanError(f"pins takes a dict of module path -> stage, got {pins!r} ({type(pins).__name__}); "
                        "e.g. pins={'layers.0': 0}.")
    for path, stage in pins.items():
        if not isinstance(path, str) or not path:
            raise PlanError(f"pins: {path!r} is not a module path; write one as in model.named_modules(), "
                            "e.g. pins={'layers.0': 0}.")
        number(f"pins[{path!r}]", stage, integer=True, error=PlanError, example=f"pins={{{path!r}: 0}} (a stage index)")
    return dict(pins)


PlannerOptions.__init__ = num_keywords(PlannerOptions.__init__)  # type: ignore[method-assign]  # n_* until 0.3

PLANNER_KEYWORDS = tuple(f.name for f in dataclasses.fields(PlannerOptions))


def planner_options(planner: PlannerOptions | None, **keywords: Any) -> PlannerOptions:
    """``planner`` when given, else the keywords as options. A planner keyword passed beside
    ``planner`` is refused before this, where the keywords passed are known (:func:`refuse_mixing`)."""
    if planner is None:
        return PlannerOptions(**keywords)
    if not isinstance(planner, PlannerOptions):
        raise PipesplitError(f"planner= takes a pipesplit.PlannerOptions, got {type(planner).__name__}.")
    return planner


def refuse_mixing(keywords: Iterable[str]) -> None:
    """Planner ``keywords`` passed beside ``planner=`` are an error, even at their default values:
    one of the two would be ignored."""
    given = set(keywords)
    mixed = [name for name in PLANNER_KEYWORDS if name in given]
    if mixed:
        raise PipesplitError(
            f"{', '.join(f'{n}=' for n in mixed)} given beside planner=: pass the planner's options one way. Put them "
            f"in the options (dataclasses.replace(planner, {mixed[0]}=...)) or drop planner=."
        )
