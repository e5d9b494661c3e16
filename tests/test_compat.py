"""pipesplit.compat: each fallback gives what the newer torch API gives, and the release facts hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

from pipesplit import compat
from pipesplit.compat import optimization_hint

ROOT = Path(__file__).resolve().parent.parent


def test_torch_floor_is_what_pyproject_declares_and_this_torch_meets_it():
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert declared and tuple(map(int, declared.groups())) == compat.TORCH_FLOOR
    assert compat.TORCH_VERSION[:2] >= compat.TORCH_FLOOR


def test_version_parsing():
    assert compat._release("2.13.0+cpu") == (2, 13, 0)
    assert compat._release("2.16.0.dev20260101+cu128") == (2, 16, 0)
    assert compat._release("2.10") == (2, 10, 0)


@pytest.mark.filterwarnings("ignore:use guarding_hint_or_throw")  # torch >= 2.12 deprecates the fallback's size_hint
def test_optimization_hint_and_its_fallback_give_the_example_size():
    """A dynamic batch dimension is a SymInt in the exported graph; both hints read the example's
    value, on the installed torch (2.12+: torch's optimization_hint; before: the fallback)."""
    ep = torch.export.export(nn.Linear(3, 2), (torch.randn(5, 3),), dynamic_shapes=({0: Dim("batch")},))
    (x,) = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "input"]
    size = x.meta["val"].shape[0]
    assert isinstance(size, torch.SymInt)
    assert optimization_hint(size) == compat._hint_before_2_12(size) == 5
    assert optimization_hint(4) == compat._hint_before_2_12(4) == 4


def test_state_mutations_cover_buffers_and_parameters():
    from torch.export.graph_signature import OutputKind

    assert set(compat.STATE_MUTATIONS) == {OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION}


def test_torch_csv_send_waits_came_with_2_15():
    """Read in the releases' own schedules.py: 2.10.0, 2.13.0 and 2.14.1 have no WAIT_SEND_F, 2.15.0 has."""
    assert compat.torch_csv_send_waits() == (compat.TORCH_VERSION >= (2, 15))



def test_readme_names_exactly_the_releases_ci_tests():
    """The README's torch claims are what CI runs: the legs of .ci/run and the README's own torch."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [p for p in readme.split("\n\n") if p.startswith("Tested torch releases:")]
    claimed = set(re.findall(r"\b(\d+\.\d+\.\d+)\b", line))
    legs = re.search(r'^TORCH_LEGS="([^"]*)"', (ROOT / ".ci" / "run").read_text(), re.M)
    assert legs, ".ci/run names its torch legs in TORCH_LEGS"
    default = re.search(r"pip install -q torch==(\S+) ", readme)
    assert default
    assert claimed == set(legs.group(1).split()) | {default.group(1)}
    oldest = min(tuple(map(int, v.split("."))) for v in claimed)
    assert oldest[:2] == compat.TORCH_FLOOR
    assert "torch_matrix" in (ROOT / ".ci" / "torch_leg.sh").read_text()


def test_a_meta_model_compiles_or_says_which_torch_can():
    """The README's meta-device recipe: torch >= 2.13 exports it; older torch gets pipesplit's error
    (2.10 and 2.12 fail inside torch's fake tensors: 'found two different devices meta, cpu')."""
    import pipesplit
    from pipesplit.errors import CaptureError

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4))
    idx = torch.randint(0, 16, (2, 5))
    if compat.EXPORTS_META_MODELS:
        prog = pipesplit.compile(model, idx, num_stages=2, progress=False)
        assert all(p.is_meta for p in prog.parameters())
    else:
        with pytest.raises(CaptureError, match=r"built on the meta device and the example inputs are on cpu: torch "
                                               r"2\.\d+.*torch 2\.13 or newer can"):
            pipesplit.compile(model, idx, num_stages=2, progress=False)
