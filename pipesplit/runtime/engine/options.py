"""The Pipeline's options that are decided once, when it is built: which executor runs it and
which stages recompute their activations (activation checkpointing), each checked with a clear error."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence, Union

from torch import nn

from pipesplit.checks import number
from pipesplit.errors import PipesplitError

if TYPE_CHECKING:
    from pipesplit.passes.split.program import SplitProgram, Stage

Checkpoint = Union[bool, Sequence[int], Mapping[int, int], None]
"""``Pipeline(checkpoint=...)``: True (every stage), False, stage indices, ``{stage: n}`` (the stage's first
``n`` blocks recompute, as ``compile(checkpoint={stage: n})`` plans it), or None (as planned)."""


def check_arguments(prog: Any, num_microbatches: Any, loss_fn: Any, timeout: Any, batch_dim: Any = None,
                    target_batch_dim: Any = "same") -> None:
    """``Pipeline``'s first arguments, each refused by name before anything is built."""
    from pipesplit.passes.split.program import SplitProgram

    if not isinstance(prog, SplitProgram):
        what = "the nn.Module itself" if isinstance(prog, nn.Module) else f"a {type(prog).__name__}"
        raise PipesplitError(f"Pipeline takes the program pipesplit.compile returns, got {what}: "
                             "prog = pipesplit.compile(model, example, num_stages=...); pipe = Pipeline(prog, ...).")
    number("Pipeline(num_microbatches=...)", num_microbatches, minimum=1, integer=True, example="4")
    if loss_fn is not None and not callable(loss_fn):
        raise PipesplitError(f"loss_fn must be a function loss_fn(output, target) -> loss, got {loss_fn!r}; "
                             "e.g. loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y).")
    number("Pipeline(timeout=...)", timeout, above=True, example="300 (seconds a rank waits for another)")
    # batch_dim (None: the program's) and target_batch_dim ("same", None or a dimension)
    number("Pipeline(batch_dim=...)", batch_dim, integer=True, none=True, example=str(prog.batch_dim))
    if target_batch_dim != "same":
        number("Pipeline(target_batch_dim=...)", target_batch_dim, integer=True, none=True,
               example="0, or None (every microbatch takes the target whole)")


def chosen_executor(executor: str, transport: str, has_groups: bool) -> str:
    """``"local"`` (every rank a thread of this process) or ``"distributed"`` (this process one rank
    under torchrun); ``"auto"`` is distributed wherever a process group of several ranks is up."""
    import torch.distributed as dist

    if executor == "auto":
        executor = "distributed" if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else "local"
    if executor not in ("local", "distributed"):
        raise PipesplitError(f"executor must be 'local', 'distributed' or 'auto', got {executor!r}.")
    if executor == "local" and has_groups:
        raise PipesplitError("mesh=, pp_group= and dp_group= need the distributed executor (torchrun).")
    if transport not in ("auto", "rendezvous"):
        raise PipesplitError(f"transport must be 'auto' or 'rendezvous', got {transport!r}.")
    if transport == "rendezvous" and executor == "distributed":
        raise PipesplitError("transport='rendezvous' imposes NCCL's semantics on the local executor; under "
                             "torchrun the process group's own backend moves the tensors. Leave transport='auto'.")
    return executor


def asked_blocks(prog: "SplitProgram", asked: Mapping[Any, Any]) -> tuple[list[int], dict[int, int]]:
    """``Pipeline(checkpoint={stage: n})``, as ``compile`` plans it: the stages asked for all their blocks
    (recomputed whole), and how many of its first nodes each other one recomputes (``Plan.checkpoint_partial``).
    PlanError for a stage out of range or more blocks than the stage has, with the numbers."""
    from pipesplit.passes.plan.partial_checkpoint import asked_heads, check_blocks_choice, node_blocks

    check_blocks_choice(asked)
    graph = {n.name: n for n in prog.captured_gm.graph.nodes}
    names = [name for stage in prog.plan.stages for name in stage]
    missing = [name for name in names if name not in graph]
    if missing:
        raise PipesplitError(f"the plan's stages name {len(missing)} nodes (e.g. {missing[0]!r}) the program's graph "
                             "does not have; compile again, or pass checkpoint= to pipesplit.compile instead.")
    starts = [sum(len(s) for s in prog.plan.stages[:i]) for i in range(prog.num_stages)]
    whole, heads = asked_heads(node_blocks([graph[name] for name in names]), starts, len(names), asked)
    return sorted(whole), {s: h - starts[s] for s, h in heads.items()}


def checkpointed_stages(prog: "SplitProgram", local: "Sequence[Stage]", checkpoint: Checkpoint) -> set[int]:
    """The stages that recompute their activations in the backward: ``checkpoint`` (True: all, a
    list: those, a dict: those it asks all the blocks of), or as the plan was made (None). A stage this
    process runs that updates buffers in place is refused: recomputing it would update them twice."""
    planned = checkpoint is None and bool(prog.plan.checkpoint)
    if checkpoint is None:  # the stages the plan chose (compile(checkpoint=...)): exactly those
        checkpoint = list(prog.plan.checkpoint)
    if isinstance(checkpoint, Mapping):
        checkpoint = asked_blocks(prog, checkpoint)[0]
    if not isinstance(checkpoint, (bool, list, tuple, set, range)) or (
            not isinstance(checkpoint, bool) and not all(isinstance(i, int) and not isinstance(i, bool) for i in checkpoint)):
        raise PipesplitError(f"checkpoint must be True, False, None (as planned), a list of stage indices or a dict "
                             f"of stage -> how many of its first blocks recompute, got {checkpoint!r}; e.g. "
                             "checkpoint=[0, 1] or checkpoint={0: 2}.")
    ckpt = set(range(prog.num_stages)) if checkpoint is True else set(checkpoint or ())
    bad = sorted(i for i in ckpt if not 0 <= i < prog.num_stages)
    if bad:
        raise PipesplitError(f"checkpoint names stages {bad}; the program has stages 0..{prog.num_stages - 1}.")
    for s in local:
        if s.index in ckpt and any(t in prog.mutated_targets for t in s.attr_targets):
            raise PipesplitError(
                f"stage {s.index} updates buffers in place (e.g. BatchNorm running stats); activation "
                "checkpointing would update them twice. "
                + (f"The plan checkpoints it (plan.checkpoint={list(prog.plan.checkpoint)}): compile with "
                   "checkpoint= leaving it out, or pass Pipeline(checkpoint=False) (the plan's memory figures then "
                   "no longer hold), or use eval-mode normalisation." if planned
                   else "Disable checkpoint or use eval-mode normalisation.")
            )
    return ckpt


def partial_stages(prog: "SplitProgram", local: "Sequence[Stage]", checkpoint: Checkpoint) -> dict[int, list[str]]:
    """The stages this process runs that recompute only their first nodes, as planned (``checkpoint`` None:
    ``Plan.checkpoint_partial``) or asked (``{stage: n}``), with those nodes' names; a head that updates
    buffers in place is refused."""
    from pipesplit.runtime.engine.recompute_head import RecomputedHead

    if checkpoint is None:
        counts = prog.plan.checkpoint_partial
    elif isinstance(checkpoint, Mapping):
        counts = asked_blocks(prog, checkpoint)[1]
    else:  # Pipeline(checkpoint=...) says which stages recompute all of their forward
        return {}
    out = {}
    for s in local:
        n = counts.get(s.index)
        if not n:
            continue
        names = prog.plan.stages[s.index][:n]
        written = sorted(set(RecomputedHead(s.module, names)
                             .attr_targets) & set(prog.mutated_targets))
        if written:
            label = prog.plan.checkpoint_labels.get(s.index, "") if checkpoint is None else f"checkpoint={checkpoint}"
            raise PipesplitError(
                f"stage {s.index} recomputes its first {n} nodes ({label}), "
                f"which update buffers in place ({', '.join(written[:3])}: e.g. BatchNorm running stats); "
                "recomputing them would update them twice. Compile with checkpoint= leaving the stage out, pass "
                "Pipeline(checkpoint=False) (the plan's memory figures then no longer hold), or use eval-mode "
                "normalisation.")
        out[s.index] = names
    return out
