"""Distributed checkpoints of a pipeline under the original model's names, and gradient clipping
over every stage.

Each rank saves the parameters and buffers it holds (and its optimizer's state) with
``torch.distributed.checkpoint`` under the names the unsplit model uses, so a checkpoint
loads into a pipeline of another layout (other stage count, other ranks) or into the plain
model: every rank asks for the names it holds now, wherever they were written from.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from pipesplit.checks import folder_target, path_arg
from pipesplit.compat import one_process_checkpoint
from pipesplit.errors import InputError, RuntimeCommError
from pipesplit.materialize import check_initialised
from pipesplit.runtime.state import optim_state
from pipesplit.runtime.comm.collectives import store_barrier

if TYPE_CHECKING:
    from pipesplit.runtime.engine.pipeline import Pipeline

log = logging.getLogger(__name__)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _model_state(pipe: "Pipeline") -> dict[str, torch.Tensor]:
    """Every name the original model's ``state_dict`` has for what this process holds (aliases too)."""
    pipe.prog.sync_tied()
    out = {}
    for entry, tensor in pipe.prog.held_state():
        if entry.is_param or entry.persistent:
            for name in entry.aliases:
                out[name] = tensor
    return out


def save(pipe: "Pipeline", path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save the model (and ``optimizer``) state of every rank into the checkpoint folder ``path``.

    Call it on every rank (it is collective under torchrun). Load it with :func:`load` into a
    pipeline of any layout, or into the plain model::

        torch.distributed.checkpoint.load({"model": model.state_dict()}, checkpoint_id=path)

    The checkpoint is written to ``<path>.partial`` and renamed to ``path`` only once every
    rank has written its part: an interrupted save leaves the previous checkpoint at ``path``
    (or none), never one that loads as if it were complete.
    """
    import torch.distributed.checkpoint as dcp

    path = path_arg("pipe.save(path)", path, error=InputError, takes="the folder to write the checkpoint to")
    final = Path(path)
    staging = final.with_name(final.name + ".partial")
    for where in (final, staging, final.with_name(final.name + ".old")):  # refused before anything is touched
        folder_target("pipe.save(path)" if where == final else f"pipe.save(path)'s work folder ({where.name})", str(where))
    if final.is_dir() and any(final.iterdir()) and not (final / ".metadata").is_file():
        raise InputError(f"pipe.save(path) {path!r} is a folder that holds files but no checkpoint; saving replaces "
                         "the folder, so its files would be lost. Pass a new path, or the folder of an earlier save.")
    check_initialised(pipe.prog, " (the checkpoint would hold uninitialised memory)")
    names = optim_state.parameter_names(optimizer, pipe.prog.named_parameters()) if optimizer is not None else []
    dist = _dist() if pipe.executor == "distributed" else None
    lead = dist is None or dist.get_rank() == 0
    if lead and staging.exists():
        shutil.rmtree(staging)
    _barrier(pipe, dist, "before writing the checkpoint")
    state: dict[str, Any] = {"model": _model_state(pipe)}
    if optimizer is not None:  # keyed by parameter name: another layout finds its share
        state["optim"] = optim_state.flat_state(optimizer, names)
    try:
        with one_process_checkpoint(dist is None):
            dcp.save(state, checkpoint_id=staging, no_dist=dist is None)  # type: ignore[attr-defined]
    except BaseException as e:  # torch's CheckpointException is no Exception
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise
        if dist is None:
            raise InputError(f"pipe.save: writing the checkpoint to {staging} failed: {_reason(e)}. {final} is "
                             "untouched; check the path and the free space.") from e
        raise RuntimeCommError(
            f"rank {dist.get_rank()}: saving {final} failed while the ranks exchanged their save plans or "
            f"results: {str(e).splitlines()[0] if str(e) else type(e).__name__}. Another rank died or is stuck; "
            f"{final} still holds the previous checkpoint, if there was one."
        ) from e
    _barrier(pipe, dist, "after writing the checkpoint")
    if lead:
        _publish(staging, final)
    _barrier(pipe, dist, "after publishing the checkpoint")


def _publish(staging: Path, final: Path) -> None:
    """Move the written checkpoint into place; the previous one goes only once the new one is there."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    if old.exists():
        shutil.rmtree(old)


def _barrier(pipe: "Pipeline", dist: Any, when: str) -> None:
    """Wait for every rank within the pipeline's timeout, naming the ones that do not come."""
    if dist is not None:
        store_barrier(pipe.timeout, when + " (the previous checkpoint, if any, is untouched)")


def load(pipe: "Pipeline", path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
         strict: bool = True) -> None:
    """Load what :func:`save` wrote into this pipeline (and ``optimizer``), whatever layout saved it.

    Call it on every rank, after building the optimizer on ``pipe.parameters()``. Each parameter
    gets the optimizer state the checkpoint holds for it, frozen or not (none where it held none).
    The checkpoint must hold every tensor this process holds and nothing the model does not have,
    with the model's shapes (``strict=False``: load the names both have).
    """
    import torch.distributed.checkpoint as dcp

    path = path_arg("pipe.load(path)", path, error=InputError, takes="the folder pipe.save(path) wrote")
    saved = _saved_entries(path)
    model_state = _model_state(pipe)
    names = optim_state.parameter_names(optimizer, pipe.prog.named_parameters()) if optimizer is not None else []
    _check_model_entries(pipe, model_state, saved, path, strict)
    state: dict[str, Any] = {"model": {k: t for k, t in model_state.items() if f"model.{k}" in saved}}
    if not strict:
        _report_matched(path, state["model"], model_state, saved)
    if optimizer is not None:
        if not any(key.startswith("optim.") for key in saved):
            raise InputError(f"load: {path} holds no optimizer state (it was saved without one): "
                             "load it with pipe.load(path), without the optimizer.")
        state["optim"] = optim_state.wanted(names, saved, "optim.")
    try:
        with one_process_checkpoint(pipe.executor != "distributed"):
            dcp.load(state, checkpoint_id=path, no_dist=pipe.executor != "distributed")  # type: ignore[attr-defined]  # in place
    except BaseException as e:  # torch's CheckpointException is no Exception
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise
        raise InputError(f"load: reading the checkpoint {path} failed: {_reason(e)}. Its data files are truncated or "
                         "damaged; the pipeline's tensors may be partly overwritten: load a good checkpoint.") from e
    if optimizer is not None:
        optim_state.load_flat_state(optimizer, names, state["optim"])
    loaded = set(state["model"])
    pipe.prog.uninitialised -= {idx for idx, _ in pipe.prog.held_items()
                                if loaded & set(pipe.prog.state_entry(idx).aliases)}
    pipe.prog.refresh_tied()


def _saved_entries(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path``: its full key -> its storage metadata (size, dtype)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if not (Path(path) / ".metadata").is_file():
        what = "no such folder" if not Path(path).exists() else "no .metadata file in it"
        raise InputError(f"load: {path} is not a checkpoint ({what}); pipe.save(path) writes one.")
    try:
        return dict(FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as e:  # pickle's errors, or an object of another kind
        raise InputError(f"load: {path}/.metadata cannot be read ({type(e).__name__}: {e}): the checkpoint is truncated "
                         "or damaged, or was not written by pipe.save(path). Load another checkpoint.") from e


def _reason(e: BaseException) -> str:
    """The first line of what failed under torch's CheckpointException (it keeps each rank's error)."""
    failures = getattr(e, "failures", None)
    inner = next(iter(failures.values()), e) if isinstance(failures, dict) and failures else e
    if isinstance(inner, tuple) and inner:  # (exception, traceback) in some releases
        inner = inner[0]
    text = str(inner).strip().splitlines()
    first = text[0].split(". ")[0][:200] if text else ""
    return f"{type(inner).__name__}: {first}" if first else type(inner).__name__


def _report_matched(path: str, loading: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor],
                    saved: dict[str, Any]) -> None:
    """How many of the model's tensors a ``strict=False`` load finds in the checkpoint; a warning at none."""
    mine = sorted(model_state)
    theirs = sorted(k[len("model."):] for k in saved if k.startswith("model."))
    log.info("pipesplit: load(strict=False): %d of the %d tensors this process holds found in %s",
             len(loading), len(mine), path)
    if not loading and mine:
        warnings.warn(
            f"load: {path} holds none of the {len(mine)} tensors of this process's stages (strict=False), so "
            f"nothing was loaded. The checkpoint's names: {theirs[:3]}, the model's: {mine[:3]}. Load a checkpoint of "
            "this model.", stacklevel=3)


def _check_model_entries(pipe: "Pipeline", model_state: dict[str, torch.Tensor], saved: dict[str, Any],
                         path: str | os.PathLike[str], strict: bool) -> None:
    """Refuse a checkpoint of another model by name, before anything is written."""
    wrong = [f"{k}: {tuple(saved[f'model.{k}'].size)} for {tuple(t.shape)}" for k, t in model_state.items()
             if f"model.{k}" in saved and tuple(getattr(saved[f"model.{k}"], "size", ())) != tuple(t.shape)]
    if wrong:
        raise InputError(f"load: {path} holds {len(wrong)} tensor(s) of another shape than the model's (saved for "
                         f"expected): {wrong[:5]}. Load a checkpoint of the model this program was compiled from.")
    if not strict:
        return
    missing = sorted(k for k in model_state if f"model.{k}" not in saved)
    known = {alias for i in range(pipe.prog.num_state_entries) for alias in pipe.prog.state_entry(i).aliases}
    unexpected = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k[len("model."):] not in known)
    if missing or unexpected:
        raise InputError(
            f"load: {path} does not match the model: {len(missing)} missing tensor(s) {missing[:5]}, "
            f"{len(unexpected)} the model does not have {unexpected[:5]}. Pass strict=False to load the names "
            "both have (the missing ones keep their values)."
        )


def _grads(pipe: "Pipeline") -> Iterator[torch.Tensor]:
    """This process's share of the gradients: a tied weight held by several ranks counts on its first."""
    assert pipe.collectives is not None
    for idx, p in pipe.prog.held_params():
        if p.grad is not None and pipe.collectives.counts_here(idx):
            yield p.grad


def clip_grad_norm_(pipe: "Pipeline", max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient of every stage and rank so their global norm is at most ``max_norm``.

    Equals ``torch.nn.utils.clip_grad_norm_`` on the unsplit model (the norm is taken over
    every parameter once); returns that total norm, on every rank.
    """
    dist = _dist() if pipe.collectives is not None else None
    params = [p for _, p in pipe.prog.held_params()]
    if dist is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    assert pipe.collectives is not None and pipe.layout is not None  # a distributed pipeline
    device = pipe.collectives.device
    norm_type = float(norm_type)
    grads = [g.detach().to(device, torch.float64) for g in _grads(pipe)]
    if math.isinf(norm_type):
        local = max((g.abs().max() for g in grads), default=torch.zeros((), dtype=torch.float64, device=device))
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pipe.layout.pp_group)
    else:
        total = sum((g.abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=device))
        dist.all_reduce(total, group=pipe.layout.pp_group)  # replicas hold the same (synced) gradients
        total = total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    dtypes = [p.grad.dtype for p in params if p.grad is not None] or [p.dtype for p in params if p.is_floating_point()]
    return total.to(functools.reduce(torch.promote_types, dtypes, dtypes[0]) if dtypes else torch.float32)  # as torch's
