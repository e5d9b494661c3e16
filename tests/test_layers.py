"""The package's imports point down its data flow, and never in a circle.

Every module sits in one layer, from the bottom (errors, node metadata, small data types) up
through the phases (capture -> annotate -> plan -> split -> schedule -> execute) to the
drivers (``compile``, ``benchmark``, the CLI). A module may import its own layer and the
layers below; an import inside a function counts as much as one at the top (it only hides
the edge); ``if TYPE_CHECKING:`` imports, which never run, do not count. The module graph
has no cycle, and no module imports another's private (``_``) names.

The source is read with ``ast``, not imported, so the test sees every import, lazy ones too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"pipesplit": ROOT / "pipesplit", "pipesplit.passes": ROOT / "passes"}  # passes/ ships as pipesplit.passes

# bottom to top; a module belongs to the layer of its longest matching prefix
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("torch: the one module that reaches into torch's private or recent APIs", ("pipesplit.compat",)),
    ("base: errors, node metadata, units, small data types", (
        "pipesplit.errors", "pipesplit.checks", "pipesplit.deprecation", "pipesplit.devices", "pipesplit.meta", "pipesplit.units", "pipesplit.rng", "pipesplit.state",
        "pipesplit.export", "pipesplit.models", "pipesplit.passes")),  # passes/__init__ imports nothing
    ("schedules: pure data", ("pipesplit.schedules",)),
    ("graph analyses", ("pipesplit.passes.aliasing", "pipesplit.passes.lookups")),
    ("capture", ("pipesplit.capture", "pipesplit.dims", "pipesplit.dynamic_spec", "pipesplit.distinct", "pipesplit.examples",
                 "pipesplit.inputs", "pipesplit.structure", "pipesplit.kv_cache")),
    ("annotate", ("pipesplit.passes.annotate",)),
    ("plan", ("pipesplit.passes.plan", "pipesplit.plan", "pipesplit.options")),
    ("split", ("pipesplit.passes.split", "pipesplit.materialize", "pipesplit.dot", "pipesplit.report",
               "pipesplit.agree", "pipesplit.program")),  # pipesplit.program: the old path, kept for a while
    # the runtime's rooms, bottom to top (runtime/__init__ re-exports Pipeline: it sits with the engine)
    ("execute: compiled code", ("pipesplit.runtime.graphs",)),
    ("execute: what crosses between ranks", ("pipesplit.runtime.comm",)),
    ("execute: the state a step keeps and saves", ("pipesplit.runtime.state",)),
    ("execute: the step engine", ("pipesplit.runtime", "pipesplit.runtime.engine")),
    ("measure and show", ("pipesplit.bench", "pipesplit.plots", "pipesplit.interop")),
    ("drivers", ("pipesplit", "pipesplit.api", "pipesplit.bench.run", "pipesplit.cli", "pipesplit.__main__")),
]


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return max(matches)[1]


def _run_time_nodes(body: list[ast.stmt]):
    """Every node of ``body``, less the bodies of ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _run_time_nodes(node.orelse)
            continue
        yield node
        for child in ast.iter_child_nodes(node):
            yield from _run_time_nodes([child])  # type: ignore[list-item]


def _imports(module: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every run-time import of the package's modules."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in _run_time_nodes(tree.body):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:  # a submodule
                    out.append((f"{base}.{a.name}", "", node.lineno))
                elif base in MODULES:
                    out.append((base, a.name, node.lineno))
    return [(target, name, line) for target, name, line in out if target != module]


GRAPH = nx.DiGraph()
for _name, _path in MODULES.items():
    GRAPH.add_node(_name)
    for _target, _imported, _line in _imports(_name, _path):
        GRAPH.add_edge(_name, _target, line=_line, name=_imported)


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)
    for must in ("pipesplit.passes.plan.planner", "pipesplit.runtime.engine.pipeline", "pipesplit.bench.run"):
        assert must in MODULES


# Packages whose ``__init__`` re-exports the names users import from them, as the root does
# (``from pipesplit.runtime import Pipeline``): like the root, they are not counted as run by an
# import of one of their parts; importing the package itself still counts at its own layer.
FACADES = {"pipesplit.runtime"}


def _runs(target: str) -> list[str]:
    """``target`` and the subpackages importing it runs first (their ``__init__``), the root and the
    facades aside."""
    parts = target.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))
            if ".".join(parts[:i]) in MODULES and ".".join(parts[:i]) not in FACADES] + [target]


def test_imports_point_down_the_flow():
    """Importing ``a.b.c`` runs ``a.b``'s ``__init__`` first: a package whose ``__init__`` pulls in a
    driver would drag it under every module that imports one of its parts."""
    upward = [f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]}) at line {GRAPH.edges[a, t]['line']}"
              for a, t in GRAPH.edges for b in _runs(t) if b != a and _layer(b) > _layer(a)]
    assert not upward, "imports against the flow:\n" + "\n".join(sorted(set(upward)))


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(GRAPH))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_no_private_names_cross_modules():
    private = [f"{a} imports {d['name']} from {b} (line {d['line']})" for a, b, d in GRAPH.edges(data=True)
               if d["name"].startswith("_")]
    assert not private, "private names used across modules:\n" + "\n".join(sorted(private))


@pytest.mark.parametrize("source, expect", [
    ("from pipesplit.api import compile\n", "imports against the flow"),
    ("def f():\n    from pipesplit.runtime.engine.pipeline import Pipeline\n", "imports against the flow"),
])
def test_the_check_sees_an_upward_import(source, expect, tmp_path):
    """The check itself can fail: an import of the driver from the bottom layer, at the top of a
    module or hidden in a function, is reported."""
    path = tmp_path / "errors.py"
    path.write_text(source)
    edges = _imports("pipesplit.errors", path)
    assert edges and all(_layer(target) > _layer("pipesplit.errors") for target, _, _ in edges), expect


ROOMS = ("graphs", "comm", "state", "engine")  # bottom to top


def test_every_runtime_module_is_in_a_room():
    """pipesplit/runtime/ holds its rooms and its facade only; each room says in one line what lives there."""
    loose = [m for m in MODULES if m.startswith("pipesplit.runtime.") and m.split(".")[2] not in ROOMS]
    assert not loose, f"modules of pipesplit/runtime/ outside its rooms {ROOMS}: {loose}"
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse(MODULES[f"pipesplit.runtime.{room}"].read_text()))
        assert doc and "\n" not in doc.strip(), f"pipesplit/runtime/{room}/__init__.py needs a one-line docstring"
    assert [_layer(f"pipesplit.runtime.{room}") for room in ROOMS] == sorted(_layer(f"pipesplit.runtime.{room}")
                                                                           for room in ROOMS)


@pytest.mark.parametrize("source", [
    "from pipesplit.runtime.engine.pipeline import Pipeline\n",
    "from pipesplit.runtime import Pipeline\n",  # the facade counts as the engine
    "def f():\n    from pipesplit.runtime.state import checkpoint\n",
])
def test_the_check_sees_a_room_importing_a_room_above(source, tmp_path):
    path = tmp_path / "transport.py"
    path.write_text(source)
    edges = _imports("pipesplit.runtime.comm.transport", path)
    assert edges and all(_layer(b) > _layer("pipesplit.runtime.comm.transport")
                         for target, _, _ in edges for b in _runs(target))


def test_the_check_sees_a_package_that_pulls_in_a_driver():
    assert _runs("pipesplit.bench.run") == ["pipesplit.bench", "pipesplit.bench.run"]
    assert _runs("pipesplit.passes.annotate.flops") == [
        "pipesplit.passes", "pipesplit.passes.annotate", "pipesplit.passes.annotate.flops"]
    assert _layer("pipesplit.bench") < _layer("pipesplit.bench.run"), "bench/__init__ must not import its driver"



# A private (``torch._ops``, ``torch.utils._pytree``, ``torch.fx._lazy_graph_module``) or experimental
# (``torch.fx.experimental``) torch name, in code or in a logger name.
TORCH_PRIVATE = re.compile(r"\btorch(\.\w+)*\._(?!_)\w|\btorch\.fx\.experimental\b")


def test_only_compat_reaches_into_torch_private_apis():
    """Every private or recent torch API goes through pipesplit.compat, where its fallback for
    older releases lives: a use elsewhere would break on some release nobody checks."""
    found = [f"{module} line {n}: {line.strip()}" for module, path in MODULES.items() if module != "pipesplit.compat"
             for n, line in enumerate(path.read_text().splitlines(), 1) if TORCH_PRIVATE.search(line)]
    assert not found, "private torch APIs outside pipesplit/compat.py:\n" + "\n".join(found)


@pytest.mark.parametrize("line", ["import torch.utils._pytree as pytree", "isinstance(t, torch._ops.OpOverload)",
                                  "from torch.fx.experimental.symbolic_shapes import hint", '"torch._dynamo"'])
def test_the_check_sees_a_private_torch_name(line):
    assert TORCH_PRIVATE.search(line)
    assert not TORCH_PRIVATE.search("torch.utils.checkpoint.checkpoint(torch.fx.Graph(), torch.__version__)")
