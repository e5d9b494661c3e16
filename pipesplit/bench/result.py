"""The benchmark's result: one row per configuration, as a table, CSV, Markdown and pictures."""

from __future__ import annotations

import csv
import dataclasses
import io
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from pipesplit.errors import PipesplitError
from pipesplit.units import human_bytes
from pipesplit.deprecation import renamed_attribute


@dataclass(frozen=True)
class BenchRow:
    """Figures of one configuration. Per-stage lists are seconds of one microbatch."""

    n_microbatches = renamed_attribute("n_microbatches", "num_microbatches")
    n_ranks = renamed_attribute("n_ranks", "num_ranks")

    num_stages: int
    schedule: str
    num_microbatches: int
    cost: str
    num_ranks: int
    devices: str
    batch: int
    predicted_fwd_s: tuple[float, ...]
    predicted_bwd_s: tuple[float, ...]
    """Predicted full backward (input- plus weight-gradient) per stage."""
    measured_fwd_s: tuple[float, ...]
    """Median compute time of the stage's forward actions in the pipelined steps."""
    measured_bwd_s: tuple[float, ...]
    """Median full backward (B, or I + W for split-backward schedules) in the pipelined steps."""
    bottleneck_stage: int
    """The stage with the largest measured forward + backward time."""
    predicted_bottleneck_stage: int
    balance: float
    """Time balance: the measured bottleneck stage's forward + backward seconds over the mean stage's
    (1.0 = perfectly balanced); not the report's cost balance, which is of the plan's cost (FLOPs)."""
    predicted_balance: float
    """Time balance as predicted: the cost model's stage seconds at one microbatch, as the simulated step ran them."""
    boundary_bytes: int
    """Bytes crossing stage boundaries in one step (activations forward, gradients back)."""
    predicted_step_s: float
    measured_step_s: float
    """Median wall time of ``Pipeline.step`` over the repeats."""
    measured_step_spread_s: float
    """Half the range (max - min) of the repeats' step times."""
    step_ratio: float
    """measured_step_s / predicted_step_s."""
    predicted_bubble: float
    measured_bubble: float
    """Idle share of the ranks' time in the median step (waits on receives count as idle)."""
    peak_memory_bytes: tuple[float, ...]
    memory_source: str
    """"measured" (CUDA allocator peak of each stage's device) or "estimated" (the cost model's)."""
    throughput: float
    """Samples per second at the measured step time."""
    repeats: int
    lengths: tuple[int, ...] = ()
    """``compile(..., plan_lengths=...)``: the lengths the plan was made for (the inputs cut or repeated to each)."""
    length_weights: tuple[float, ...] = ()
    predicted_length_s: tuple[float, ...] = ()
    """The predicted step at each of ``lengths``."""
    measured_length_s: tuple[float, ...] = ()
    """The median measured step at each of ``lengths``."""

    @property
    def expected_predicted_s(self) -> float | None:
        """The predicted step weighted over ``lengths`` (None without)."""
        return sum(w * s for w, s in zip(self.length_weights, self.predicted_length_s)) if self.lengths else None

    @property
    def expected_measured_s(self) -> float | None:
        """The measured step weighted over ``lengths`` (None without)."""
        return sum(w * s for w, s in zip(self.length_weights, self.measured_length_s)) if self.lengths else None

    @property
    def label(self) -> str:
        return f"{self.num_stages} stages, {self.schedule}, m={self.num_microbatches}, {self.cost}"

    @property
    def measured_stage_s(self) -> tuple[float, ...]:
        return tuple(f + b for f, b in zip(self.measured_fwd_s, self.measured_bwd_s))

    @property
    def predicted_stage_s(self) -> tuple[float, ...]:
        return tuple(f + b for f, b in zip(self.predicted_fwd_s, self.predicted_bwd_s))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def ms_text(x: float) -> str:
    """Milliseconds to 3 significant digits, a second or more as a whole number (never 1.35e+03)."""
    ms = x * 1e3
    return f"{ms:.0f}" if abs(ms) >= 999.5 else f"{ms:.3g}"


def _stages_ms(xs: Sequence[float]) -> str:
    return " / ".join(ms_text(x) for x in xs)


_COLUMNS = [  # (header, cell) for the printed and Markdown tables
    ("stages", lambda r: str(r.num_stages)),
    ("schedule", lambda r: r.schedule),
    ("m", lambda r: str(r.num_microbatches)),
    ("cost", lambda r: r.cost),
    ("pred step ms", lambda r: ms_text(r.predicted_step_s)),
    ("meas step ms", lambda r: f"{ms_text(r.measured_step_s)} ± {ms_text(r.measured_step_spread_s)}"),
    ("meas/pred", lambda r: f"{r.step_ratio:.2f}"),
    ("bubble pred/meas", lambda r: f"{100 * r.predicted_bubble:.0f}% / {100 * r.measured_bubble:.0f}%"),
    ("time balance pred/meas", lambda r: f"{r.predicted_balance:.2f} / {r.balance:.2f}"),
    ("bottleneck pred/meas", lambda r: f"{r.predicted_bottleneck_stage} / {r.bottleneck_stage}"),
    ("boundary/step", lambda r: human_bytes(r.boundary_bytes)),
    ("peak mem (max stage)", lambda r: human_bytes(max(r.peak_memory_bytes, default=0))
     + (" est" if r.memory_source == "estimated" else "")),
    ("samples/s", lambda r: f"{r.throughput:.4g}"),
]
_STAGE_COLUMNS = [
    ("pred F ms/stage", lambda r: _stages_ms(r.predicted_fwd_s)),
    ("meas F ms/stage", lambda r: _stages_ms(r.measured_fwd_s)),
    ("pred B ms/stage", lambda r: _stages_ms(r.predicted_bwd_s)),
    ("meas B ms/stage", lambda r: _stages_ms(r.measured_bwd_s)),
]


@dataclass
class RunDetail:
    """What a row was computed from: the program, the prediction and the trace of the measured steps."""

    program: Any  # SplitProgram
    prediction: Any  # pipesplit.bench.predict.Prediction
    trace: Any  # pipesplit.runtime.engine.trace.Trace
    median_step: int  # index of the traced step whose time is the median


@dataclass
class BenchmarkResult:
    """Rows of :func:`pipesplit.benchmark`, with tables, exports and pictures.

    ``print(res)`` shows the table; ``res.best()`` is the fastest row; ``res.to_csv``,
    ``res.to_markdown``, ``res.plot`` (step times and bubbles), ``res.plot_balance``,
    ``res.plot_timeline`` (predicted vs measured Gantt), ``res.to_chrome_trace`` and
    ``res.render_split`` export the rest.
    """

    rows: list[BenchRow]
    details: list[RunDetail] = field(repr=False)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (configuration, why)
    meta: dict[str, Any] = field(default_factory=dict)  # machine, date, batch, repeats

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Any:
        return iter(self.rows)

    @property
    def warnings(self) -> list[str]:
        """What makes these figures unfit to rank configurations: a busy machine, rows whose
        repeats spread more than 10% around their median, fastest rows that overlap."""
        from pipesplit.bench.load import load_warning
        from pipesplit.passes.annotate.rates import concurrent_slowdown

        out = []
        if "load" in self.meta:
            busy = load_warning(self.meta["load"])
            if busy:
                out.append(busy)
        cores = int(self.meta.get("load", {}).get("cores", 0) or 0)
        threads = int(self.meta.get("torch_threads", 1) or 1)
        shared = [r for r in self.rows if "cuda" not in r.devices and r.num_ranks > 1]
        if shared:
            r = max(shared, key=lambda r: r.num_ranks)
            over = r.num_ranks * threads > cores > 0
            out.append(f"up to {r.num_ranks} ranks run as threads of one process on the CPU"
                       + (f", {r.num_ranks} x {threads} torch thread(s) on {cores} core(s)" if over else "")
                       + ": they contend for the cores and for Python's GIL between ops. The prediction slows "
                       "each action by how many ranks compute beside it, as that many threads running matrix "
                       f"multiplies at once measured here (x{concurrent_slowdown(r.num_ranks):.2f} for "
                       f"{r.num_ranks}), not for the GIL or the OS's time slices, so read those rows for balance "
                       "and bubbles, not for the step time a device per stage would give.")
        wide = [r for r in self.rows if r.measured_step_spread_s > 0.1 * r.measured_step_s]
        if wide:
            out.append(f"{len(wide)} of {len(self.rows)} rows spread more than ±10% over their repeats ("
                       + "; ".join(f"{r.label}: ±{100 * r.measured_step_spread_s / r.measured_step_s:.0f}%"
                                   for r in wide[:3]) + ("; ..." if len(wide) > 3 else "")
                       + "): more repeats (repeats=) would pin them down.")
        ranked = sorted(self.rows, key=lambda r: r.measured_step_s)
        if len(ranked) > 1:
            a, b = ranked[0], ranked[1]
            if a.measured_step_s + a.measured_step_spread_s >= b.measured_step_s - b.measured_step_spread_s:
                out.append(f"the fastest two configurations ({a.label}; {b.label}) overlap within their spread: "
                           "this run cannot rank them.")
        return out

    @property
    def notes(self) -> list[str]:
        """What compiling the benchmarked programs noted (``prog.notes``), each once."""
        return list(dict.fromkeys(n for d in self.details for n in d.program.notes))

    def best(self) -> BenchRow:
        """The configuration with the lowest measured step time."""
        if not self.rows:
            raise PipesplitError("the benchmark has no rows: every configuration was skipped.")
        return min(self.rows, key=lambda r: r.measured_step_s)

    def _index(self, row: BenchRow | int | None) -> int:
        if row is None:
            return self.rows.index(self.best())
        if isinstance(row, int):
            if not -len(self.rows) <= row < len(self.rows):
                raise PipesplitError(f"row {row} is out of range: the benchmark has {len(self.rows)} rows.")
            return row % len(self.rows)
        for i, r in enumerate(self.rows):
            if r is row:
                return i
        raise PipesplitError("that row is not part of this benchmark result.")

    # ------------------------------------------------------------------ tables
    def _table(self, columns: Sequence[tuple[str, Any]]) -> list[list[str]]:
        return [[h for h, _ in columns]] + [[cell(r) for _, cell in columns] for r in self.rows]

    def __str__(self) -> str:
        table = self._table(_COLUMNS)
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.rows:
            b = self.best()
            lines.append(f"\nfastest: {b.label}: {ms_text(b.measured_step_s)} ms per step, {b.throughput:.4g} samples/s")
        for r in self.rows:
            if r.lengths:
                at = ", ".join(f"{n}: {ms_text(p)} / {ms_text(m)}" for n, p, m in
                               zip(r.lengths, r.predicted_length_s, r.measured_length_s))
                lines.append(f"{r.label}: step ms pred / meas at each length {{{at}}}; expected "
                             f"{ms_text(r.expected_predicted_s or 0.0)} / {ms_text(r.expected_measured_s or 0.0)}")
        lines += [f"skipped {what}: {why}" for what, why in self.skipped]
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_markdown(self, per_stage: bool = True) -> str:
        """A GitHub Markdown table (with the per-stage forward/backward columns unless ``per_stage=False``)."""
        table = self._table(_COLUMNS + (_STAGE_COLUMNS if per_stage else []))
        rule = "|" + "|".join(":--" if i < 4 else "--:" for i in range(len(table[0]))) + "|"
        out = ["| " + " | ".join(table[0]) + " |", rule]
        out += ["| " + " | ".join(row) + " |" for row in table[1:]]
        return "\n".join(out)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.rows]

    def to_csv(self, path: str | os.PathLike[str] | None = None) -> str:
        """The rows as CSV (per-stage lists joined with ``;``); written to ``path`` when given."""
        names = [f.name for f in dataclasses.fields(BenchRow)]
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(names)
        for r in self.rows:
            writer.writerow([";".join(repr(x) for x in v) if isinstance(v, tuple) else v
                             for v in (getattr(r, n) for n in names)])
        text = buf.getvalue()
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    # ---------------------------------------------------------------- pictures
    def plot(self, path: str | os.PathLike[str]) -> str:
        """PNG: predicted and measured step time and bubble of every configuration."""
        from pipesplit.plots import plot_overview

        return plot_overview(self.rows, path)

    def plot_balance(self, path: str | os.PathLike[str]) -> str:
        """PNG: predicted vs measured time of every stage, per configuration (relative to the stage mean)."""
        from pipesplit.plots import plot_balance

        return plot_balance(self.rows, path)

    def plot_timeline(self, path: str | os.PathLike[str], row: BenchRow | int | None = None) -> str:
        """PNG: the predicted and the measured Gantt chart of one configuration (default: the fastest);
        see :meth:`timeline_figure`."""
        from pipesplit.plots import plot_timelines

        predicted, measured, label, titles = self._timelines(row)
        return plot_timelines(predicted, measured, path, label, **titles)

    def timeline_figure(self, row: BenchRow | int | None = None) -> Any:
        """The matplotlib figure of :meth:`plot_timeline`. Its title carries the table's figures for
        the row (measured step, the median of the repeats, over the predicted one); the measured
        chart is the traced step closest to that median, and says which."""
        from pipesplit.plots import timelines_figure

        predicted, measured, label, titles = self._timelines(row)
        return timelines_figure(predicted, measured, label, **titles)

    def _timelines(self, row: BenchRow | int | None) -> tuple[Any, Any, str, dict[str, str]]:
        i = self._index(row)
        d, r = self.details[i], self.rows[i]
        k, n = d.median_step, d.trace.num_steps
        measured = d.trace.timeline(k)
        step = (f"measured: step {k + 1} of {n} (closest to the median), {ms_text(measured.step_time)} ms, "
                f"bubble {100 * measured.bubble_fraction:.0f}%")
        summary = (f"{r.label}: measured step {ms_text(r.measured_step_s)} ms (median of {n}) / predicted "
                   f"{ms_text(r.predicted_step_s)} ms = {r.step_ratio:.2f}x\n"
                   f"drawn below: the prediction, and measured step {k + 1} of {n} ({ms_text(measured.step_time)} ms)"
                   + ("" if n == 1 else ", the one closest to the median"))
        return d.prediction.timeline, measured, r.label, {"measured_title": step, "summary": summary}

    def to_chrome_trace(self, path: str | os.PathLike[str], row: BenchRow | int | None = None) -> str:
        """Write the measured steps of one configuration as a Chrome / Perfetto trace (JSON)."""
        self.details[self._index(row)].trace.to_chrome(path)
        return os.fspath(path)

    def render_split(self, path: str | os.PathLike[str], row: BenchRow | int | None = None) -> str:
        """The split graph of one configuration, clusters shaded by measured stage time (.dot, .svg, ...)."""
        i = self._index(row)
        return str(self.details[i].program.render(path, stage_times=list(self.rows[i].measured_stage_s)))
