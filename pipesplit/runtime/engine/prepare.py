"""A step's inputs cut into the microbatches of this replica, with their targets, loss scale and random seed:
the :class:`~pipesplit.runtime.engine.worker.StepData` every worker of the step shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pipesplit.errors import PipesplitError
from pipesplit.materialize import check_initialised
from pipesplit.runtime.engine.microbatch import batch_size, split_microbatches, split_target
from pipesplit.runtime.engine.target_probe import target_probe
from pipesplit.runtime.engine.worker import StepData

if TYPE_CHECKING:
    from pipesplit.runtime.engine.pipeline import Pipeline


def prepare_step(pipe: "Pipeline", args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, training: bool) -> StepData:
    """``pipe.step(*args, target=target, **kwargs)``'s data (``training`` False: a forward pass); the
    pipeline's workers are rebuilt first where its program's graphs changed (a re-capture at a new size)."""
    if pipe.prog.uninitialised:
        check_initialised(pipe.prog)
    flat = pipe.prog.flatten_inputs(args, kwargs, whole_batch=True)
    m, first = pipe.num_microbatches, pipe.dp_rank * pipe.num_microbatches  # this replica's share
    total = m * pipe.dp_size
    inputs = split_microbatches(flat, pipe.prog.inputs, total, pipe.batch_dim)[first:first + m]
    mb = batch_size(inputs[0], pipe.prog.inputs, pipe.batch_dim)
    if pipe.prog.ensure_batch(int(mb), f" (a microbatch: a batch of {mb * total} in {total} microbatches)"):
        # the new capture tells batches from tables better (a (T, D) table beside (B, T, D) inputs)
        inputs = split_microbatches(flat, pipe.prog.inputs, total, pipe.batch_dim)[first:first + m]
    if pipe._generation != pipe.prog.generation:  # new graphs (re-captured here or by another Pipeline)
        pipe._build()
    if pipe._grad_edges.stale(flat, training, pipe.executor == "distributed"):  # a cut newly carries gradients
        pipe._build()
    if training and pipe.loss_fn is None:
        raise PipesplitError("step() needs a loss_fn: Pipeline(prog, ..., loss_fn=lambda out, target: ...).")
    targets = probe = None
    if target is not None:
        targets = split_target(target, total, pipe.target_batch_dim, mb * total, pipe.batch_dim,
                               pipe._target_unbatched)[first:first + m]
        if pipe._probed:
            probe = target_probe(target, pipe.target_batch_dim, mb * total, total, pipe._target_unbatched,
                                 pipe._target_confirmed)
    scale = 1.0 / total if pipe.loss_reduction == "mean" else 1.0
    return StepData(inputs, targets, pipe.loss_fn, scale, training, mb, seed=step_seed(pipe),
                    microbatch_offset=first, whole=flat, dp_size=pipe.dp_size, target_probe=probe,
                    sizes=pipe.prog.sizes_of(inputs[0]))


def step_seed(pipe: "Pipeline") -> int:
    """One draw from torch's default generator per step, rank 0's on every rank (reproducible by seeding).
    A program without random ops draws nothing, so torch's generator advances as the model's would."""
    if not pipe.prog.random_ops:
        return 0
    seed = int(torch.randint(0, 2**62, ()).item())
    if pipe.collectives is not None and pipe.prog.random_ops:
        seed = pipe.collectives.step_seed(seed)
    return seed
