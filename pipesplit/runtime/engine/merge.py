"""Joining the microbatches' outputs of ``pipe(x)`` into the whole batch's, by each output's rule."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from pipesplit.capture import InputInfo
from pipesplit.compat import pytree
from pipesplit.errors import InputError
from pipesplit.passes.split.merges import CAT, MAX, MEAN, MIN, REFUSE, SAME, SUM, UNKNOWN, OutputMerge, run_counts
from pipesplit.runtime.engine.microbatch import batch_size


class UnknownBatchDim(InputError):
    """An output of a program captured at the example's batch needs joining and the capture cannot say
    how: a capture with a dynamic batch can tell (``output`` is its index)."""

    def __init__(self, output: int, shape: tuple[int, ...], name: str = ""):
        self.output = output
        super().__init__(
            f"output {output}{name} (shape {shape} per microbatch) is computed from the batch, and the program was "
            "captured at the example's batch size, so pipesplit cannot tell how to join the microbatches' values "
            "(a (seq, batch) output, flattened rows, a (batch, batch) similarity, a reduction over the batch). "
            "Compile with pipesplit.compile(..., dynamic_batch=True): that capture tells."
        )


def output_names(out_spec: Any) -> list[str]:
    """Each flat output's path in the model's output (``['loss']``, ``[1]``), for messages."""
    leaves = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec))[0]
    return [pytree.keystr(path) for path, _ in leaves]


def merge_outputs(
    per_microbatch: Sequence[Sequence[Any]], merges: Sequence[OutputMerge], inputs: Sequence[Sequence[Any]],
    infos: Sequence[InputInfo], batch_dim: int, names: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    replicas: int = 1,
) -> tuple[list[Any], list[torch.Tensor | None]]:
    """Join each flat output of the microbatches (``per_microbatch[m][i]``) by its rule ``merges[i]``
    (:mod:`pipesplit.passes.split.merges`); ``inputs[m]`` are microbatch m's flat inputs.

    Returns the joined outputs and, per output, the total weight of a weighted mean (the samples,
    or the labels counted), which a mesh's ``replicas`` combine; None for the others. An output whose
    rule is ``"unknown"`` raises :class:`UnknownBatchDim`; ``"refuse"``, an InputError naming it. One
    microbatch in all is the whole batch: its values are taken as they are. ``names`` (the outputs'
    paths, for messages) may be a function: it is called only when a message needs them.
    """
    merged: list[Any] = []
    weights: list[torch.Tensor | None] = []
    one = len(per_microbatch) * replicas == 1

    def name_of(i: int) -> str:  # for a refusal's message only: the names are built then
        listed = (names() if callable(names) else names) or []
        return f" {listed[i]}" if i < len(listed) and listed[i] else ""

    for i, (values, rule) in enumerate(zip(zip(*per_microbatch), merges)):
        first = values[0]
        weight = None
        if rule.kind == SAME or one:
            out = first
        elif rule.kind == REFUSE:
            raise InputError(
                f"pipe(x) cannot join output {i}{name_of(i)} ({_described(first)} per microbatch) from "
                f"the {len(values)} microbatches: {rule.why}. Run the whole batch at once with prog(x) (prog.eval() "
                "first for eval mode), or a Pipeline with num_microbatches=1; training is not affected (loss_fn sees "
                "each microbatch's outputs)."
            )
        elif not isinstance(first, torch.Tensor):
            out = first
        elif rule.kind == CAT:
            out = torch.cat(list(values), dim=rule.dim)  # type: ignore[arg-type]
        elif rule.kind == UNKNOWN:
            raise UnknownBatchDim(i, tuple(first.shape), name_of(i))
        elif rule.kind == SUM:
            out = torch.stack(list(values)).sum(0).to(first.dtype)
        elif rule.kind in (MAX, MIN):
            stacked = torch.stack(list(values))
            out = stacked.amax(0) if rule.kind == MAX else stacked.amin(0)
        else:
            assert rule.kind == MEAN
            out, weight = _weighted_mean(values, _weights(rule, inputs, infos, batch_dim, first.device))
        merged.append(out)
        weights.append(weight)
    return merged, weights


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}, shape {tuple(value.shape)}"
    return type(value).__name__


def _weights(rule: OutputMerge, inputs: Sequence[Sequence[Any]], infos: Sequence[InputInfo], batch_dim: int,
             device: torch.device) -> torch.Tensor:
    """Each microbatch's weight in a mean: its labels counted by the rule's graph, or its samples."""
    if rule.counts is not None:
        with torch.no_grad():
            got = [run_counts(rule.counts, flat) for flat in inputs]
        return torch.stack([c.to(device, torch.float64) for c in got])
    return torch.tensor([float(batch_size(flat, infos, batch_dim)) for flat in inputs], dtype=torch.float64,
                        device=device)


def _weighted_mean(values: Sequence[torch.Tensor], w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_m w_m v_m / sum_m w_m; a microbatch of weight 0 (every label ignored: its mean is 0/0) adds nothing."""
    stacked = torch.stack(list(values)).to(torch.float64)
    w = w.reshape(-1, *([1] * (stacked.dim() - 1)))
    parts = torch.where(w > 0, stacked * w, torch.zeros_like(stacked))
    total = w.sum()
    return (parts.sum(0) / total).to(values[0].dtype), total
