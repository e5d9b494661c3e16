"""PyTorch's schedule CSV (torch.distributed.pipelining, torchtitan): one row of action cells per rank."""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from pipesplit.compat import torch_csv_send_waits
from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action, ActionKind
from pipesplit.schedules.io import tokens
from pipesplit.schedules.schedule import Schedule
from pipesplit.schedules.validate import validate
from pipesplit.deprecation import num_keywords

OVERLAP = "OVERLAP_F_B"
"""torch's kind for a group of actions run together: ``(0F3;3B1)OVERLAP_F_B``."""
FSDP_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "WAIT_REDUCE_GRAD")
"""torch's actions for FSDP-sharded stages and the gradient reduction after the last backward."""
SEND_WAITS = {"WAIT_SEND_F": "SEND_F", "WAIT_SEND_B": "SEND_B"}
"""torch 2.15's wait for an earlier send (matched by stage and microbatch); pipesplit's executors
wait for their sends themselves, so reading drops them."""
_CELL = re.compile(r"(\d+)([A-Z_]+?)(\d*)")
_GROUP = re.compile(r"\((.*)\)([A-Z_]+)")
_KINDS = {kind.value: kind for kind in ActionKind}


def to_torch_actions(schedule: Schedule, *, send_waits: bool | None = None) -> list[list[str]]:
    """Per rank, the cells torch's ``_Action.from_str`` reads back: ``2F0``, ``0I2``,
    ``1SEND_B4``, and each overlapped pair as ``(0F3;3B1)OVERLAP_F_B``.

    ``send_waits`` (default: whether the installed torch needs them, torch >= 2.15) adds after
    each send the ``WAIT_SEND_F``/``WAIT_SEND_B`` torch 2.15's loader requires, where torch's
    own lowering puts it: a forward send's after the rank's backward of that stage and
    microbatch (which proves the peer received it), the others at the end of the row.

    >>> from pipesplit.schedules import get_schedule, with_communication
    >>> to_torch_actions(get_schedule("1f1b", num_ranks=2, num_microbatches=2))
    [['0F0', '0F1', '0B0', '0B1'], ['1F0', '1B0', '1F1', '1B1']]
    >>> to_torch_actions(with_communication(get_schedule("gpipe", num_ranks=2, num_microbatches=1)), send_waits=True)
    [['0F0', '0SEND_F0', '0RECV_B0', '0B0', '0WAIT_SEND_F0'], ['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1WAIT_SEND_B0']]
    """
    waits = torch_csv_send_waits() if send_waits is None else send_waits
    rows = [tokens(schedule, rank, pair=f"({{}};{{}}){OVERLAP}") for rank in range(schedule.num_ranks)]
    if waits:
        rows = [_with_send_waits(schedule.actions[rank], row) for rank, row in enumerate(rows)]
    return rows


def _with_send_waits(actions: Sequence[Action], row: list[str]) -> list[str]:
    """``row`` (the cells of ``actions``) with one wait per send, placed as torch 2.15's
    ``_add_wait_send`` places them; a cell holds one action or an overlapped pair of them."""
    pending: dict[tuple[ActionKind, int, int], None] = {}  # sends not yet waited for, in order
    out: list[str] = []
    i = 0
    for cell in row:
        width = 2 if cell.startswith("(") else 1
        out.append(cell)
        for action in actions[i:i + width]:
            if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                pending[(action.kind, action.stage, action.microbatch)] = None
            elif action.kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT):
                key = (ActionKind.SEND_F, action.stage, action.microbatch)
                if key in pending:
                    del pending[key]
                    out.append(f"{action.stage}WAIT_SEND_F{action.microbatch}")
        i += width
    return out + [f"{stage}WAIT_{kind.value}{mb}" for kind, stage, mb in pending]


def to_torch_csv(schedule: Schedule, path: str | Path, *, send_waits: bool | None = None) -> Path:
    """Write ``schedule`` as the CSV that torch's ``_load_csv`` (and torchtitan) read.

    One row per rank, no header: torch infers the stage placement from where stages
    appear. A schedule with SEND/RECV actions loads with ``format="compute_comms"``,
    one without with ``format="compute_only"`` (torch then adds its own communication).
    ``send_waits``: as in :func:`to_torch_actions`; torch 2.15 refuses a compute+comms file
    without them, older torch refuses one with them.

    >>> import tempfile, os
    >>> from pipesplit.schedules import get_schedule
    >>> s = get_schedule("dualpipe_v", num_ranks=2, num_microbatches=4)
    >>> from_torch_csv(to_torch_csv(s, os.path.join(tempfile.mkdtemp(), "dualpipe_v.csv"))) == s
    True
    """
    out = Path(path)
    with out.open("w", newline="", encoding="utf-8") as file:
        csv.writer(file).writerows(to_torch_actions(schedule, send_waits=send_waits))
    return out


@num_keywords
def from_torch_actions(
    rows: Iterable[Sequence[str]],
    *,
    name: str = "torch",
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
    drop_fsdp: bool = False,
    check: bool = True,
) -> Schedule:
    """A schedule from torch's per-rank action cells (``str()`` of torch's ``_Action``).

    ``F``, ``B`` (full backward), ``I``, ``W`` and ``SEND_F``/``RECV_F``/``SEND_B``/
    ``RECV_B`` map to the pipesplit action of the same name; empty cells (torch's idle
    steps) are skipped; an ``OVERLAP_F_B`` group runs its actions in order, and a
    forward followed by a B or I becomes an overlapped pair. torch's FSDP actions
    (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``) are refused unless ``drop_fsdp``: pipesplit
    keeps parameters whole and accumulates gradients in place, so it has nothing to run
    for them. Sizes and placement are inferred unless given; ``check`` validates.

    torch's lowering places a RECV as early as the sender allows and only waits for it at
    the compute, while :func:`simulate` holds the rank at a RECV until its data arrives:
    to predict timings of a loaded compute+comms schedule, simulate its ``compute_only()``.

    >>> s = from_torch_actions([["0F0", "", "(0F1;0B0)OVERLAP_F_B", "0B1"]])
    >>> [str(a) for a in s.actions[0]], [tuple(map(str, p)) for p in s.overlap]
    (['0F0', '0F1', '0B0', '0B1'], [('0F1', '0B0')])
    """
    actions: list[list[Action]] = []
    pairs: list[tuple[Action, Action]] = []
    for rank, row in enumerate(rows):
        actions.append([])
        for pos, cell in enumerate(row):
            text = cell.strip()
            if not text:
                continue
            where = f"Rank {rank}, cell {pos} ({text!r})"
            group = _GROUP.fullmatch(text)
            if group is None:
                actions[-1] += _plain(text, where, drop_fsdp)
                continue
            inner, kind = group.groups()
            if kind != OVERLAP:
                raise ScheduleError(f"{where}: torch groups actions only as (a;b){OVERLAP}, not {kind!r}.")
            members = [a for part in inner.split(";") if part.strip() for a in _plain(part.strip(), where, drop_fsdp)]
            if not members:
                raise ScheduleError(f"{where}: an {OVERLAP} group with no actions; remove the cell.")
            if len(members) == 2 and members[0].kind is ActionKind.FORWARD and members[1].kind.is_backward:
                pairs.append((members[0], members[1]))
            actions[-1] += members
    if not actions:
        raise ScheduleError("The torch schedule has no rows; write one row of actions per rank.")
    schedule = Schedule.from_lists(
        name, actions, num_stages=num_stages, num_microbatches=num_microbatches, stage_to_rank=stage_to_rank, overlap=pairs
    )
    return validate(schedule) if check else schedule


@num_keywords
def from_torch_csv(
    path: str | Path,
    *,
    name: str | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
    drop_fsdp: bool = False,
    check: bool = True,
) -> Schedule:
    """Read a CSV in torch's format (``_dump_csv``, torchtitan's ``pipeline_parallel_schedule_csv``).

    Compute-only and compute+comms files both load; see :func:`from_torch_actions` for
    the mapping and ``drop_fsdp``. ``name`` defaults to the file stem.
    """
    source = Path(path)
    try:
        with source.open(newline="", encoding="utf-8") as file:
            rows = list(csv.reader(file))
    except OSError as err:
        raise ScheduleError(f"Cannot read torch schedule file {str(source)!r}: {err}.") from err
    try:
        return from_torch_actions(
            rows, name=name or source.stem, num_stages=num_stages, num_microbatches=num_microbatches,
            stage_to_rank=stage_to_rank, drop_fsdp=drop_fsdp, check=check,
        )
    except ScheduleError as err:
        raise ScheduleError(f"In {str(source)!r}: {err}") from err


def _plain(text: str, where: str, drop_fsdp: bool) -> list[Action]:
    """One torch action (no group): ``[action]``, or ``[]`` for a dropped FSDP action."""
    found = _CELL.fullmatch(text)
    if found is None:
        raise ScheduleError(
            f"{where}: cannot read {text!r} as a torch action: expected <stage><kind><microbatch> such as "
            f"'2F0', '1SEND_B4', '0UNSHARD', or a group '(0F3;3B1){OVERLAP}'."
        )
    stage, code, microbatch = found.groups()
    if code in SEND_WAITS:
        return []
    if code in FSDP_KINDS:
        if drop_fsdp:
            return []
        raise ScheduleError(
            f"{where}: {code} is torch's FSDP action (unshard/reshard a sharded stage, reduce gradients "
            "after the last backward); pipesplit's executors have nothing to run for it, as they keep "
            "parameters whole and accumulate gradients in place. Pass drop_fsdp=True to drop these "
            "actions, or export torch's compute-only schedule instead."
        )
    kind = _KINDS.get(code)
    if kind is None:
        raise ScheduleError(
            f"{where}: {code!r} is not an action kind pipesplit can run; known: "
            f"{', '.join(_KINDS)} (and torch's {', '.join(FSDP_KINDS)} with drop_fsdp=True)."
        )
    if not microbatch:
        raise ScheduleError(f"{where}: {text!r} names no microbatch; {code} actions need one, e.g. '{stage}{code}0'.")
    return [Action(int(stage), kind, int(microbatch))]
