"""Save and load schedules as text (one line per rank) or CSV (one row per rank)."""

from __future__ import annotations

import csv
import io as _io
import re
from collections.abc import Sequence
from pathlib import Path

from pipesplit.errors import ScheduleError
from pipesplit.schedules.actions import Action
from pipesplit.schedules.schedule import Schedule
from pipesplit.schedules.validate import validate
from pipesplit.deprecation import NUM_RENAMES, num_keywords

_EMPTY_RANK = "-"
"""Stands for a rank with no actions, so blank lines can be ignored."""
_PAIR = "&"
"""Joins an overlapped pair into one token: ``0F3&3B1`` (see ``Schedule.overlap``)."""
_HEADER_KEYS = ("name", "num_stages", "num_microbatches", "stage_to_rank")


def schedule_to_text(schedule: Schedule) -> str:
    """The text form: ``# key: value`` header lines, then one line of actions per rank.

    An overlapped pair is one token, forward and backward joined by ``&`` (``0F3&3B1``).

    >>> from pipesplit.schedules import get_schedule
    >>> print(schedule_to_text(get_schedule("gpipe", num_ranks=2, num_microbatches=2)))
    # name: gpipe
    # num_stages: 2
    # num_microbatches: 2
    # stage_to_rank: 0 1
    0F0 0F1 0B0 0B1
    1F0 1F1 1B0 1B1
    """
    lines = [f"# {key}: {value}" for key, value in _header(schedule)]
    lines += [" ".join(tokens(schedule, rank)) or _EMPTY_RANK for rank in range(schedule.num_ranks)]
    return "\n".join(lines)


@num_keywords
def schedule_from_text(
    text: str,
    *,
    name: str | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
    check: bool = True,
) -> Schedule:
    """Parse the text form; actions are separated by spaces and/or commas.

    Header lines are optional; sizes not given by a header or an argument are inferred
    (arguments win over the header). With ``check`` the result is validated.

    >>> s = schedule_from_text("0F0, 0B0\\n1F0 1B0")
    >>> s.num_ranks, s.stage_to_rank
    (2, (0, 1))
    """
    rows, header = _split_text(text)
    return _build(rows, header, name, num_stages, num_microbatches, stage_to_rank, check)


def schedule_to_csv(schedule: Schedule) -> str:
    """CSV form: ``#``-prefixed header rows, then one row of actions per rank."""
    buffer = _io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for key, value in _header(schedule):
        writer.writerow([f"# {key}: {value}"])
    for rank in range(schedule.num_ranks):
        writer.writerow(tokens(schedule, rank) or [_EMPTY_RANK])
    return buffer.getvalue()


@num_keywords
def schedule_from_csv(
    text: str,
    *,
    name: str | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
    check: bool = True,
) -> Schedule:
    """Parse the CSV form (see :func:`schedule_to_csv`); empty cells are ignored."""
    rows, header = _split_csv(text)
    return _build(rows, header, name, num_stages, num_microbatches, stage_to_rank, check)


def save_schedule(schedule: Schedule, path: str | Path) -> Path:
    """Write ``schedule`` to ``path``: CSV if it ends in ``.csv``, the text form otherwise.

    >>> import tempfile, os
    >>> from pipesplit.schedules import get_schedule
    >>> s = get_schedule("1f1b", num_ranks=4, num_microbatches=8)
    >>> load_schedule(save_schedule(s, os.path.join(tempfile.mkdtemp(), "s.csv"))) == s
    True
    """
    out = Path(path)
    body = schedule_to_csv(schedule) if out.suffix.lower() == ".csv" else schedule_to_text(schedule) + "\n"
    out.write_text(body, encoding="utf-8")
    return out


@num_keywords
def load_schedule(
    path: str | Path,
    *,
    name: str | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
    check: bool = True,
) -> Schedule:
    """Read a schedule saved by :func:`save_schedule` or written by hand, and validate it.

    The format follows the suffix (``.csv`` or text). ``name`` defaults to the header's
    or the file stem; other sizes are inferred unless given.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as err:
        raise ScheduleError(f"Cannot read schedule file {str(source)!r}: {err}.") from err
    rows, header = (_split_csv if source.suffix.lower() == ".csv" else _split_text)(text)
    name = name or header.get("name") or source.stem
    try:
        return _build(rows, header, name, num_stages, num_microbatches, stage_to_rank, check)
    except ScheduleError as err:
        raise ScheduleError(f"In {str(source)!r}: {err}") from err


def tokens(schedule: Schedule, rank: int, pair: str = "{}&{}") -> list[str]:
    """Rank ``rank``'s actions as text, each overlapped pair as one token formatted by ``pair``."""
    actions = schedule.actions[rank]
    out: list[str] = []
    i = 0
    while i < len(actions):
        partner = schedule.overlap_partner.get(actions[i])
        if partner is not None and i + 1 < len(actions) and actions[i + 1] == partner:
            out.append(pair.format(actions[i], partner))
            i += 2
        else:
            out.append(str(actions[i]))
            i += 1
    return out


def _split_text(text: str) -> tuple[list[list[str]], dict[str, str]]:
    header: dict[str, str] = {}
    rows: list[list[str]] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            _read_header(stripped, header)
        elif stripped:
            rows.append([] if stripped == _EMPTY_RANK else [t for t in re.split(r"[\s,]+", stripped) if t])
    return rows, header


def _split_csv(text: str) -> tuple[list[list[str]], dict[str, str]]:
    header: dict[str, str] = {}
    rows: list[list[str]] = []
    for raw in csv.reader(_io.StringIO(text)):
        cells = [c.strip() for c in raw if c.strip()]
        if cells and cells[0].startswith("#"):
            _read_header(",".join(cells), header)
        elif cells:
            rows.append([] if cells == [_EMPTY_RANK] else cells)
    return rows, header


def _header(schedule: Schedule) -> list[tuple[str, str]]:
    return [
        ("name", schedule.name),
        ("num_stages", str(schedule.num_stages)),
        ("num_microbatches", str(schedule.num_microbatches)),
        ("stage_to_rank", " ".join(map(str, schedule.stage_to_rank))),
    ]


def _read_header(line: str, header: dict[str, str]) -> None:
    key, sep, value = line.lstrip("#").strip().partition(":")
    key = NUM_RENAMES.get(key.strip(), key.strip())  # files saved before 0.2 say n_stages, n_microbatches
    if sep and key in _HEADER_KEYS:
        header[key] = value.strip()


def _build(
    rows: list[list[str]],
    header: dict[str, str],
    name: str | None,
    num_stages: int | None,
    num_microbatches: int | None,
    stage_to_rank: Sequence[int] | None,
    check: bool,
) -> Schedule:
    if not rows:
        raise ScheduleError("The schedule text has no rank lines; write one line of actions per rank.")
    try:
        if num_stages is None and "num_stages" in header:
            num_stages = int(header["num_stages"])
        if num_microbatches is None and "num_microbatches" in header:
            num_microbatches = int(header["num_microbatches"])
        if stage_to_rank is None and "stage_to_rank" in header:
            stage_to_rank = [int(t) for t in re.split(r"[\s,]+", header["stage_to_rank"]) if t]
    except ValueError as err:
        raise ScheduleError(f"Malformed schedule header {header}: {err}. Sizes must be integers.") from err
    actions: list[list[Action]] = []
    pairs: list[tuple[Action, Action]] = []
    for rank, row in enumerate(rows):
        actions.append([])
        for pos, token in enumerate(row):
            parsed = [_parse_at(part, rank, pos) for part in token.split(_PAIR)]
            if len(parsed) > 2:
                raise ScheduleError(f"Rank {rank}, position {pos}: {token!r} joins {len(parsed)} actions with "
                                    f"{_PAIR!r}; an overlapped pair is one forward and one backward, e.g. '0F3&3B1'.")
            if len(parsed) == 2:
                pairs.append((parsed[0], parsed[1]))
            actions[-1] += parsed
    schedule = Schedule.from_lists(
        name or header.get("name") or "loaded", actions,
        num_stages=num_stages, num_microbatches=num_microbatches, stage_to_rank=stage_to_rank, overlap=pairs,
    )
    return validate(schedule) if check else schedule


def _parse_at(token: str, rank: int, pos: int) -> Action:
    try:
        return Action.parse(token)
    except ScheduleError as err:
        raise ScheduleError(f"Rank {rank}, position {pos}: {err}") from err
