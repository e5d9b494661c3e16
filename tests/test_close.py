"""tests/close.py: the comparisons every exactness test relies on can still fail."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.close import RTOL, assert_close, assert_grads_close, assert_tree_close


def _pair(scale: float = 1e-3, n: int = 4096, dtype=torch.float32):
    torch.manual_seed(0)
    expected = (torch.randn(n, dtype=torch.float64) * scale).to(dtype)
    return expected.clone(), expected


def test_rounding_noise_on_a_small_gradient_passes():
    """What failed elementwise (atol=1e-6 on 1e-3-scale values summed in another order)."""
    actual, expected = _pair()
    actual = (actual.double() * (1 + 1e-7 * torch.randn(actual.shape, dtype=torch.float64))).float()
    assert_close(actual, expected, name="grad")


@pytest.mark.parametrize("dtype", list(RTOL))
def test_a_scaled_tensor_fails_at_every_dtype(dtype):
    actual, expected = _pair(dtype=dtype)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(actual * (1 + 5 * RTOL[dtype]), expected, name="grad")


def test_one_wrong_element_and_shape_and_integers_fail():
    actual, expected = _pair(n=64)
    actual[3] += expected.abs().max()
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(actual, expected)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(expected[:-1], expected)
    with pytest.raises(AssertionError, match="integer"):
        assert_close(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]))
    assert_close(torch.zeros(3), torch.zeros(3))
    with pytest.raises(AssertionError):
        assert_close(torch.full((3,), 1e-30), torch.zeros(3))  # a gradient where there is none


def test_grads_close_checks_names_every_gradient_and_missing_ones():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mine = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(8, 4)
    ref(x).sum().backward()
    mine(x).sum().backward()
    assert_grads_close(mine.named_parameters(), ref)
    with torch.no_grad():
        mine[1].weight.grad.mul_(1.001)
    with pytest.raises(AssertionError, match="gradient of 1.weight"):
        assert_grads_close(mine.named_parameters(), ref)
    mine[1].weight.grad = None
    with pytest.raises(AssertionError, match="no gradient for 1.weight"):
        assert_grads_close(mine.named_parameters(), ref)
    with pytest.raises(AssertionError, match="parameter names differ"):
        assert_grads_close(list(mine.named_parameters())[:-1], ref)


def test_tree_close_compares_structure_and_every_leaf():
    a, b = _pair(n=16)
    assert_tree_close({"x": (a, 3)}, {"x": (b, 3)})
    with pytest.raises(AssertionError, match="structure"):
        assert_tree_close({"x": (a,)}, {"x": [b]})
    with pytest.raises(AssertionError):
        assert_tree_close({"x": (a, 3)}, {"x": (b, 4)})
    with pytest.raises(AssertionError, match="relative error"):
        assert_tree_close({"x": (a * 1.001, 3)}, {"x": (b, 3)})
