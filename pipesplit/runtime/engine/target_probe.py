"""Target leaves whose length alone cannot say whether they hold one value per sample.

A 1-D target leaf whose length is a multiple of the batch is cut into microbatches: ``(batch,)``
labels, ``(batch * seq,)`` flattened tokens. A per-feature or per-class weight of that length
(``F.cross_entropy(out, y, weight=w)`` with as many classes as samples) looks the same, and cut,
it is silently wrong where it broadcasts, or a raw torch error where it does not. Nothing in the
target tells them apart, so the loss does: on the first microbatch a step's loss function runs,
it runs again with each such leaf whole. If the whole leaf fails there (its length does not fit
one microbatch's outputs), the cut is right, and that is remembered for the leaf's shape; if both
give the same loss, the leaf makes no difference; if they differ, or only the whole leaf runs,
the step is refused, naming the leaf, its shape and the two ways to say which it is:
``Pipeline(..., target_unbatched=[name])`` (every microbatch takes it whole) or an explicit
``target_batch_dim=0`` (every leaf holds one value per sample, nothing is probed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection

import torch

from pipesplit.compat import pytree
from pipesplit.errors import InputError
from pipesplit.runtime.engine.microbatch import leaf_name

LossFn = Callable[[Any, Any], torch.Tensor]


def _shown(name: str) -> str:
    return f"target leaf {name!r}" if name else "the target"


@dataclass
class TargetProbe:
    """The leaves of one step's target that the loss must confirm were right to cut.

    ``leaves``: (flat index, name, shape) of each; ``whole``: the target's flat leaves as given;
    ``confirmed``: (name, shape, batch) of leaves a whole leaf failed on before (the Pipeline keeps it across
    steps); ``done``: the check ran this step (on one microbatch).
    """

    leaves: list[tuple[int, str, tuple[int, ...]]]
    whole: list[Any]
    confirmed: set[tuple[str, tuple[int, ...], int]]
    batch: int
    done: bool = field(default=False)

    def loss(self, loss_fn: LossFn, out: Any, target: Any) -> torch.Tensor:
        """``loss_fn(out, target)``, checked against each leaf whole (see the module's docstring)."""
        self.done = True
        kept = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)
        try:
            real = loss_fn(out, target)
        except Exception as e:
            for i, name, shape in self.leaves:
                if self._whole(loss_fn, kept, target, i) is not None:
                    raise InputError(
                        f"loss_fn failed on {_shown(name)} {shape} cut into microbatches (as one value per "
                        f"sample: its length is a multiple of the batch of {self.batch}), and runs with it whole "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). If every microbatch "
                        f"takes it whole (class or feature weights), pass {self._fix(name)}."
                    ) from e
            raise
        for i, name, shape in self.leaves:
            other = self._whole(loss_fn, kept, target, i)
            if other is None:
                self.confirmed.add((name, shape, self.batch))  # whole, it does not fit a microbatch: per-sample
            elif not (isinstance(real, torch.Tensor) and isinstance(other, torch.Tensor)
                      and other.shape == real.shape and torch.equal(other, real.detach())):
                raise InputError(
                    f"{_shown(name)} {shape} has a length that is a multiple of the batch of {self.batch}, so "
                    f"pipesplit cut it into microbatches as one value per sample; but loss_fn also runs with it "
                    f"whole, and gives another loss ({_value(real)} cut, {_value(other)} whole, on one "
                    "microbatch), so which you mean cannot be told from its shape. Pass "
                    f"{self._fix(name)} if every microbatch takes it whole (class or feature weights), or "
                    "Pipeline(..., target_batch_dim=0) if it holds one value per sample."
                )
        return real

    def _whole(self, loss_fn: LossFn, out: Any, target: Any, i: int) -> Any:
        """loss_fn on the microbatch with leaf ``i`` whole, or None if it raises."""
        flat, spec = pytree.tree_flatten(target)
        flat[i] = self.whole[i]
        fresh = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        try:
            with torch.no_grad():
                return loss_fn(fresh, pytree.tree_unflatten(flat, spec))
        except Exception:
            return None

    @staticmethod
    def _fix(name: str) -> str:
        return f"Pipeline(..., target_unbatched=[{name!r}])" if name else "Pipeline(..., target_batch_dim=None)"


def _value(t: Any) -> str:
    if isinstance(t, torch.Tensor) and t.numel() == 1:
        return f"{float(t.detach()):.6g}"
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)[:40]


def target_probe(target: Any, batch_dim: int | None, batch: int, num_microbatches: int, whole: Collection[str],
                 confirmed: set[tuple[str, tuple[int, ...], int]]) -> TargetProbe | None:
    """The probe for a step's target, or None where nothing is ambiguous: the 1-D tensor leaves that
    ``split_target`` cuts by default (``batch_dim`` 0), not named whole and not confirmed before."""
    if target is None or batch_dim != 0 or num_microbatches < 2:
        return None
    paths, _ = pytree.tree_flatten_with_path(target)
    leaves = []
    for i, (path, leaf) in enumerate(paths):
        name = leaf_name(path)
        if (isinstance(leaf, torch.Tensor) and leaf.dim() == 1 and name not in whole and leaf.shape[0] % batch == 0
                and (name, tuple(leaf.shape), batch) not in confirmed):
            leaves.append((i, name, tuple(leaf.shape)))
    if not leaves:
        return None
    return TargetProbe(leaves, [leaf for _, leaf in paths], confirmed, batch)
