"""Old names keep working for a while, each with a DeprecationWarning that names the new one."""

import pytest


def test_the_old_program_path_still_works_and_says_where_it_went():
    import importlib
    import sys

    sys.modules.pop("pipesplit.program", None)
    with pytest.warns(DeprecationWarning, match="pipesplit.passes.split.program"):
        old = importlib.import_module("pipesplit.program")
    import pipesplit
    assert old.SplitProgram is pipesplit.SplitProgram and old.Stage is pipesplit.Stage


def test_the_old_count_names_still_work_and_say_the_new_ones(tmp_path):
    """Counts are ``num_*`` across the API; the ``n_*`` keywords, attributes and schedule-file
    headers of earlier releases keep working, each with a DeprecationWarning naming the new one."""
    import torch

    import pipesplit
    from pipesplit.schedules import get_schedule, load_schedule

    with pytest.warns(DeprecationWarning, match=r"get_schedule\(n_stages=..., n_ranks=..., n_microbatches=...\) is deprecated; call it num_stages=, num_ranks=, num_microbatches=\."):
        old = get_schedule("1f1b", n_stages=2, n_ranks=2, n_microbatches=4)
    new = get_schedule("1f1b", num_stages=2, num_ranks=2, num_microbatches=4)
    assert old == new
    with pytest.warns(DeprecationWarning, match=r"Schedule.n_microbatches is deprecated; read .num_microbatches"):
        assert new.n_microbatches == 4
    with pytest.raises(TypeError, match="got both n_microbatches= and num_microbatches="):
        get_schedule("1f1b", num_stages=2, n_microbatches=4, num_microbatches=4)

    path = tmp_path / "old.txt"
    path.write_text("# name: mine\n# n_stages: 2\n# n_microbatches: 1\n0F0 0B0\n1F0 1B0\n")
    loaded = load_schedule(path)
    assert (loaded.num_stages, loaded.num_microbatches) == (2, 1)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    prog = pipesplit.compile(model, torch.randn(4, 4), num_stages=2)
    with pytest.warns(DeprecationWarning, match=r"Pipeline\(n_microbatches=...\) is deprecated"):
        pipe = pipesplit.Pipeline(prog, "gpipe", n_microbatches=2)
    assert pipe.num_microbatches == 2


def test_a_star_import_does_not_shadow_the_builtin_compile():
    namespace: dict = {}
    exec("from pipesplit import *", namespace)
    assert "compile" not in namespace and "Pipeline" in namespace
    import pipesplit
    assert callable(pipesplit.compile) and pipesplit.compile is not compile


def test_plans_saved_before_the_rename_still_load_and_every_constructor_takes_the_old_names():
    import dataclasses
    import json

    import torch

    import pipesplit
    from pipesplit.runtime.engine.measure import measure_stage_costs
    from pipesplit.schedules import Schedule, get_schedule

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    x = torch.randn(4, 4)
    with pytest.warns(DeprecationWarning, match=r"compile\(n_microbatches=..., n_ranks=...\) is deprecated"):
        prog = pipesplit.compile(model, x, num_stages=2, schedule="1f1b", n_microbatches=2, n_ranks=2, progress=False)
    assert prog.plan.num_microbatches == 2
    saved = json.loads(prog.plan.to_json())
    saved["n_microbatches"] = saved.pop("num_microbatches")  # as 0.1 wrote it
    loaded = pipesplit.Plan.from_json(json.dumps(saved))
    assert loaded.num_microbatches == 2 and loaded.stages == prog.plan.stages
    with pytest.warns(DeprecationWarning, match=r"Plan.n_microbatches is deprecated"):
        assert loaded.n_microbatches == 2
    with pytest.warns(DeprecationWarning, match=r"PlannerOptions\(n_microbatches=...\) is deprecated"):
        assert pipesplit.PlannerOptions(schedule="1f1b", n_microbatches=8).num_microbatches == 8
    s = get_schedule("gpipe", num_stages=2, num_microbatches=2)
    with pytest.warns(DeprecationWarning, match=r"Schedule\(n_stages=..., n_microbatches=...\) is deprecated"):
        again = Schedule(s.name, n_stages=2, num_ranks=2, n_microbatches=2, stage_to_rank=s.stage_to_rank,
                         actions=s.actions)
    assert again == s
    with pytest.raises(TypeError):  # replace() passes every field by its new name: the old one would be a second value
        dataclasses.replace(s, n_microbatches=2)
    with pytest.warns(DeprecationWarning, match=r"measure_stage_costs\(n_microbatches=...\)"):
        costs = measure_stage_costs(prog, x, n_microbatches=2, repeats=1, warmup=0)
    assert len(costs) == 2


@pytest.mark.parametrize("old", ["pipesplit.runtime.pipeline", "pipesplit.runtime.checkpoint",
                                 "pipesplit.runtime.distributed", "pipesplit.runtime.cuda_graphs",
                                 "pipesplit.runtime.measure", "pipesplit.runtime.trace"])
def test_the_runtime_modules_old_paths_still_work_and_say_where_they_went(old):
    """The runtime's modules moved into rooms (engine, graphs, comm, state); each old path gives the
    very module at its new one, with a DeprecationWarning naming it, and leaves that module's own
    name and spec alone."""
    import importlib
    import sys

    import pipesplit.runtime

    new = pipesplit.runtime.MOVED[old]
    module = importlib.import_module(new)
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        assert importlib.import_module(old) is module
    assert module.__name__ == module.__spec__.name == new
    assert sys.modules[old] is module and importlib.import_module(old) is module  # warned once


def test_every_old_runtime_path_is_kept():
    import importlib
    import warnings
    from pathlib import Path

    import pipesplit.runtime

    folder = Path(pipesplit.runtime.__file__).parent
    modules = {p.stem for p in folder.glob("*/*.py") if p.stem != "__init__"}
    old_names = {old.rpartition(".")[2] for old in pipesplit.runtime.MOVED}
    assert old_names <= modules  # every old name is a module of some room (new modules need no alias)
    assert len(old_names) == 25
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old, new in pipesplit.runtime.MOVED.items():
            assert importlib.import_module(old) is importlib.import_module(new)
    from pipesplit.runtime.pipeline import Pipeline
    assert Pipeline is pipesplit.Pipeline
