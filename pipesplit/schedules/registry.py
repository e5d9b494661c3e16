"""The explicit registry of named schedules, their constraints, and get_schedule()."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

from pipesplit.errors import ScheduleError, did_you_mean
from pipesplit.schedules.actions import Action
from pipesplit.schedules.schedule import Schedule
from pipesplit.schedules.validate import validate
from pipesplit.deprecation import num_keywords

ScheduleResult = Union[Schedule, Sequence[Sequence[Union[Action, str]]]]
ScheduleFn = Callable[[int, int, int], ScheduleResult]
"""``fn(num_stages, num_ranks, num_microbatches)`` returning a Schedule or per-rank action lists."""


@dataclass(frozen=True)
class ScheduleConstraints:
    """What a schedule needs of its sizes; checked before the schedule function runs."""

    stages_per_rank: int | None = 1
    """Exact number of stages each rank holds; ``None``: any whole number (num_stages % num_ranks == 0)."""
    microbatches_multiple_of_ranks: bool = False
    """Whether num_microbatches must be a multiple of num_ranks (interleaved 1F1B)."""
    min_microbatches: int = 1
    """Smallest num_microbatches the schedule supports."""
    microbatches_at_least_stages: bool = False
    """Whether num_microbatches must be >= num_stages (DualPipeV fills its V with them)."""

    def check(self, name: str, num_stages: int, num_ranks: int, num_microbatches: int) -> None:
        """Raise ScheduleError naming the violated constraint, the numbers and a fix."""
        for field, value in (("num_stages", num_stages), ("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"Schedule {name!r}: {field} must be an int >= 1, got {value!r}.")
        v = self.stages_per_rank
        if v is not None and num_stages != v * num_ranks:
            raise ScheduleError(
                f"Schedule {name!r} needs exactly {v} stage(s) per rank (num_stages == {v} * num_ranks), "
                f"got num_stages={num_stages}, num_ranks={num_ranks}. Use num_stages={v * num_ranks} for "
                f"num_ranks={num_ranks}"
                + (f", or num_ranks={num_stages // v} for num_stages={num_stages}." if num_stages % v == 0 else ".")
            )
        if v is None and num_stages % num_ranks:
            lower = num_stages - num_stages % num_ranks
            raise ScheduleError(
                f"Schedule {name!r} needs num_stages to be a multiple of num_ranks, got num_stages={num_stages}, "
                f"num_ranks={num_ranks} ({num_stages} % {num_ranks} = {num_stages % num_ranks}). Use num_stages="
                + (f"{lower} or {lower + num_ranks}." if lower else f"{num_ranks}.")
            )
        if self.microbatches_multiple_of_ranks and num_microbatches % num_ranks:
            lower = num_microbatches - num_microbatches % num_ranks
            raise ScheduleError(
                f"Schedule {name!r} needs num_microbatches to be a multiple of num_ranks, got "
                f"num_microbatches={num_microbatches}, num_ranks={num_ranks}. Use num_microbatches="
                + (f"{lower} or {lower + num_ranks}." if lower else f"{num_ranks}.")
            )
        if self.microbatches_at_least_stages and num_microbatches < num_stages:
            fewer = (f", or num_ranks={num_microbatches // v} (num_stages={num_microbatches // v * v}) for "
                     f"num_microbatches={num_microbatches}" if v and num_microbatches >= v else "")
            raise ScheduleError(
                f"Schedule {name!r} needs at least as many microbatches as stages (num_microbatches >= "
                f"num_stages), got num_microbatches={num_microbatches} for num_stages={num_stages} (num_ranks={num_ranks}). "
                f"Use num_microbatches={num_stages} or more{fewer}."
            )
        if num_microbatches < self.min_microbatches:
            raise ScheduleError(
                f"Schedule {name!r} needs num_microbatches >= {self.min_microbatches}, got {num_microbatches}. "
                f"Use at least {self.min_microbatches} microbatches."
            )


@dataclass(frozen=True)
class RegisteredSchedule:
    """One registry entry."""

    name: str
    fn: ScheduleFn
    constraints: ScheduleConstraints
    description: str


# The one piece of mutable module state: the explicit registry that @register_schedule fills.
_REGISTRY: dict[str, RegisteredSchedule] = {}


def register_schedule(
    name: str,
    *,
    stages_per_rank: int | None = 1,
    microbatches_multiple_of_ranks: bool = False,
    min_microbatches: int = 1,
    microbatches_at_least_stages: bool = False,
    replace: bool = False,
) -> Callable[[ScheduleFn], ScheduleFn]:
    """Register ``fn(num_stages, num_ranks, num_microbatches)`` under ``name``; returns ``fn`` unchanged.

    The function returns a :class:`Schedule` or per-rank action lists (Actions or text
    such as ``"0F1"``); :func:`get_schedule` checks the declared constraints before
    calling it and validates what it returns.

    >>> @register_schedule("doc_fwd_then_bwd", replace=True)
    ... def fwd_then_bwd(num_stages, num_ranks, num_microbatches):
    ...     mbs = range(num_microbatches)
    ...     return [[f"{s}F{m}" for m in mbs] + [f"{s}B{m}" for m in mbs] for s in range(num_stages)]
    >>> get_schedule("doc_fwd_then_bwd", num_ranks=2, num_microbatches=2).actions[1][2]
    Action(stage=1, kind=<ActionKind.FULL_BACKWARD: 'B'>, microbatch=0)
    """
    if not isinstance(name, str) or not name:
        raise ScheduleError(f"A schedule name must be a non-empty string, got {name!r}.")
    constraints = ScheduleConstraints(
        stages_per_rank, microbatches_multiple_of_ranks, min_microbatches, microbatches_at_least_stages
    )

    def decorator(fn: ScheduleFn) -> ScheduleFn:
        if name in _REGISTRY and not replace:
            raise ScheduleError(
                f"A schedule named {name!r} is already registered ({_REGISTRY[name].fn!r}). Pick another "
                "name, pass replace=True, or call unregister_schedule() first."
            )
        summary = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]  # the first paragraph, whole
        _REGISTRY[name] = RegisteredSchedule(name, fn, constraints, " ".join(summary.split()))
        return fn

    return decorator


def unregister_schedule(name: str) -> None:
    """Remove a registered schedule (mainly for tests)."""
    _lookup(name)
    del _REGISTRY[name]


def list_schedules() -> tuple[str, ...]:
    """Names of the registered schedules, sorted.

    >>> "1f1b" in list_schedules()
    True
    """
    return tuple(sorted(_REGISTRY))


def schedule_info(name: str) -> RegisteredSchedule:
    """The registry entry for ``name``: function, constraints and one-line description."""
    return _lookup(name)


def _lookup(name: str) -> RegisteredSchedule:
    if not isinstance(name, str):
        raise ScheduleError(f"a schedule is given by name (a str, e.g. '1f1b') or as a built Schedule, got {name!r} "
                            f"({type(name).__name__}). Known schedules: {', '.join(list_schedules())}.")
    if name in _REGISTRY:
        return _REGISTRY[name]
    hint = did_you_mean(name, _REGISTRY, n=1, sentence=True)
    raise ScheduleError(f"Unknown schedule {name!r}.{hint} Known schedules: {', '.join(list_schedules())}.")


def _complete_sizes(name: str, v: int | None, num_stages: int | None, num_ranks: int | None) -> tuple[int, int]:
    """Fill in whichever of num_stages / num_ranks is missing from the stages-per-rank rule."""
    if num_stages is not None and num_ranks is not None:
        return num_stages, num_ranks
    if v is None or (num_stages is None and num_ranks is None):
        raise ScheduleError(
            f"Schedule {name!r}: give both num_stages and num_ranks (got num_stages={num_stages}, num_ranks={num_ranks})"
            + ("; it holds a variable number of stages per rank." if v is None else ".")
        )
    given = num_stages if num_ranks is None else num_ranks
    if not isinstance(given, int) or isinstance(given, bool) or given < 1:
        raise ScheduleError(f"Schedule {name!r}: sizes must be ints >= 1, got {given!r}.")
    if num_stages is None:
        return v * given, given
    if given % v:
        raise ScheduleError(
            f"Schedule {name!r} holds {v} stages per rank, so num_stages must be a multiple of {v}; "
            f"got num_stages={given}. Use num_stages={given - given % v or v}."
        )
    return given, given // v


@num_keywords
def get_schedule(
    name: str,
    *,
    num_stages: int | None = None,
    num_ranks: int | None = None,
    num_microbatches: int,
) -> Schedule:
    """Build the registered schedule ``name`` for the given sizes and validate it.

    For schedules with a fixed number of stages per rank, either of ``num_stages`` and
    ``num_ranks`` may be left out and is derived from the other.

    >>> s = get_schedule("1f1b", num_stages=4, num_ranks=4, num_microbatches=8)
    >>> " ".join(map(str, s.actions[0][:7]))
    '0F0 0F1 0F2 0F3 0B0 0F4 0B1'
    """
    entry = _lookup(name)
    num_stages, num_ranks = _complete_sizes(name, entry.constraints.stages_per_rank, num_stages, num_ranks)
    entry.constraints.check(name, num_stages, num_ranks, num_microbatches)
    result = entry.fn(num_stages, num_ranks, num_microbatches)
    schedule = result if isinstance(result, Schedule) else Schedule.from_lists(
        name, result, num_stages=num_stages, num_microbatches=num_microbatches
    )
    got = (schedule.num_stages, schedule.num_ranks, schedule.num_microbatches)
    if got != (num_stages, num_ranks, num_microbatches):
        raise ScheduleError(
            f"Schedule function for {name!r} returned num_stages, num_ranks, num_microbatches = {got}, but "
            f"{(num_stages, num_ranks, num_microbatches)} were requested. Fix the function to honour its arguments."
        )
    return validate(dataclasses.replace(schedule, name=name))


@num_keywords
def resolve_schedule(schedule: str | Schedule, num_stages: int, num_ranks: int | None, num_microbatches: int) -> Schedule:
    """``schedule`` (a name or a built Schedule) for ``num_stages`` stages and ``num_microbatches``: a name is
    built (``num_ranks`` defaulting to half the stages where the schedule leaves it free); a Schedule is
    checked against the stage and microbatch counts and validated."""
    if isinstance(schedule, Schedule):
        if schedule.num_stages != num_stages:
            raise ScheduleError(
                f"schedule {schedule.name!r} is for {schedule.num_stages} stages but the program has {num_stages}."
            )
        if schedule.num_microbatches != num_microbatches:
            raise ScheduleError(
                f"schedule {schedule.name!r} runs {schedule.num_microbatches} microbatches but num_microbatches="
                f"{num_microbatches}; make them agree."
            )
        return validate(schedule)
    if num_ranks is None and schedule_info(schedule).constraints.stages_per_rank is None:
        num_ranks = max(1, num_stages // 2)
    return get_schedule(schedule, num_stages=num_stages, num_ranks=num_ranks, num_microbatches=num_microbatches)
