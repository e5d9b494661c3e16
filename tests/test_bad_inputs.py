"""Bad and unusual values for every public entry point's arguments, drawn (issue 38).

Each draw holds: either a ``PipesplitError`` whose message names the argument, or the same
result as the plain model; and the user's model (values, parameter objects) and files are as
they were. Derandomised and bounded (about 30 s on 2 cores), so CI sees the same draws each run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pipesplit
from pipesplit import CommModel, MemoryModel, PipesplitError, PlannerOptions
from tests.test_errors import unchanged

SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))

X = torch.randn(4, 8)
Y = torch.randn(4, 8)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


MODEL = mlp()
PROG = pipesplit.compile(MODEL, X, num_stages=2)

# anything a user might pass by mistake, and some unusual values that are right
ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 9), st.sampled_from([0.0, -1.0, 0.5, 1e30, math.nan, math.inf]),
    st.sampled_from(["", "x", "0", "cpu", "meta", "gpu", "fast", "1f1b", "flops", "blocks", "0.*", "auto", "never"]),
    st.lists(st.sampled_from(["0", "1", "2", "", "nope"]), max_size=3), st.just(object()),
    st.dictionaries(st.sampled_from(["0", "1", "nope"]), st.integers(-1, 3), max_size=2),
)


def names(message: str, argument: str) -> bool:
    """The message names ``argument`` as the user wrote it, or in words (``split_points``: "split point")."""
    low = message.lower()
    forms = {argument, argument.replace("_", " "), argument.rstrip("s"), argument.replace("_", " ").rstrip("s")}
    return any(f.lower() in low for f in forms)


def holds(argument: str, run, reference) -> None:
    """``run()`` raises a PipesplitError naming ``argument``, or returns what ``reference()`` does."""
    try:
        got = run()
    except PipesplitError as e:
        assert names(str(e), argument), f"{argument}: the refusal does not name it: {e}"
        return
    want = reference()
    assert torch.allclose(got, want, atol=1e-5), f"{argument}: accepted, and the result differs from the model's"


@settings(max_examples=25, **SETTINGS)
@given(example=st.one_of(ODD, st.sampled_from([X.double(), X.long(), X[:, :7], X[:0], X[0], X.to("meta"), (X, X)])),
       as_kwargs=st.booleans())
def test_compile_answers_every_example_input(example, as_kwargs):
    model = MODEL
    args, kwargs = ((), {"input": example}) if as_kwargs else (example, None)
    with unchanged(model):
        holds("example", lambda: pipesplit.compile(model, args, example_kwargs=kwargs, progress=False)(
            *(args if isinstance(args, tuple) else (args,)), **(kwargs or {})),
              lambda: model(*(args if isinstance(args, tuple) else (args,)), **(kwargs or {})))


COMPILE_KEYWORDS = ["example_kwargs", "num_stages", "cost", "devices", "split_points", "plan", "max_stage_memory", "slack", "schedule",
                    "num_microbatches", "num_ranks", "pins", "no_split", "comm", "memory", "recompute", "order",
                    "refine", "batch_dim", "unbatched", "dynamic_batch"]


@settings(max_examples=40, **SETTINGS)
@given(keyword=st.sampled_from(COMPILE_KEYWORDS), value=ODD)
def test_compile_answers_every_keyword(keyword, value):
    model = MODEL
    with unchanged(model):
        holds(keyword, lambda: pipesplit.compile(model, X, progress=False, **{keyword: value})(X), lambda: model(X))


@settings(max_examples=40, **SETTINGS)
@given(field=st.sampled_from(["latency_s", "bandwidth", "optimizer_factor", "grad_factor", "checkpoint"]), value=ODD)
def test_comm_and_memory_models_check_their_fields(field, value):
    kind = CommModel if field in ("latency_s", "bandwidth") else MemoryModel
    try:
        made = kind(**{field: value})
    except PipesplitError as e:
        assert names(str(e), field), str(e)
        return
    if isinstance(made, CommModel):  # accepted: it prices a transfer as a time
        assert math.isfinite(made.seconds(1e6, "cpu", "cpu")) and made.seconds(1e6, "cpu", "cpu") >= 0
    else:
        assert made.state_factor >= 1 and isinstance(made.checkpoint, bool)


@settings(max_examples=40, **SETTINGS)
@given(field=st.sampled_from(["num_stages", "cost", "max_stage_memory", "slack", "schedule", "num_microbatches",
                              "num_ranks", "pins", "no_split", "comm", "memory", "recompute", "order", "refine"]),
       value=ODD)
def test_planner_options_check_their_fields(field, value):
    try:
        PlannerOptions(**{field: value})
    except PipesplitError as e:
        assert names(str(e), field), str(e)


PIPELINE_KEYWORDS = ["schedule", "num_microbatches", "loss_fn", "num_ranks", "batch_dim", "loss_reduction", "checkpoint",
                     "timeout", "executor", "target_batch_dim", "transport"]


@settings(max_examples=40, **SETTINGS)
@given(keyword=st.sampled_from(PIPELINE_KEYWORDS), value=ODD)
def test_pipeline_answers_every_keyword(keyword, value):
    def mse(out, target):
        return torch.nn.functional.mse_loss(out, target)

    kwargs = {"loss_fn": mse, "num_microbatches": 2, keyword: value}

    def run():
        pipe = pipesplit.Pipeline(PROG, **kwargs)
        pipe.zero_grad()
        return pipe.step(X, target=Y) if kwargs["loss_fn"] is not None else pipe.eval(X)

    def reference():
        return mse(MODEL(X), Y) if kwargs["loss_fn"] is not None else MODEL(X)

    with unchanged(MODEL):
        holds(keyword, run, reference)


FIELDS = ["stages", "cost_name", "stage_costs", "bottleneck", "recompute", "schedule", "num_microbatches", "checkpoint",
          "order", "capture", "version", "source", "measured_s", "unknown_ops", "n_microbatches", "max_stage_memory",
          "nonsense"]


@settings(max_examples=40, **SETTINGS)
@given(field=st.sampled_from(FIELDS), value=st.one_of(ODD, st.just([["linear"], ["linear_1"]])))
def test_a_hand_edited_plan_file_is_checked_field_by_field(tmp_path_factory, field, value):
    folder = tmp_path_factory.mktemp("plan")
    data = json.loads(PROG.plan.to_json())
    try:
        data[field] = value
        text = json.dumps(data)
    except (TypeError, ValueError):
        return  # not JSON: a plan file cannot hold it
    path = folder / "plan.json"
    path.write_text(text)
    with unchanged(MODEL):
        holds(field if field != "n_microbatches" else "microbatches",
              lambda: pipesplit.compile(MODEL, X, plan=path, progress=False)(X), lambda: MODEL(X))
    assert path.read_text() == text


PATHS = ["none", "int", "empty", "file", "under_file", "folder_with_files", "new", "nested_new"]


def _path(kind: str, root: Path):
    (root / "afile").write_text("the user's")
    (root / "folder").mkdir(exist_ok=True)
    (root / "folder" / "notes.txt").write_text("the user's notes")
    return {"none": None, "int": 3, "empty": "", "file": str(root / "afile"), "under_file": str(root / "afile" / "ck"),
            "folder_with_files": str(root / "folder"), "new": str(root / "ck"),
            "nested_new": str(root / "a" / "b" / "ck")}[kind]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@settings(max_examples=16, **SETTINGS)
@given(kind=st.sampled_from(PATHS), load_kind=st.sampled_from(PATHS))
def test_save_and_load_paths_are_checked_and_the_users_files_kept(tmp_path_factory, kind, load_kind):
    root = tmp_path_factory.mktemp("ck")
    path, load_path = _path(kind, root), _path(load_kind, root)
    before = _files(root)
    pipe = pipesplit.Pipeline(PROG, "gpipe", 2, loss_fn=lambda o, t: o.square().mean())
    try:
        pipe.save(path)
        saved = True
    except PipesplitError as e:
        assert "path" in str(e), str(e)
        saved = False
    after = _files(root)
    assert {k: v for k, v in after.items() if k in before} == before, "a file of the user's changed"
    if saved and kind == "folder_with_files":
        pytest.fail("save wrote a checkpoint over a folder of the user's files")  # pragma: no cover
    values = {k: v.clone() for k, v in PROG.state_dict().items()}
    try:
        pipe.load(load_path)
    except PipesplitError as e:
        assert "load" in str(e) or "path" in str(e), str(e)
    assert all(torch.equal(v, values[k]) for k, v in PROG.state_dict().items())
    assert {k: v for k, v in _files(root).items() if k in before} == before
