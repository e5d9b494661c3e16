"""How busy the machine is while a benchmark runs: load average and the CPU time other processes took.

The load average alone cannot tell: it counts the benchmark's own process (and whatever it did
in the minute before). What counts is the CPU time every *other* process used between the
start and the end of the run (Linux ``/proc``; elsewhere only the load average is reported).
"""

from __future__ import annotations

import os
import time
from typing import Any


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (name, user + system clock ticks) of every other process (empty without ``/proc``)."""
    me, out = os.getpid(), {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[pid] = (name, int(fields[11]) + int(fields[12]))  # utime, stime
    return out


def machine_load() -> dict[str, Any]:
    """A snapshot: the 1-minute load average, the usable cores, and the other processes' CPU ticks."""
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return {"load_1min": load, "cores": usable_cores(), "time": time.monotonic(), "ticks": _cpu_ticks()}


def others_busy(before: dict[str, Any], after: dict[str, Any], limit: int = 4) -> tuple[float, list[str]]:
    """The share of the machine's cores other processes used between two snapshots, and the busiest of them."""
    elapsed = max(after["time"] - before["time"], 1e-9)
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used = []
    for pid, (name, ticks) in after["ticks"].items():
        start = before["ticks"].get(pid, (name, 0))[1]
        seconds = (ticks - start) / hz
        if seconds > 0:
            used.append((seconds, f"{name} ({pid}): {100 * seconds / elapsed:.0f}% of a core"))
    used.sort(reverse=True)
    share = sum(s for s, _ in used) / (elapsed * after["cores"])
    return share, [text for s, text in used[:limit] if s > 0.05 * elapsed]


def load_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a result keeps of two snapshots: load averages, cores, the other processes' share and the busiest."""
    share, busiest = others_busy(before, after)
    return {"load_1min_before": before["load_1min"], "load_1min_after": after["load_1min"], "cores": after["cores"],
            "others_share": share, "busiest": busiest}


def load_warning(summary: dict[str, Any]) -> str | None:
    """A sentence when other processes took more than a tenth of the cores during the run; None otherwise."""
    if summary["others_share"] <= 0.1:
        return None
    return (f"the machine was busy: other processes used {100 * summary['others_share']:.0f}% of its "
            f"{summary['cores']} core(s) during the run ({'; '.join(summary['busiest']) or 'many small ones'}; load "
            f"average {_load(summary['load_1min_before'])} before, {_load(summary['load_1min_after'])} after), so measured times "
            "include waiting for the CPU; re-run on a quiet machine for figures to keep.")


def _load(value: float | None) -> str:
    """A load average as ``uptime`` prints it (11.27, not 11.27001953125); "unknown" where the OS has none."""
    return "unknown" if value is None else f"{value:.2f}"
