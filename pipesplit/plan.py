"""Plans as data: which graph node runs in which stage, with the figures that justify it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pipesplit.errors import PlanError
from pipesplit.units import format_cost
from pipesplit.deprecation import NUM_RENAMES, num_keywords, renamed_attribute

PLAN_VERSION = 1


@dataclass(repr=False)  # the generated repr would list every node name
class Plan:
    """A partition of a captured graph into stages.

    ``stages[s]`` lists the compute-node names of stage ``s`` in graph order. Plans
    save to JSON and load back; a hand-edited plan is checked against the graph when
    passed to ``pipesplit.compile(..., plan=...)``.
    """

    stages: list[list[str]]
    cost_name: str = "flops"
    stage_costs: list[float] = field(default_factory=list)
    bottleneck: float = 0.0
    lower_bound: float = 0.0
    stage_memory: list[int] = field(default_factory=list)  # estimated bytes per stage
    sent_bytes: list[int] = field(default_factory=list)  # boundary bytes each stage sends
    unknown_ops: dict[str, int] = field(default_factory=dict)
    source: str = "planner"  # "planner", "split_points" or "loaded"
    recompute: list[str] = field(default_factory=list)  # values each consumer stage rebuilds instead of receiving
    schedule: str | None = None  # the schedule whose step time the plan minimises (None: the bottleneck)
    num_microbatches: int | None = None
    predicted_step_s: float | None = None  # simulated step time of this plan under the schedule
    ideal_step_s: float | None = None  # a lower bound on the step time of any split
    checkpoint: bool = False  # planned for activation checkpointing: Pipeline checkpoints every stage by default
    order: str = "program"  # the node order the chain was solved in: "program" or "late" (passes/plan/orders.py)
    measured_s: float | None = None  # compile(refine=...): measured bottleneck (or step with a schedule), seconds
    # the capture whose node names ``stages`` lists: "static" (at the example's batch, compile's default) or
    # "dynamic" (a dynamic batch: dynamic_batch=True) or "every_dim" (every dimension dynamic: a program
    # generalised, or dynamic_dims=True); a saved plan without the field predates static capture, so it
    # loads as "dynamic"
    capture: str = "static"

    n_microbatches = renamed_attribute("n_microbatches", "num_microbatches")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.stage_costs)), key=self.stage_costs.__getitem__) if self.stage_costs else 0

    @property
    def gap(self) -> float:
        """Relative distance of the bottleneck above the lower bound (0.0 = provably optimal)."""
        return self.bottleneck / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    @property
    def step_gap(self) -> float | None:
        """How far the predicted step time is above the lower bound (None without a schedule)."""
        if self.predicted_step_s is None or not self.ideal_step_s:
            return None
        return self.predicted_step_s / self.ideal_step_s - 1.0

    def __repr__(self) -> str:
        """A summary: ``plan.stages`` lists the node names, ``plan.to_json()`` every field."""
        parts = [f"{self.num_stages} stages", f"nodes per stage {[len(s) for s in self.stages]}"]
        if self.stage_costs:
            parts.append(f"bottleneck stage {self.bottleneck_stage} ({format_cost(self.bottleneck, self.cost_name)}, "
                         f"gap {self.gap * 100:.1f}%)")
        parts.append(f"cost {self.cost_name!r}")
        if self.schedule is not None:
            step = "" if self.predicted_step_s is None else f", step {self.predicted_step_s * 1e3:.3g} ms"
            parts.append(f"schedule {self.schedule!r} x{self.num_microbatches}{step}")
        parts.append(f"order {self.order!r}")
        parts.append(f"source {self.source!r}")
        return f"Plan({', '.join(parts)})"

    def assignment(self) -> dict[str, int]:
        """node name -> stage index."""
        return {name: s for s, names in enumerate(self.stages) for name in names}

    def to_json(self) -> str:
        data: dict[str, Any] = {"version": PLAN_VERSION, **asdict(self)}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"the plan is not valid JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
            raise PlanError('a plan is a JSON object with a "stages" list of node-name lists.')
        version = data.pop("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise PlanError(f"plan version {version} is not supported (this pipesplit reads version {PLAN_VERSION}).")
        for old, new in NUM_RENAMES.items():  # plans saved before 0.2 say n_microbatches
            if old in data and new not in data:
                data[new] = data.pop(old)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"unknown plan fields {unknown}; known fields are {sorted(known)}.")
        data.setdefault("capture", "dynamic")
        if data["capture"] not in ("static", "dynamic", "every_dim"):
            raise PlanError(f"plan capture must be 'static', 'dynamic' or 'every_dim', got {data['capture']!r}.")
        plan = cls(**data)
        plan.source = "loaded"
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Plan":
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            raise PlanError(f"plan file {os.fspath(path)!r} does not exist ({os.path.abspath(path)}); save one with "
                            "prog.plan.save(path), or `pipesplit split ... --plan-out F`.") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"cannot read plan file {os.fspath(path)!r}: {e}") from None
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"plan file {os.fspath(path)!r}: {e}") from None


Plan.__init__ = num_keywords(Plan.__init__)  # type: ignore[method-assign]  # Plan(n_microbatches=...) until 0.3
