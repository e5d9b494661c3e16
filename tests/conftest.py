from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

# The tests CI also runs on the oldest and newest torch it tests (.ci/torch_leg.sh runs
# `pytest -m torch_matrix`); the full suite runs on the default torch. The one list of them.
TORCH_MATRIX = frozenset({
    "test_exact.py", "test_training.py", "test_runtime.py", "test_semantics.py",  # exactness and training
    "test_interop.py", "test_dualpipe.py", "test_schedules.py",  # torch interop, torch's schedule CSV
    "test_packaging.py", "test_compat.py", "test_layers.py", "test_costs.py",  # install, torch differences
    "test_weight_grads.py", "test_modes.py", "test_state_writes.py", "test_running_stats.py",  # issue 22's
    "test_inputs.py", "test_generalise.py", "test_devices.py",  # silent wrong results, on every torch
    "test_mutation.py", "test_loss_leaves.py", "test_compiled_stages.py",  # this session's fixes; torch.compile
})


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    matrix = pytest.mark.torch_matrix
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if Path(str(item.fspath)).name in TORCH_MATRIX:
            item.add_marker(matrix)


def pytest_terminal_summary(terminalreporter):
    """Which torch this run tested (CI runs several): before pytest's closing line."""
    terminalreporter.write_line(f"pipesplit tests ran on torch {torch.__version__}")
