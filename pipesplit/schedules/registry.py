"""The explicit registry of named schedules, their constraints, and get_schedule()."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

from pipesplit.errors import ScheduleError, did_you_mean
from pipesplit.schedules.actions import Action
from pipesplit.schedules.schedule import Schedule
from pipesplit.schedules.validate import validate

ScheduleResult = Union[Schedule, Sequence[Sequence[Union[Action, str]]]]
ScheduleFn = Callable[[int, int, int], ScheduleResult]
"""``fn(n_stages, n_ranks, n_microbatches)`` returning a Schedule or per-rank action lists."""


@dataclass(frozen=True)
class ScheduleConstraints:
    """What a schedule needs of its sizes; checked before the schedule function runs."""

    stages_per_rank: int | None = 1
    """Exact number of stages each rank holds; ``None``: any whole number (n_stages % n_ranks == 0)."""
    microbatches_multiple_of_ranks: bool = False
    """Whether n_microbatches must be a multiple of n_ranks (interleaved 1F1B)."""
    min_microbatches: int = 1
    """Smallest n_microbatches the schedule supports."""
    microbatches_at_least_stages: bool = False
    """Whether n_microbatches must be >= n_stages (DualPipeV fills its V with them)."""

    def check(self, name: str, n_stages: int, n_ranks: int, n_microbatches: int) -> None:
        """Raise ScheduleError naming the violated constraint, the numbers and a fix."""
        for field, value in (("n_stages", n_stages), ("n_ranks", n_ranks), ("n_microbatches", n_microbatches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"Schedule {name!r}: {field} must be an int >= 1, got {value!r}.")
        v = self.stages_per_rank
        if v is not None and n_stages != v * n_ranks:
            raise ScheduleError(
                f"Schedule {name!r} needs exactly {v} stage(s) per rank (n_stages == {v} * n_ranks), "
                f"got n_stages={n_stages}, n_ranks={n_ranks}. Use n_stages={v * n_ranks} for "
                f"n_ranks={n_ranks}"
                + (f", or n_ranks={n_stages // v} for n_stages={n_stages}." if n_stages % v == 0 else ".")
            )
        if v is None and n_stages % n_ranks:
            lower = n_stages - n_stages % n_ranks
            raise ScheduleError(
                f"Schedule {name!r} needs n_stages to be a multiple of n_ranks, got n_stages={n_stages}, "
                f"n_ranks={n_ranks} ({n_stages} % {n_ranks} = {n_stages % n_ranks}). Use n_stages="
                + (f"{lower} or {lower + n_ranks}." if lower else f"{n_ranks}.")
            )
        if self.microbatches_multiple_of_ranks and n_microbatches % n_ranks:
            lower = n_microbatches - n_microbatches % n_ranks
            raise ScheduleError(
                f"Schedule {name!r} needs n_microbatches to be a multiple of n_ranks, got "
                f"n_microbatches={n_microbatches}, n_ranks={n_ranks}. Use n_microbatches="
                + (f"{lower} or {lower + n_ranks}." if lower else f"{n_ranks}.")
            )
        if self.microbatches_at_least_stages and n_microbatches < n_stages:
            fewer = (f", or n_ranks={n_microbatches // v} (n_stages={n_microbatches // v * v}) for "
                     f"n_microbatches={n_microbatches}" if v and n_microbatches >= v else "")
            raise ScheduleError(
                f"Schedule {name!r} needs at least as many microbatches as stages (n_microbatches >= "
                f"n_stages), got n_microbatches={n_microbatches} for n_stages={n_stages} (n_ranks={n_ranks}). "
                f"Use n_microbatches={n_stages} or more{fewer}."
            )
        if n_microbatches < self.min_microbatches:
            raise ScheduleError(
                f"Schedule {name!r} needs n_microbatches >= {self.min_microbatches}, got {n_microbatches}. "
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
    """Register ``fn(n_stages, n_ranks, n_microbatches)`` under ``name``; returns ``fn`` unchanged.

    The function returns a :class:`Schedule` or per-rank action lists (Actions or text
    such as ``"0F1"``); :func:`get_schedule` checks the declared constraints before
    calling it and validates what it returns.

    >>> @register_schedule("doc_fwd_then_bwd", replace=True)
    ... def fwd_then_bwd(n_stages, n_ranks, n_microbatches):
    ...     mbs = range(n_microbatches)
    ...     return [[f"{s}F{m}" for m in mbs] + [f"{s}B{m}" for m in mbs] for s in range(n_stages)]
    >>> get_schedule("doc_fwd_then_bwd", n_ranks=2, n_microbatches=2).actions[1][2]
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
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = RegisteredSchedule(name, fn, constraints, doc[0] if doc else "")
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
    if name in _REGISTRY:
        return _REGISTRY[name]
    hint = did_you_mean(name, _REGISTRY, n=1, sentence=True)
    raise ScheduleError(f"Unknown schedule {name!r}.{hint} Known schedules: {', '.join(list_schedules())}.")


def _complete_sizes(name: str, v: int | None, n_stages: int | None, n_ranks: int | None) -> tuple[int, int]:
    """Fill in whichever of n_stages / n_ranks is missing from the stages-per-rank rule."""
    if n_stages is not None and n_ranks is not None:
        return n_stages, n_ranks
    if v is None or (n_stages is None and n_ranks is None):
        raise ScheduleError(
            f"Schedule {name!r}: give both n_stages and n_ranks (got n_stages={n_stages}, n_ranks={n_ranks})"
            + ("; it holds a variable number of stages per rank." if v is None else ".")
        )
    given = n_stages if n_ranks is None else n_ranks
    if not isinstance(given, int) or isinstance(given, bool) or given < 1:
        raise ScheduleError(f"Schedule {name!r}: sizes must be ints >= 1, got {given!r}.")
    if n_stages is None:
        return v * given, given
    if given % v:
        raise ScheduleError(
            f"Schedule {name!r} holds {v} stages per rank, so n_stages must be a multiple of {v}; "
            f"got n_stages={given}. Use n_stages={given - given % v or v}."
        )
    return given, given // v


def get_schedule(
    name: str,
    *,
    n_stages: int | None = None,
    n_ranks: int | None = None,
    n_microbatches: int,
) -> Schedule:
    """Build the registered schedule ``name`` for the given sizes and validate it.

    For schedules with a fixed number of stages per rank, either of ``n_stages`` and
    ``n_ranks`` may be left out and is derived from the other.

    >>> s = get_schedule("1f1b", n_stages=4, n_ranks=4, n_microbatches=8)
    >>> " ".join(map(str, s.actions[0][:7]))
    '0F0 0F1 0F2 0F3 0B0 0F4 0B1'
    """
    entry = _lookup(name)
    n_stages, n_ranks = _complete_sizes(name, entry.constraints.stages_per_rank, n_stages, n_ranks)
    entry.constraints.check(name, n_stages, n_ranks, n_microbatches)
    result = entry.fn(n_stages, n_ranks, n_microbatches)
    schedule = result if isinstance(result, Schedule) else Schedule.from_lists(
        name, result, n_stages=n_stages, n_microbatches=n_microbatches
    )
    got = (schedule.n_stages, schedule.n_ranks, schedule.n_microbatches)
    if got != (n_stages, n_ranks, n_microbatches):
        raise ScheduleError(
            f"Schedule function for {name!r} returned n_stages, n_ranks, n_microbatches = {got}, but "
            f"{(n_stages, n_ranks, n_microbatches)} were requested. Fix the function to honour its arguments."
        )
    return validate(dataclasses.replace(schedule, name=name))


def resolve_schedule(schedule: str | Schedule, n_stages: int, n_ranks: int | None, n_microbatches: int) -> Schedule:
    """``schedule`` (a name or a built Schedule) for ``n_stages`` stages and ``n_microbatches``: a name is
    built (``n_ranks`` defaulting to half the stages where the schedule leaves it free); a Schedule is
    checked against the stage and microbatch counts and validated."""
    if isinstance(schedule, Schedule):
        if schedule.n_stages != n_stages:
            raise ScheduleError(
                f"schedule {schedule.name!r} is for {schedule.n_stages} stages but the program has {n_stages}."
            )
        if schedule.n_microbatches != n_microbatches:
            raise ScheduleError(
                f"schedule {schedule.name!r} runs {schedule.n_microbatches} microbatches but n_microbatches="
                f"{n_microbatches}; make them agree."
            )
        return validate(schedule)
    if n_ranks is None and schedule_info(schedule).constraints.stages_per_rank is None:
        n_ranks = max(1, n_stages // 2)
    return get_schedule(schedule, n_stages=n_stages, n_ranks=n_ranks, n_microbatches=n_microbatches)
