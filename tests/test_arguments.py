"""Every public argument checked where it enters (issue 38): a refusal names the argument, the value and the fix."""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit import CommModel, MemoryModel, PipesplitError
from pipesplit.cli import main
from tests.test_errors import unchanged


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


class Blocks(nn.Module):
    """Blocks in an nn.ModuleList, which is never called itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(4)])
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


X = torch.randn(4, 8)


def mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def refused(match: str, error: type[Exception] = PipesplitError):
    return pytest.raises(error, match=match)


# ------------------------------------------------------------------ silent before: compile


@pytest.mark.parametrize("devices", [["meta", "meta"], ["cpu", "meta"]])
def test_a_meta_device_for_a_stage_is_refused(devices):
    model = mlp()
    with unchanged(model), refused(r"devices\[\d\]='meta' holds no data.*devices=\['cpu'\] \* 2"):
        pipesplit.compile(model, X, num_stages=2, devices=devices)


def test_no_split_naming_a_module_list_keeps_each_of_its_blocks_whole():
    model = Blocks()
    from pipesplit.capture import capture
    from pipesplit.meta import node_module_paths

    graph = capture(model, X, copy_state=False).gm.graph
    block_of = {n.name: next((p for p in node_module_paths(n) if p.count(".") == 1 and p.startswith("blocks.")), None)
                for n in graph.nodes}
    for k in (3, 4, 5):
        prog = pipesplit.compile(model, X, num_stages=k, no_split=["blocks"])
        stages_of: dict[str, set[int]] = {}
        for s, names in enumerate(prog.plan.stages):
            for name in names:
                if block_of.get(name):
                    stages_of.setdefault(block_of[name], set()).add(s)
        assert len(stages_of) == 4 and all(len(v) == 1 for v in stages_of.values()), (k, stages_of)
        assert torch.allclose(prog(X), model(X))
    # the same as the wildcard form
    assert (pipesplit.compile(model, X, num_stages=3, no_split=["blocks"]).plan.stages
            == pipesplit.compile(model, X, num_stages=3, no_split=["blocks.*"]).plan.stages)


def test_pins_that_no_split_forbids_to_separate_are_reported():
    with refused(r"pins 'blocks.0.0' -> stage 0 and 'blocks.0.2' -> stage 1 need a cut between them.*no_split"):
        pipesplit.compile(Blocks(), X, num_stages=2, pins={"blocks.0.0": 0, "blocks.0.2": 1}, no_split=["blocks.0"])
    with refused(r"need a cut between them"):  # a ModuleList keeps each block whole, so the same
        pipesplit.compile(Blocks(), X, num_stages=2, pins={"blocks.1.0": 0, "blocks.1.2": 1}, no_split=["blocks"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_an_example_of_another_dtype_than_the_model_takes_is_refused_at_compile(dtype):
    model = mlp()
    with unchanged(model), refused(rf"example input 'input' is {dtype}, but Sequential's first operation on it "
                                   r"\(linear, with '0.weight' of dtype torch.float32\).*Cast the example"):
        pipesplit.compile(model, torch.ones(4, 8, dtype=dtype), num_stages=2)


def test_an_input_of_another_dtype_than_compiled_says_how_to_fix_it():
    prog = pipesplit.compile(mlp(), X, num_stages=2)
    for x in (X.double(), torch.randn(6, 8).double(), X.long()):
        with refused(r"input 'input' has dtype torch\.\w+; the program was compiled for torch.float32.*"
                     r"Cast the input \(input.to\(torch.float32\)\), or compile again"):
            prog(x)
    pipe = pipesplit.Pipeline(prog, "1f1b", 2, loss_fn=mse)
    with refused(r"Cast the input"):
        pipe.step(X.double(), target=X)


def test_an_input_of_another_rank_is_named_before_a_new_batch_size_recaptures():
    model = nn.Linear(8, 8)
    prog = pipesplit.compile(model, torch.randn(8))  # (8,): no batch dimension the model keeps
    with refused(r"input 'input' has shape \(4, 8\) \(2 dimensions\); the program takes \(\*,\) \(1 dimensions\)"):
        prog(torch.randn(4, 8))  # was: "the model pins the batch dimension to 8"
    x = torch.randn(8)
    assert torch.allclose(prog(x), model(x))


def test_an_empty_example_batch_and_a_batch_dim_no_input_has_are_refused():
    with refused(r"the example batch is empty: input has 0 rows along batch_dim=0.*2 or more rows"):
        pipesplit.compile(mlp(), torch.randn(0, 8), num_stages=2)
    with refused(r"batch_dim=5, but no example tensor has a dimension 5 \(input: \(4, 8\)\)"):
        pipesplit.compile(mlp(), X, num_stages=2, batch_dim=5)
    for bad in ("0", -1, 1.0):
        with refused(rf"batch_dim must be a dimension index >= 0 \(an int\), got {bad!r}"):
            pipesplit.compile(mlp(), X, num_stages=2, batch_dim=bad)


def test_zero_microbatches_a_bad_comm_model_and_comm_by_name_are_refused():
    with refused(r"num_microbatches must be a whole number >= 1, got 0"):
        pipesplit.compile(mlp(), X, num_stages=2, schedule="1f1b", num_microbatches=0)
    for bw in (0, -1, float("nan"), "fast"):
        with refused(r"CommModel\(bandwidth=...\) must be a number > 0"):
            CommModel(bandwidth=bw)
    with refused(r"CommModel\(latency_s=...\) must be a number >= 0, got -1"):
        CommModel(latency_s=-1)
    with refused(r"MemoryModel\(optimizer_factor=...\) must be a number >= 0, got -2"):
        MemoryModel(optimizer_factor=-2)
    with refused(r"MemoryModel\(checkpoint=...\) must be True or False, got 'yes'"):
        MemoryModel(checkpoint="yes")  # type: ignore[arg-type]
    for schedule in (None, "1f1b"):
        with refused(r"comm= takes a pipesplit.CommModel or None, got 'fast'"):
            pipesplit.compile(mlp(), X, num_stages=2, comm="fast", schedule=schedule)
        with refused(r"memory= takes a pipesplit.MemoryModel or None"):
            pipesplit.compile(mlp(), X, num_stages=2, memory={"checkpoint": True}, schedule=schedule)


def _plan_file(tmp_path, **fields) -> str:
    prog = pipesplit.compile(mlp(), X, num_stages=2)
    data = json.loads(prog.plan.to_json())
    data.update(fields)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("fields, message", [
    ({"checkpoint": "yes"}, r"field 'checkpoint' must be a list of stage indices in 0..1 .*, got 'yes'"),
    ({"checkpoint": [0, 5]}, r"field 'checkpoint' must be a list of stage indices in 0..1 .*, got \[0, 5\]"),
    ({"stages": [[1], ["linear_1"]]}, r"field 'stages\[0\]' must be a list of node names"),
    ({"num_microbatches": 0}, r"field 'num_microbatches' must be a whole number >= 1 or null, got 0"),
    ({"stage_costs": ["a"]}, r"field 'stage_costs' must be a list of numbers"),
])
def test_a_plan_file_with_a_field_of_the_wrong_type_is_refused(tmp_path, fields, message):
    path = _plan_file(tmp_path, **fields)
    with refused(message):
        pipesplit.Plan.load(path)
    with refused(message):
        pipesplit.compile(mlp(), X, plan=path)


def test_a_plan_that_is_no_plan_or_path_is_refused(tmp_path):
    for plan in (42, {"stages": []}, None.__class__):
        with refused(r"plan= takes a pipesplit.Plan or the path of a saved one"):
            pipesplit.compile(mlp(), X, plan=plan)
    with refused(r"is a folder; pass the JSON file"):
        pipesplit.compile(mlp(), X, plan=tmp_path)
    for text in ("", '{"stages": [["lin', "\x00\x01"):
        (tmp_path / "p.json").write_text(text)
        with refused(r"not valid JSON.*save it again with prog.plan.save"):
            pipesplit.Plan.load(tmp_path / "p.json")


# ---------------------------------------------------------- silent before: save and load


def _pipe() -> pipesplit.Pipeline:
    return pipesplit.Pipeline(pipesplit.compile(mlp(), X, num_stages=2), "1f1b", 2, loss_fn=mse)


def test_save_onto_an_existing_file_refuses_before_touching_it(tmp_path):
    pipe, path = _pipe(), tmp_path / "precious.txt"
    path.write_text("the user's file")
    with refused(r"pipe.save\(path\) '.*precious.txt' is an existing file, not a folder.*will not move"):
        pipe.save(str(path))
    assert sorted(os.listdir(tmp_path)) == ["precious.txt"] and path.read_text() == "the user's file"
    (tmp_path / "ck.old").write_text("another file of the user's")  # where save would have moved the old one
    with refused(r"work folder \(ck.old\) '.*ck.old' is an existing file"):
        pipe.save(str(tmp_path / "ck"))
    with refused(r"lies under '.*precious.txt', which is a file"):
        pipe.save(str(path / "ck"))
    with refused(r"pipe.save\(path\) takes the folder to write the checkpoint to .*got None"):
        pipe.save(None)  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == ["ck.old", "precious.txt"]


def test_a_non_strict_load_that_matches_nothing_warns(tmp_path, caplog):
    pipe = _pipe()
    before = {k: v.clone() for k, v in pipe.prog.state_dict().items()}
    torch.manual_seed(1)
    other = nn.Sequential(OrderedDict(a=nn.Linear(8, 8)))
    other_pipe = pipesplit.Pipeline(pipesplit.compile(other, X, num_stages=1), "gpipe", 2, loss_fn=mse)
    other_pipe.save(str(tmp_path / "other"))
    with pytest.warns(UserWarning, match=r"holds none of the 8 tensors .*nothing was loaded.*\['a.bias', 'a.weight'\]"):
        pipe.load(str(tmp_path / "other"), strict=False)
    assert all(torch.equal(v, before[k]) for k, v in pipe.prog.state_dict().items())
    pipe.save(str(tmp_path / "mine"))
    with caplog.at_level("INFO", logger="pipesplit"):
        pipe.load(str(tmp_path / "mine"), strict=False)
    assert "8 of the 8 tensors this process holds found in" in caplog.text


@pytest.mark.parametrize("damage, message", [
    ("truncate data", r"load: reading the checkpoint .*ck failed: .*truncated or damaged"),
    ("zero data", r"load: reading the checkpoint .*ck failed: .*truncated or damaged"),
    ("truncate metadata", r"load: .*ck/.metadata cannot be read \(UnpicklingError"),
])
def test_a_damaged_checkpoint_is_named(tmp_path, damage, message):
    pipe = _pipe()
    pipe.save(str(tmp_path / "ck"))
    for name in os.listdir(tmp_path / "ck"):
        file = tmp_path / "ck" / name
        if damage == "truncate metadata" and name == ".metadata":
            file.write_bytes(file.read_bytes()[:10])
        elif name.endswith(".distcp") and damage != "truncate metadata":
            file.write_bytes(file.read_bytes()[:10] if damage == "truncate data" else bytes(file.stat().st_size))
    with refused(message):
        pipe.load(str(tmp_path / "ck"))


# ------------------------------------------------------------------- raw before: compile


@pytest.mark.parametrize("cost, message", [
    (lambda node: "a", r"cost=<lambda> returned 'a' for node 'linear'"),
    (lambda node: None, r"cost=<lambda> returned None for node 'linear'"),
    (lambda node: -1.0, r"cost=<lambda> returned -1.0 for node 'linear'"),
    (lambda node: 1 / 0, r"cost=<lambda> raised on node 'linear' \(aten.linear.default\): ZeroDivisionError"),
    (lambda: 1.0, r"cost=<lambda> must take 1 argument\(s\) \(node\)"),
])
def test_a_cost_function_that_fails_or_returns_no_number_is_named(cost, message):
    model = mlp()
    with unchanged(model), refused(message):
        pipesplit.compile(model, X, num_stages=2, cost=cost)


@pytest.mark.parametrize("kwargs, message", [
    ({"slack": float("nan")}, r"slack must be a fraction >= 0 of the optimal bottleneck, got nan"),
    ({"max_stage_memory": -5}, r"max_stage_memory must be a whole number > 0, got -5"),
    ({"num_ranks": 0}, r"num_ranks must be a whole number >= 1, got 0"),
    ({"pins": {"0": "first"}}, r"pins\['0'\] must be a whole number >= 0"),
    ({"pins": ["0"]}, r"pins takes a dict of module path -> stage"),
    ({"no_split": [3]}, r"no_split takes names \(non-empty strings\), got 3"),
])
def test_a_bad_planner_option_is_refused_before_the_capture(kwargs, message):
    with refused(message):
        pipesplit.PlannerOptions(num_stages=2, **kwargs)
    with refused(message):
        pipesplit.compile(mlp(), X, num_stages=2, **kwargs)


def test_an_unknown_keyword_names_itself_and_the_nearest_one():
    with refused(r"compile\(\) got an unknown keyword num_stage=2. Did you mean 'num_stages'"):
        pipesplit.compile(mlp(), X, num_stage=2)
    with refused(r"benchmark\(\) got an unknown keyword num_stage=2. Did you mean 'num_stages'"):
        pipesplit.benchmark(mlp(), X, num_stage=2, progress=False)
    with refused(r"benchmark\(\) got an unknown keyword schedles='1f1b'. Did you mean 'schedules'"):
        pipesplit.benchmark(mlp(), X, schedles="1f1b", progress=False)
    with refused(r"Pipeline\(\) got an unknown keyword num_microbatch=2. Did you mean 'num_microbatches'"):
        pipesplit.Pipeline(pipesplit.compile(mlp(), X, num_stages=2), num_microbatch=2)
    with refused(r"devices\[0\]='gpu' is not a device"):
        pipesplit.benchmark(mlp(), X, devices=["gpu"], progress=False)


def test_names_of_modules_are_checked_and_a_bare_string_is_one_name():
    model = Blocks()
    prog = pipesplit.compile(model, X, split_points="blocks.2")  # one split point, not its characters
    assert prog.num_stages == 2 and torch.allclose(prog(X), model(X))
    assert pipesplit.compile(model, X, num_stages=3, no_split="blocks").plan.stages == \
        pipesplit.compile(model, X, num_stages=3, no_split=["blocks"]).plan.stages
    with refused(r"split point 'nope' names no module of the model; the model's modules include 'blocks', 'inp', "
                 r"'out', 'blocks.0', 'blocks.1', 'blocks.2' and 13 more\. Split points are module names"):
        pipesplit.compile(model, X, split_points=["nope"])
    with refused(r"split point 'block.2' names no module of the model; did you mean 'blocks.2'"):
        pipesplit.compile(model, X, split_points=["block.2"])
    for bad in ([""], [123]):
        with refused(r"split_points takes names \(non-empty strings\)"):
            pipesplit.compile(model, X, split_points=bad)
    with refused(r"pinned module 'nope' matches no module of the model; the model's modules include"):
        pipesplit.compile(model, X, num_stages=2, pins={"nope": 0})
    with refused(r"no_split entry 'nope.\*' matches no module of the model; the model's modules include"):
        pipesplit.compile(model, X, num_stages=2, no_split=["nope.*"])


class NoForward(nn.Module):
    pass


@pytest.mark.parametrize("example, message", [
    ("hello", r"the example input looks at fault, not the model: the example inputs hold no tensor \(str 'hello'\)"),
    (None, r"the example inputs hold no tensor \(NoneType None\)"),
    ([X], r"the example input looks at fault.*\(\[Tensor\[4, 8\] float32 on cpu\]\)"),
    (torch.randn(4, 7), r"the example input looks at fault.*Tensor\[4, 7\] float32 on cpu.*Sequential.forward\(input\)"),
    (torch.randn(4, 0), r"an example tensor is empty"),
    (torch.randn(4, 8, device="meta"), r"the example input looks at fault.*on meta"),
])
def test_a_bad_example_input_is_blamed_on_the_input_not_the_model(example, message):
    model = mlp()
    with unchanged(model), refused(message):
        pipesplit.compile(model, example)


def test_a_module_without_forward_is_named():
    with refused(r"NoForward defines no forward\(\)"):
        pipesplit.compile(NoForward(), X)


# ------------------------------------------------------------------ raw before: Pipeline


def test_pipeline_arguments_are_checked_where_they_enter():
    prog = pipesplit.compile(mlp(), X, num_stages=2)
    with refused(r"Pipeline takes the program pipesplit.compile returns, got the nn.Module itself"):
        pipesplit.Pipeline(mlp(), "1f1b", 2)
    for timeout in (-1, 0, "5", float("nan")):
        with refused(r"Pipeline\(timeout=...\) must be a number > 0"):
            pipesplit.Pipeline(prog, "1f1b", 2, loss_fn=mse, timeout=timeout)
    with refused(r"Pipeline\(num_microbatches=...\) must be a whole number >= 1, got 0"):
        pipesplit.Pipeline(prog, "1f1b", 0, loss_fn=mse)
    with refused(r"loss_fn must be a function loss_fn\(output, target\) -> loss, got 3"):
        pipesplit.Pipeline(prog, "1f1b", 2, loss_fn=3)


def test_a_loss_fn_error_names_the_microbatch_the_stage_and_what_it_got():
    prog = pipesplit.compile(mlp(), X, num_stages=2)
    pipe = pipesplit.Pipeline(prog, "1f1b", 2, loss_fn=lambda o, t: 1 / 0)
    with refused(r"loss_fn raised on microbatch 0 \(stage 1, the last\): ZeroDivisionError.*output Tensor\[2, 8\]"):
        pipe.step(X, target=X)
    pipe = pipesplit.Pipeline(prog, "1f1b", 2, loss_fn=mse)
    with refused(r"loss_fn raised on microbatch 0.*output Tensor\[2, 8\] and target Tensor\[4, 8\]"):
        pipe.step(X, target=torch.randn(8, 8))
    with refused(r"step\(\) was given no target: pass pipe.step\(x, target=y\)"):
        pipe.step(X)
    pipe = pipesplit.Pipeline(prog, "1f1b", 2, loss_fn=lambda o, t: mse(o, t).detach())
    with refused(r"loss_fn returned a loss that does not require grad for microbatch 0 \(stage 1\)"):
        pipe.step(X, target=X)


# ------------------------------------------------------------------------------ the CLI


@pytest.mark.parametrize("high", ["0", "-3", "x"])
def test_cli_int_high_must_be_positive(high, capsys):
    with pytest.raises(SystemExit):
        main(["split", "pipesplit.models:gpt", "--input-shape", "4x16:int64", "--int-high", high])
    assert "--int-high: expected a whole number >= 1" in capsys.readouterr().err


def test_cli_an_input_shape_beyond_memory_is_refused(capsys):
    assert main(["split", "torch.nn:Identity", "--input-shape", "99999999999x99999999999"]) == 2
    assert "--input-shape '99999999999x99999999999' is" in capsys.readouterr().err


def test_cli_output_paths_under_a_file_or_naming_a_file_are_refused(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("keep")
    linear = ["torch.nn:Linear", "--kwarg", "in_features=8", "--kwarg", "out_features=8", "--input-shape", "4x8"]
    assert main(["split", *linear, "--stages", "1", "--plan-out", str(blocker / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "--plan-out" in err and "which is a file, not a folder" in err, err
    assert main(["bench", *linear, "--stages", "1", "--out", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is an existing file, not a folder" in err, err
    assert blocker.read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["afile"]
