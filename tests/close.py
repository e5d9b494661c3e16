"""Closeness for tests: a relative norm whose tolerance follows the dtype compared.

Elementwise ``atol``/``rtol`` fail on noise: an embedding gradient of scale 1e-3 summed in
another order differs by ~1e-7 per element, well past ``atol=1e-6`` relative to it. Here
``||actual - expected|| <= rtol(dtype) * ||expected||`` (or both are ~0).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.utils._pytree as pytree

# Relative-norm tolerances by dtype: a few ulps of accumulated rounding over a model.
RTOL = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are zero)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    num = torch.linalg.vector_norm(a - e).item()
    den = max(torch.linalg.vector_norm(e).item(), torch.linalg.vector_norm(a).item())
    return 0.0 if den == 0.0 else num / den


def assert_close(
    actual: Any, expected: Any, *, name: str = "value", rtol: float | None = None, scale: float = 0.0
) -> None:
    """Shapes equal and the relative norm of the difference within the dtype's tolerance.

    ``scale`` is a floor for the norm compared against: a gradient that is zero up to
    rounding (an attention key bias, which softmax ignores) is compared against the scale
    of its neighbours, not against its own noise.
    """
    if not isinstance(expected, torch.Tensor):
        assert actual == expected, f"{name}: {actual!r} != {expected!r}"
        return
    assert isinstance(actual, torch.Tensor), f"{name}: expected a tensor, got {type(actual).__name__}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not expected.is_floating_point():
        assert torch.equal(actual.cpu(), expected.cpu()), f"{name}: integer values differ"
        return
    tol = rtol if rtol is not None else max(RTOL.get(actual.dtype, 1e-5), RTOL.get(expected.dtype, 1e-5))
    err = rel_err(actual, expected)
    if err > tol and scale > 0:
        diff = torch.linalg.vector_norm(actual.detach().double().cpu() - expected.detach().double().cpu()).item()
        err = diff / max(scale, torch.linalg.vector_norm(expected.detach().double()).item())
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g} ({actual.dtype} vs {expected.dtype})"


def assert_grads_close(
    got: Mapping[str, torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
    ref: torch.nn.Module,
    *,
    rtol: float | None = None,
) -> None:
    """Every parameter of ``ref`` that has a gradient has the same one in ``got`` (by name)."""
    held = dict(got)
    ref_params = dict(ref.named_parameters())
    norms = [torch.linalg.vector_norm(p.grad.double()).item() for p in ref_params.values() if p.grad is not None]
    floor = 1e-4 * max(norms, default=0.0)  # gradients below this are rounding noise around zero
    assert held.keys() == ref_params.keys(), f"parameter names differ: {sorted(set(held) ^ set(ref_params))[:5]}"
    for name, p in ref_params.items():
        if p.grad is None:
            assert held[name].grad is None or not held[name].grad.any(), f"{name}: gradient where the model has none"
            continue
        assert held[name].grad is not None, f"no gradient for {name}"
        assert_close(held[name].grad, p.grad, name=f"gradient of {name}", rtol=rtol, scale=floor)


def assert_tree_close(actual: Any, expected: Any, *, name: str = "outputs", rtol: float | None = None) -> None:
    """The same pytree structure, and every leaf close (tensors) or equal (anything else)."""
    got, got_spec = pytree.tree_flatten(actual)
    want, want_spec = pytree.tree_flatten(expected)
    assert got_spec == want_spec, f"{name}: structure {got_spec} != {want_spec}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, name=f"{name}[{i}]" if len(want) > 1 else name, rtol=rtol)
