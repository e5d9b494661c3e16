"""Shared helpers for the benchmark scripts: machine header, repeat timing, markdown tables."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from pipesplit.bench.load import usable_cores


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux, else ``platform``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> dict[str, Any]:
    """What a benchmark result depends on: CPU, cores, threads, library versions, load."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 1,
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "os": f"{platform.system()} {platform.release()}",
    }
    if torch.cuda.is_available():
        info["gpu"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return info


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return "n/a"


def now() -> str:
    """The date and time in UTC, to the minute."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


CLOCKS: dict[str, Callable[[], float]] = {
    "cpu": time.process_time,  # this process's CPU time: steadier on a shared machine
    "wall": time.perf_counter,
}
CLOCK_NOTES = {
    "cpu": "process CPU time (time.process_time), which other processes on the machine disturb less than wall time",
    "wall": "wall time (time.perf_counter)",
}


def header(title: str, command: str | None = None, notes: Sequence[str] = ()) -> str:
    """A markdown block naming the benchmark, the date, the machine, the command and ``notes``."""
    m = machine()
    cores = f"{m['cores']} logical cores" + (
        f" ({m['usable_cores']} usable)" if m["usable_cores"] != m["cores"] else ""
    )
    lines = [
        f"## {title}",
        "",
        f"- date: {now()}",
        f"- machine: {m['cpu']}, {cores}; {m['os']}" + (f"; GPU: {m['gpu']}" if "gpu" in m else ""),
        f"- software: Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}; "
        f"torch threads: {m['torch_threads']}",
        f"- load average at start (1/5/15 min): {load_average()}",
    ]
    if command is None:
        command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    lines.append(f"- command: `{command}`")
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


def best_of(
    fn: Callable[[], Any], repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, Any]:
    """Minimum time (by ``clock``) of ``repeats`` calls of ``fn``, and the last call's result."""
    best, result = float("inf"), None
    for _ in range(max(1, repeats)):
        start = clock()
        result = fn()
        best = min(best, clock() - start)
    return best, result


def round_robin(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Per name, ``repeats`` wall times of its function, timed one of each per round.

    The order rotates every round so no variant always follows the same one.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def seconds(x: float) -> str:
    """Seconds with three significant figures (``0.00123``, ``1.23``, ``123``)."""
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) >= 0.001 else f"{x:.2e}"


def ratio(x: float) -> str:
    """A ratio with three significant figures (``0.0652``, ``6.6``, ``19.3``)."""
    return f"{x:.3g}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` has one letter per column (``l``, ``r``, ``c``).

    >>> print(markdown_table(["a", "b"], [[1, "x"]], "rl"))
    | a | b |
    |--:|:--|
    | 1 | x |
    """
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} letters for {len(headers)} columns")
    rule = {"l": ":--", "r": "--:", "c": ":-:"}
    out = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row has {len(row)} cells for {len(headers)} columns: {row!r}")
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def emit(text: str = "") -> None:
    """Print and flush (benchmarks run long; show each table as soon as it is done)."""
    print(text, flush=True)


# glibc malloc hands blocks above MALLOC_MMAP_THRESHOLD_ (128 KiB to 32 MiB, adaptive) to
# the kernel as fresh mappings, so a stage that allocates a 33 MB weight gradient page-
# faults and zeroes it on every call: on a shared virtual machine that alone swung one
# stage's time by 30-60%. With these settings freed memory stays in the heap for reuse,
# as it does under the jemalloc/tcmalloc setups common for PyTorch on CPU.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(2**32),
    "MALLOC_TRIM_THRESHOLD_": str(2**36),
    "MALLOC_TOP_PAD_": str(2**28),
}


def reuse_freed_memory(enabled: bool = True) -> str:
    """Re-run this script once with ``MALLOC_ENV`` set (glibc reads it at start); returns a note for the header."""
    if not enabled:
        return "glibc malloc defaults"
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return "glibc malloc keeps freed memory for reuse (" + ", ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()) + ")"
    if not platform.system() == "Linux":
        return "allocator defaults (not Linux)"
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    raise AssertionError("unreachable")
