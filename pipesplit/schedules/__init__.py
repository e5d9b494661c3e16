"""Pipeline schedules as pure data: actions, a registry, a validator and a simulator."""

from pipesplit.schedules import builtin as _builtin  # noqa: F401  (registers the built-ins)
from pipesplit.schedules import zero_bubble as _zero_bubble  # noqa: F401
from pipesplit.schedules import dualpipe as _dualpipe  # noqa: F401
from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.io import (
    load_schedule,
    save_schedule,
    schedule_from_csv,
    schedule_from_text,
    schedule_to_csv,
    schedule_to_text,
)
from pipesplit.schedules.registry import (
    ScheduleConstraints,
    get_schedule,
    list_schedules,
    register_schedule,
    resolve_schedule,
    schedule_info,
    unregister_schedule,
)
from pipesplit.schedules.schedule import Schedule, with_communication
from pipesplit.schedules.costs import StageCost
from pipesplit.schedules.simulate import simulate
from pipesplit.schedules.timeline import TimedAction, Timeline
from pipesplit.schedules.torch_format import from_torch_actions, from_torch_csv, to_torch_actions, to_torch_csv
from pipesplit.schedules.validate import validate

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleConstraints",
    "StageCost",
    "TimedAction",
    "Timeline",
    "from_torch_actions",
    "from_torch_csv",
    "get_schedule",
    "list_schedules",
    "load_schedule",
    "register_schedule",
    "resolve_schedule",
    "save_schedule",
    "schedule_from_csv",
    "schedule_from_text",
    "schedule_info",
    "schedule_to_csv",
    "schedule_to_text",
    "simulate",
    "to_torch_actions",
    "to_torch_csv",
    "unregister_schedule",
    "validate",
    "with_communication",
]
