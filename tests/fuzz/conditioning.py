"""How far the plain model's own answer moves when each of its ops rounds once more: a case whose answer
float64 does not determine cannot be judged at RTOL.

A difference the fuzzer finds is a defect unless the plain model itself is that unstable. Seed 8888
case 2538 is the kind: an InstanceNorm reads an input that is constant along the sequence in exact
arithmetic (its standard deviation 1e-17 to 2.4e-12 on values up to 0.1, rounding), so what it
outputs is rounding noise scaled by 1/sqrt(eps), and the loss (6.7e-10, beside gradients of 13.6) is
that noise; a compiled stage runs other kernels than eager and gets other noise (0.1 of the loss).
pipesplit is exact there (with compile off the case passes), but the comparison failed.

The probe (Monte Carlo arithmetic): step 0 of the plain model by gradient accumulation, once as it is
and once with every ATen op's result rounded once more at random (:class:`Rounding`); ``movement`` is
each tensor's relative difference (the loss's, each gradient's floored as the harness floors it). A
failed comparison is ill-conditioned, counted and reported (the summary names the first), not a
failure, only where all of these hold: the tensor that failed is one the probe covers (step 0's loss
and gradients), its error is within ``SLACK`` of that same tensor's movement, and, for a case with
compiled stages, the same case passes with them off (what tells other kernels from a wrong result:
tests/fuzz/check.py). In a case float64 determines a tensor moves ~1e-16 and SLACK times it is under
RTOL, so every difference RTOL flags there stays a failure (``test_a_difference_of_one_in_a_million_is_caught``);
a well-determined tensor in an ill-conditioned case is judged on its own movement, not the loss's. It
runs only after a comparison failed, and never under torchrun (a rerun on one rank would wait on the
others).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from pipesplit.compat import TorchDispatchMode

from tests.fuzz import harness

UNIT = 2.0 ** -53  # float64's unit roundoff: one more rounding of each result
# an error up to SLACK times the plain model's own movement is rounding: one more rounding per op is less
# than another kernel does (case 2538: its loss moves 2.4e-5 under Rounding, 0.1 between an eager and a
# compiled stage, whose attention and norm kernels differ); in a case whose answer float64 determines
# (movement ~1e-16) SLACK x movement stays under RTOL, so such a case is judged as before
SLACK = 1e4


class Rounding(TorchDispatchMode):
    """Every ATen op's floating results (forward and backward; a view or an in-place write excepted) times
    (1 + r * UNIT), r = +-1 drawn from ``gen``: each result rounded once more, as another kernel or another
    order of a sum rounds it (Monte Carlo arithmetic, at the level of each op's operands)."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.gen = gen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        return pytree.tree_map(self._round, out)

    def _round(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.is_sparse or t.numel() == 0:
            return t
        r = torch.randint(0, 2, t.shape, generator=self.gen, device=t.device).to(t.dtype) * 2 - 1
        return t * (1 + UNIT * r)


def movement(make_model: Callable[[], torch.nn.Module], io: dict, cfg: dict) -> dict[str, float]:
    """Each relative difference of step 0 between the plain model run eagerly and run again under
    :class:`Rounding`, by the name the harness compares it under (``loss at step 0``, ``gradient of
    NAME at step 0``, ``input gradient at step 0``); empty where the plain model cannot run."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(cfg["seed"])
        model = make_model()
        gen = torch.Generator().manual_seed(cfg["seed"])
        harness.make_inputs(io, cfg["example_batch"], gen)  # the draws run_case makes before its first batch
        args, kw = harness.make_inputs(io, cfg["mb"] * cfg["m"], gen)
        with torch.no_grad():
            shapes = copy.deepcopy(model).eval()(*harness.fresh(args, kw, False)[0], **harness.fresh(args, kw, False)[1])
        target = pytree.tree_map(lambda o: torch.randn(o.shape, generator=gen), shapes)
        plain = _step(copy.deepcopy(model), io, cfg, args, kw, target, None)
        rounded = _step(copy.deepcopy(model), io, cfg, args, kw, target, torch.Generator().manual_seed(cfg["seed"]))
    finally:
        torch.set_default_dtype(before)
    return {} if plain is None or rounded is None else _moved(plain, rounded)


def _step(ref: torch.nn.Module, io: dict, cfg: dict, args: tuple, kw: dict, target: Any,
          rounding: torch.Generator | None) -> list[tuple[str, Any]] | None:
    """Step 0 by gradient accumulation: (name, value) of the loss, each parameter's gradient and the
    input's, or None."""
    a, k = harness.fresh(args, kw, io["input_grad"], io.get("table_grad", False))
    scale = 1.0 / cfg["m"] if cfg.get("reduction") == "mean" else 1.0
    torch.manual_seed(1000)  # the same dropout masks in both runs
    try:
        with Rounding(rounding) if rounding is not None else contextlib.nullcontext():
            loss = harness.reference_step(ref, a, k, target, cfg["m"], harness.dot_loss, scale, io.get("out_dim", 0))
    except Exception:  # harness.Invalid: the plain model cannot run this draw, nothing to measure
        return None
    return [("loss at step 0", loss), *((f"gradient of {n} at step 0", p.grad) for n, p in ref.named_parameters()),
            *(("input gradient at step 0", t.grad) for t in a[:1] if isinstance(t, torch.Tensor))]


def _moved(want: list[tuple[str, Any]], got: list[tuple[str, Any]]) -> dict[str, float]:
    """Each relative difference: the loss's as it is; a gradient's floored as the harness compares it
    (harness.compare_step), against rounding on the scale of the loss and the largest gradient (a
    gradient zero in exact arithmetic, a bias before a BatchNorm, is rounding in both runs: it moves 100%
    under any rounding, and a comparison floors it)."""
    scale = max([abs(float(want[0][1]))] + [_dense(t).norm().item() for _, t in want[1:] if t is not None])
    return {name: _relative(x, y, 0.0 if i == 0 else scale)
            for i, ((name, x), (_, y)) in enumerate(zip(want, got)) if x is not None and y is not None}


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to_dense().double() if t.is_sparse else t.detach().double()


def _relative(x: torch.Tensor, y: torch.Tensor, scale: float) -> float:
    x, y = _dense(x), _dense(y)
    diff = torch.linalg.vector_norm(x - y).item()
    den = max(torch.linalg.vector_norm(x).item(), torch.linalg.vector_norm(y).item())
    floor = harness.NOISE * max(1.0, scale) if scale else 0.0
    return 0.0 if diff <= floor or den == 0 else diff / den


def ill_conditioned(make_model: Callable[[], torch.nn.Module], io: dict, cfg: dict, error: float,
                    name: str) -> float | None:
    """The movement under :class:`Rounding` of the tensor ``name`` whose comparison failed with relative
    ``error``, where the error is within SLACK of it (rounding, amplified as this case amplifies it), else
    None: a tensor the probe does not cover (a later step, a buffer, an output) is never excused."""
    moved = movement(make_model, io, cfg).get(name, 0.0)
    return moved if 0 < error <= SLACK * moved else None
