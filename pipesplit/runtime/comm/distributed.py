"""Running under torchrun: each rank's device, and its stages placed there.

NCCL wants one GPU per rank, made current (``torch.cuda.set_device``) before the first
collective; otherwise every rank of a machine lands on GPU 0. :func:`init_device` does
that from torchrun's ``LOCAL_RANK``::

    device = pipesplit.runtime.comm.distributed.init_device()   # cuda:LOCAL_RANK, or cpu without CUDA
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

A distributed :class:`~pipesplit.Pipeline` calls it too (for NCCL), and moves the stages
of its rank that were compiled for a CUDA device onto ``cuda:LOCAL_RANK``. What the ranks
compute together (gradient sums, seeds, losses) is in :mod:`pipesplit.runtime.comm.collectives`.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from pipesplit.compat import has_compatible_shallow_copy_type
from pipesplit.errors import PipesplitError


def local_rank() -> int:
    """This process's index among the ranks of its machine, as torchrun sets it (``LOCAL_RANK``); 0 without."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise PipesplitError(f"LOCAL_RANK must be an integer (torchrun sets it), got {value!r}.") from None


def pick_device(backend: str | None, cuda_available: bool, num_gpus: int, rank: int) -> torch.device:
    """The device a rank with local index ``rank`` computes on; pure, so it can be tested without a GPU.

    ``cuda:rank`` when the backend includes NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``), or
    for ``backend=None`` when CUDA is available; the CPU otherwise (gloo).

    >>> pick_device(None, True, 4, 2), pick_device(None, False, 0, 2), pick_device("gloo", True, 4, 2)
    (device(type='cuda', index=2), device(type='cpu'), device(type='cpu'))
    """
    if not ((backend is not None and "nccl" in backend) or (backend is None and cuda_available)):
        return torch.device("cpu")
    if not cuda_available or num_gpus == 0:
        raise PipesplitError("the NCCL backend needs a GPU per rank, but CUDA sees none here; use the gloo backend "
                             "on CPU (dist.init_process_group('gloo')).")
    if not 0 <= rank < num_gpus:
        raise PipesplitError(
            f"LOCAL_RANK={rank} but this machine has {num_gpus} GPU(s) visible, and NCCL needs one GPU per rank (one "
            f"GPU cannot host two NCCL ranks). Launch at most --nproc-per-node {num_gpus}, or check CUDA_VISIBLE_DEVICES."
        )
    return torch.device("cuda", rank)


def init_device(backend: str | None = None) -> torch.device:
    """Pick this rank's device (:func:`pick_device` with ``LOCAL_RANK``) and make it CUDA's current one.

    Call it before the first collective (NCCL binds its communicator to the current device).
    ``backend`` defaults to the initialised process group's, or else to NCCL when CUDA is
    available. Returns ``cuda:LOCAL_RANK`` or ``cpu``.
    """
    import torch.distributed as dist

    if backend is None and dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
    cuda = torch.cuda.is_available()
    device = pick_device(backend, cuda, torch.cuda.device_count() if cuda else 0, local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def rank_device(device: torch.device, cuda: torch.device | None) -> torch.device:
    """Where a stage compiled for ``device`` runs on a rank whose GPU is ``cuda``: any CUDA device maps to it.

    >>> rank_device(torch.device("cuda", 0), torch.device("cuda", 3)), rank_device(torch.device("cpu"), None)
    (device(type='cuda', index=3), device(type='cpu'))
    """
    if device.type != "cuda":
        return device
    if cuda is None:
        raise PipesplitError(f"a stage was compiled for {device}, but this rank has no GPU; compile with devices "
                             "naming 'cpu', or run one rank per GPU.")
    return cuda


def move_stages(prog: Any, stages: Iterable[int], device: torch.device) -> None:
    """Move the given stages' parameters and buffers to ``device`` in place (``.data``), so that the
    objects the program, its tied-weight bookkeeping and optimizers hold stay the same; tensors
    that shared memory before (a tied weight's replicas on one device) share it after."""
    moved: dict[tuple[Any, ...], torch.Tensor] = {}

    def to(t: torch.Tensor) -> torch.Tensor:
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key not in moved:
            moved[key] = t.detach().to(device)
        return moved[key]

    for s in stages:
        stage = prog.stages[s]
        modules = {id(m): m for m in [stage.module, *stage.modes.values()] if m is not None}
        tensors = {id(t): t for t in prog.stage_entries[s].values()}
        for module in modules.values():
            for sub in module.modules():
                tensors.update({id(t): t for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None})
        for t in tensors.values():
            if t.device == device:
                continue
            data = to(t)
            if has_compatible_shallow_copy_type(t, data):  # CPU <-> CUDA: what Module.cuda() does
                t.data = data
            else:  # e.g. to "meta": swap the contents, the object stays
                new = data.detach()
                torch.utils.swap_tensors(t, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new)
        stage.place_graphs(device)  # device=cuda:0 baked by the capture: this rank's GPU now
        stage.device = device


def place_rank(prog: Any, local: Sequence[Any]) -> torch.device:
    """Make this rank's GPU (cuda:LOCAL_RANK) current when the backend has NCCL and move its stages
    compiled for any CUDA device there; return the device collectives put their buffers on."""
    import torch.distributed as dist

    backend = dist.get_backend()  # "nccl", "gloo", or both: "cpu:gloo,cuda:nccl"
    device = init_device(backend)
    on_gpu = [s for s in local if s.device.type == "cuda"]
    on_cpu = [s for s in local if s.device.type == "cpu"]
    if on_gpu and device.type != "cuda":
        raise PipesplitError(
            f"stage {on_gpu[0].index} was compiled for {on_gpu[0].device}, but the process group uses {backend}, "
            "whose point-to-point ops move CPU tensors only. Use NCCL for GPU stages "
            "(dist.init_process_group('nccl')), or compile with devices=['cpu'] * n."
        )
    if on_cpu and backend == "nccl":
        raise PipesplitError(
            f"stage {on_cpu[0].index} was compiled for the CPU, but NCCL moves CUDA tensors only. Compile with "
            "devices=['cuda'] * n (each rank's stages then run on cuda:LOCAL_RANK), or use gloo."
        )
    if on_gpu:
        move_stages(prog, [s.index for s in on_gpu if s.device != rank_device(s.device, device)], device)
    return device if backend == "nccl" else torch.device("cpu")


def start_communicator(device: torch.device) -> None:
    """One collective that every rank joins: NCCL creates its communicator on the first one, and the
    batched point-to-point ops that follow may not be the first (torch's batch_isend_irecv rule)."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device=device))
