"""Plans as data: which graph node runs in which stage, with the figures that justify it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pipesplit.checks import file_target, path_arg
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
    # the stages that recompute their forward in the backward (activation checkpointing), chosen by
    # compile(checkpoint=...): Pipeline checkpoints exactly these by default. A plan saved before
    # per-stage checkpointing says true (every stage) or false (none)
    checkpoint: list[int] = field(default_factory=list)
    # stages that recompute only their first blocks: stage -> how many of its first nodes (``stages[s][:n]``)
    # recompute, and what that is in blocks ("blocks 0-3 of 8 (layers.0 to layers.3)"); see checkpoint_summary
    checkpoint_partial: dict[int, int] = field(default_factory=dict)
    checkpoint_labels: dict[int, str] = field(default_factory=dict)
    max_stage_memory: int | None = None  # the cap the plan was made (or priced) under, bytes per stage
    order: str = "program"  # the node order the chain was solved in: "program" or "late" (passes/plan/orders.py)
    measured_s: float | None = None  # compile(refine=...): measured bottleneck (or step with a schedule), seconds
    # the capture whose node names ``stages`` lists: "static" (at the example's batch, compile's default) or
    # "dynamic" (a dynamic batch: dynamic_batch=True) or "every_dim" (every dimension dynamic: a program
    # generalised, or dynamic_dims=True); a saved plan without the field predates static capture, so it
    # loads as "dynamic"
    capture: str = "static"
    # compile(plan_lengths=...): the lengths of the dynamic dimension planned for, their weights (summing to 1)
    # and the step simulated at each; predicted_step_s is then the weighted mean (passes/plan/lengths.py)
    lengths: list[int] = field(default_factory=list)
    length_weights: list[float] = field(default_factory=list)
    length_steps_s: list[float] = field(default_factory=list)

    n_microbatches = renamed_attribute("n_microbatches", "num_microbatches")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_memory_bytes(self) -> list[int]:
        """The predicted peak bytes of each stage (with a schedule: parameters, gradients, optimizer
        state and the activations or, checkpointed, the inputs of every microbatch in flight)."""
        return list(self.stage_memory)

    @property
    def checkpoint_summary(self) -> list[str]:
        """What each stage recomputes in its backward, readably: ``["stage 0: blocks 0-3 of 8 (layers.0 to
        layers.3) recomputed", "stage 1: all of its forward recomputed", "stage 2: nothing recomputed"]``."""
        out = []
        for s in range(self.num_stages):
            if s in self.checkpoint:
                what = "all of its forward recomputed"
            elif s in self.checkpoint_partial:
                what = (f"{self.checkpoint_labels.get(s) or f'its first {self.checkpoint_partial[s]} nodes'} "
                        "recomputed")
            else:
                what = "nothing recomputed"
            out.append(f"stage {s}: {what}")
        return out

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
        if self.lengths:
            steps = ", ".join(f"{n}: {s * 1e3:.3g} ms" for n, s in zip(self.lengths, self.length_steps_s))
            parts.append(f"expected over lengths {{{steps}}}")
        if self.checkpoint:
            parts.append(f"checkpoint {self.checkpoint}")
        if self.checkpoint_partial:
            parts.append("partly checkpointed " + ", ".join(f"stage {s}: {self.checkpoint_labels.get(s, n)}"
                                                          for s, n in self.checkpoint_partial.items()))
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
        if isinstance(data.get("checkpoint"), bool):  # saved before per-stage checkpointing: all or none
            data["checkpoint"] = list(range(len(data["stages"]))) if data["checkpoint"] else []
            if data["checkpoint"]:  # every stage whole: none recomputes only its first blocks
                data["checkpoint_partial"], data["checkpoint_labels"] = {}, {}
        if data["capture"] not in ("static", "dynamic", "every_dim"):
            raise PlanError(f"plan capture must be 'static', 'dynamic' or 'every_dim', got {data['capture']!r}.")
        for key in ("checkpoint_partial", "checkpoint_labels"):  # JSON's keys are strings
            value = data.get(key, {})
            if not isinstance(value, dict) or not all(isinstance(k, str) and k.isdigit() for k in value):
                raise PlanError(f"field {key!r} must be an object of stage index -> value, got {value!r}.")
            data[key] = {int(k): v for k, v in value.items()}
        check_fields(data)
        plan = cls(**data)
        plan.source = "loaded"
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        path = path_arg("Plan.save(path)", path, error=PlanError, takes="the path of the JSON file to write")
        file_target("Plan.save(path)", path)
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Plan":
        path = path_arg("plan=", path, error=PlanError, takes="a pipesplit.Plan or the path of a saved one")
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            raise PlanError(f"plan file {path!r} does not exist ({os.path.abspath(path)}); save one with "
                            "prog.plan.save(path), or `pipesplit split ... --plan-out F`.") from None
        except IsADirectoryError:
            raise PlanError(f"plan file {path!r} is a folder; pass the JSON file that prog.plan.save(path) or "
                            "`pipesplit split ... --plan-out F` wrote.") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"cannot read plan file {path!r}: {e}. A plan is the JSON text prog.plan.save(path) "
                            "writes; save it again.") from None
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"plan file {path!r}: {e}"
                            + (" The file is empty or cut short, or not a plan: save it again with prog.plan.save(path)."
                               if "not valid JSON" in str(e) else "")) from None


# a saved plan's fields by the type of their value: a hand-edited file is checked field by field
_NUMBERS = ("bottleneck", "lower_bound", "predicted_step_s", "ideal_step_s", "measured_s")
_NUMBER_LISTS = ("stage_costs", "stage_memory", "sent_bytes", "lengths", "length_weights", "length_steps_s")


def check_fields(data: dict[str, Any]) -> None:
    """Each field of a plan read from JSON has its type; refused by name and value otherwise."""
    def bad(name: str, value: Any, want: str) -> PlanError:
        return PlanError(f"field {name!r} must be {want}, got {value!r}.")

    stages = data["stages"]
    for s, names in enumerate(stages):
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad(f"stages[{s}]", names, "a list of node names (strings), as prog.plan.save() writes them")
    ckpt = data.get("checkpoint", [])
    if not isinstance(ckpt, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(stages) for i in ckpt):
        raise bad("checkpoint", ckpt, f"a list of stage indices in 0..{len(stages) - 1} (true or false in plans saved "
                                      "before per-stage checkpointing)")
    partial = data.get("checkpoint_partial", {})
    if any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= s < len(stages) or not 1 <= n < len(stages[s])
           or s in ckpt for s, n in partial.items()):
        raise bad("checkpoint_partial", partial, "stage index -> how many of its first nodes recompute (1 to one "
                                                 "fewer than the stage has), for stages not in 'checkpoint'")
    if not all(isinstance(v, str) for v in data.get("checkpoint_labels", {}).values()):
        raise bad("checkpoint_labels", data["checkpoint_labels"], "stage index -> text")
    cap = data.get("max_stage_memory")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
        raise bad("max_stage_memory", cap, "a whole number of bytes > 0 or null")
    for name in _NUMBERS:
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad(name, value, "a number or null")
    for name in _NUMBER_LISTS:
        value = data.get(name, [])
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
            raise bad(name, value, "a list of numbers")
    for name in ("cost_name", "source", "order"):
        if name in data and not isinstance(data[name], str):
            raise bad(name, data[name], "a string")
    if not isinstance(data.get("recompute", []), list) or not all(isinstance(v, str) for v in data.get("recompute", [])):
        raise bad("recompute", data["recompute"], "a list of node names")
    m = data.get("num_microbatches")
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise bad("num_microbatches", m, "a whole number >= 1 or null")
    if data.get("schedule") is not None and not isinstance(data["schedule"], str):
        raise bad("schedule", data["schedule"], "a schedule name or null")
    if not isinstance(data.get("unknown_ops", {}), dict):
        raise bad("unknown_ops", data["unknown_ops"], "an object of op name -> count")


Plan.__init__ = num_keywords(Plan.__init__)  # type: ignore[method-assign]  # Plan(n_microbatches=...) until 0.3
