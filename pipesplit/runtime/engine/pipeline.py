"""``pipesplit.Pipeline``: train or evaluate a split program under a schedule."""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Mapping, Optional, cast

import torch
from torch import nn

from pipesplit.checks import known_keywords
from pipesplit.compat import pytree
from pipesplit.errors import PipesplitError, ScheduleError
from pipesplit.materialize import init_weights
from pipesplit.passes.split.generalise import generalise
from pipesplit.passes.split.merges import UNKNOWN
from pipesplit.passes.split.program import SplitProgram
from pipesplit.state import zero_grads
from pipesplit.runtime.engine.options import Checkpoint, check_arguments, checkpointed_stages, chosen_executor, partial_stages
from pipesplit.runtime.engine.merge import merge_outputs, output_names
from pipesplit.runtime.comm.collectives import Layout, StepCollectives
from pipesplit.runtime.graphs.compiled import StageCompiler
from pipesplit.runtime.comm.distributed import place_rank, start_communicator
from pipesplit.runtime.comm.exchange import RankComm, program_edges
from pipesplit.runtime.comm.grad_edges import GradientEdges
from pipesplit.runtime.state.state_writes import check_state_writes
from pipesplit.runtime.comm.rendezvous import RendezvousTransport
from pipesplit.runtime.engine.prepare import prepare_step
from pipesplit.runtime.engine.steps import run_distributed_step, run_local_step
from pipesplit.runtime.engine.threads import RankThreads
from pipesplit.runtime.engine.trace import Trace
from pipesplit.runtime.comm.transport import DistTransport, LocalTransport
from pipesplit.runtime.engine.worker import StageWorker, StepData
from pipesplit.schedules import ActionKind, Schedule, resolve_schedule
from pipesplit.schedules.issue import Program, issue, proven
from pipesplit.schedules.rendezvous import comm_plan, receiver_stage
from pipesplit.deprecation import num_keywords, renamed_attribute

LossFn = Callable[[Any, Any], torch.Tensor]


def _forward_only(schedule: Schedule) -> Schedule:
    return dataclasses.replace(schedule, actions=tuple(tuple(a for a in rank if a.kind is ActionKind.FORWARD)
                                                       for rank in schedule.actions))


class Pipeline:
    """Runs a :class:`~pipesplit.SplitProgram` as pipeline stages under a schedule.

    In one process (``executor="local"``) every rank of the schedule gets a worker
    thread (and, on GPU, a CUDA stream per stage), so stages on different devices make
    progress concurrently. Under ``torchrun`` with an initialised process group
    (``executor="distributed"``, the default when one exists) each process runs the
    stages of its own rank and keeps only their parameters.

    ``checkpoint`` recomputes stages' activations in the backward instead of keeping
    them: ``True`` (every stage), a list of stage indices, ``{stage: n}`` (the stage's first
    ``n`` blocks, as ``compile(checkpoint={stage: n})`` plans it), or ``False``. Left as None it
    follows the plan: exactly what ``prog.plan.checkpoint`` and ``prog.plan.checkpoint_partial``
    name (chosen by ``compile(checkpoint=...)``; its memory figures count on that).

    Communication follows a plan proven free of deadlock under NCCL's semantics (see
    :func:`pipesplit.schedules.rendezvous.comm_plan` and :mod:`pipesplit.schedules.issue`):
    what two ranks exchange at the same time is posted in one batch on both sides, each
    receive is posted an action ahead of its consumer, and sends are not waited for, so
    communication overlaps compute. ``transport="rendezvous"`` runs the local executor with
    those semantics imposed (a send waits for its receive, messages between two ranks pair
    in order, no tags, a rank's batches one after another), so a CPU run fails where NCCL
    would hang. Under ``torchrun`` with
    NCCL each rank uses ``cuda:LOCAL_RANK`` and its stages compiled for CUDA move there.

    >>> import torch, pipesplit
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> prog = pipesplit.compile(model, torch.randn(4, 8), num_stages=2)
    >>> pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2,
    ...                           loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
    >>> loss = pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))
    """

    n_microbatches = renamed_attribute("n_microbatches", "num_microbatches")

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step, per data-parallel replica (the schedule is made for this count)."""
        return self._num_microbatches

    @num_microbatches.setter
    def num_microbatches(self, value: int) -> None:
        raise PipesplitError(
            f"num_microbatches is fixed when the Pipeline is built: its schedule ({self.schedule.name!r}) orders "
            f"{self._num_microbatches} microbatches, and running {value} on it would skip or miss some. Build another: "
            f"pipesplit.Pipeline(prog, {self.schedule.name!r}, num_microbatches={value}, ...) on the same program."
        )

    @num_keywords
    @known_keywords
    def __init__(
        self,
        prog: SplitProgram,
        schedule: str | Schedule = "1f1b",
        num_microbatches: int = 4,
        loss_fn: LossFn | None = None,
        *,
        num_ranks: int | None = None,
        batch_dim: int | None = None,  # default: the program's (compile(..., batch_dim=...))
        loss_reduction: str = "mean",  # "mean": loss_fn averages over the batch; "sum": it sums
        checkpoint: Checkpoint = None,  # default: as planned (prog.plan.checkpoint, .checkpoint_partial)
        timeout: float = 300.0,
        executor: str = "auto",
        target_batch_dim: int | None | str = "same",  # default: batch_dim; None: every microbatch gets it whole
        target_unbatched: Collection[str] = (),  # target leaves every microbatch gets whole ("w" of {"y": y, "w": w})
        transport: str = "auto",  # local executor: "auto" (mailboxes) or "rendezvous" (NCCL's semantics imposed)
        mesh: Any = None,  # a DeviceMesh with a "pp" (and a "dp") dimension
        pp_group: Any = None,  # or the process groups themselves
        dp_group: Any = None,
        compile: bool | Mapping[str, Any] = False,  # noqa: A002  # True or torch.compile's options: compiled stages
        progress: bool = True,  # compile=...: say on stderr which graph compiles, as it goes, and the total
    ):
        check_arguments(prog, num_microbatches, loss_fn, timeout, batch_dim, target_batch_dim)
        if loss_reduction not in ("mean", "sum"):
            raise PipesplitError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
        executor = chosen_executor(executor, transport, mesh is not None or pp_group is not None or dp_group is not None)
        self.prog, self.loss_fn = prog, loss_fn
        self.compiler = StageCompiler(compile, progress) if compile else None  # see pipesplit/runtime/graphs/compiled.py
        self._threads: RankThreads | None = None  # the local executor's rank threads, started on first use
        self._tracer: Trace | None = None  # set inside `with self.trace():`
        self.batch_dim = prog.batch_dim if batch_dim is None else batch_dim
        if self.batch_dim != prog.batch_dim:
            raise PipesplitError(
                f"batch_dim={batch_dim} but the program was compiled with batch_dim={prog.batch_dim}, so only that "
                "dimension may change size; compile with pipesplit.compile(..., batch_dim=...) to match."
            )
        self.target_batch_dim: int | None = (
            self.batch_dim if target_batch_dim == "same" else cast(Optional[int], target_batch_dim))
        # a default target_batch_dim cuts 1-D leaves of the batch's length only once the loss confirms it
        self._target_unbatched, self._probed = frozenset(target_unbatched), target_batch_dim == "same"
        self._target_confirmed: set[tuple[str, tuple[int, ...], int]] = set()
        self._num_microbatches, self.loss_reduction, self.timeout = num_microbatches, loss_reduction, timeout
        self.executor = executor
        self.layout: Layout | None = None
        self.dp_size, self.dp_rank = 1, 0
        if executor == "distributed":
            self.layout = Layout(mesh, pp_group, dp_group)
            world = self.layout.pp_size
            if num_ranks is not None and num_ranks != world:
                raise ScheduleError(f"num_ranks={num_ranks} but the pipeline's process group has {world} ranks.")
            num_ranks, self.rank = world, self.layout.rank
            self.dp_size, self.dp_rank = self.layout.dp_size, self.layout.dp_rank
        else:
            self.rank = None  # type: ignore[assignment]  # the local executor runs every rank
        self.schedule = resolve_schedule(schedule, prog.num_stages, num_ranks, num_microbatches)
        if executor == "distributed" and self.schedule.num_ranks != num_ranks:
            raise ScheduleError(
                f"schedule {self.schedule.name!r} for {prog.num_stages} stages needs {self.schedule.num_ranks} ranks, "
                f"but {num_ranks} are running; launch with --nproc-per-node {self.schedule.num_ranks}."
            )
        check_state_writes(prog, self.schedule, num_microbatches, distributed=executor == "distributed")
        rank_of = self.schedule.stage_to_rank
        local = [s for s in prog.stages if self.rank is None or rank_of[s.index] == self.rank]
        ckpt = checkpointed_stages(prog, local, checkpoint)
        self._partial = partial_stages(prog, local, checkpoint)
        self._prove = executor == "distributed" or transport == "rendezvous"
        streams = {}
        if executor == "distributed":
            assert self.layout is not None
            device = place_rank(prog, local)
            self.transport: Any = DistTransport(timeout, self.layout.global_ranks)
            self.collectives: StepCollectives | None = StepCollectives(prog, self.layout, rank_of, device)
            prog.keep_only({s.index for s in local})
            if prog.on_meta:  # a model too big for one host: storage for this rank's stages only
                prog.materialize({s.index for s in local})
            start_communicator(device)
            self.collectives.share_initialised()  # replicas and tied copies start equal, as under DDP
        else:
            self.transport = RendezvousTransport(timeout) if transport == "rendezvous" else LocalTransport(timeout)
            self.collectives = None
            if prog.on_meta:
                prog.materialize()
            for s in local:  # a stream per stage, so ranks sharing a GPU overlap
                if s.device.type == "cuda":
                    streams[s.index] = torch.cuda.Stream(device=s.device)
        self._local, self._ckpt, self._streams = [s.index for s in local], ckpt, streams
        self._grad_edges = GradientEdges(prog)
        self._build()

    def _build(self) -> None:
        """The communication plans and stage workers, from the program's current stage graphs."""
        prog, rank_of = self.prog, self.schedule.stage_to_rank
        edges = self._grad_edges.built = program_edges(prog)
        self._generation = prog.generation
        # What every rank issues, with receives posted ahead; proven for NCCL's semantics where they apply
        prove = proven if self._prove else (lambda schedule, plan: issue(plan))
        self._plans: dict[str, Program] = {
            "train": prove(self.schedule, comm_plan(self.schedule, edges)),
            "forward": prove(_forward_only(self.schedule), comm_plan(_forward_only(self.schedule), edges)),
        }
        done = self.collectives.stage_done if self.collectives is not None and self.dp_size > 1 else None
        split = {a.stage for actions in self.schedule.actions for a in actions if a.kind is ActionKind.BACKWARD_WEIGHT}
        self.workers = {
            i: StageWorker(prog, prog.stages[i], rank_of, checkpointing=i in self._ckpt, stream=self._streams.get(i),
                           on_gradients=done, split_backward=i in split, compiler=self.compiler,
                           head=self._partial.get(i, ()))
            for i in self._local
        }
        for w in self.workers.values():
            w.tracer = self._tracer

    @contextmanager
    def trace(self) -> Iterator[Trace]:
        """Record when every action of the steps run inside the block ran.

        ``with pipe.trace() as tr: pipe.step(x, target=y)``; then ``tr.timeline()`` is the
        measured timeline of the last step and ``tr.to_chrome("trace.json")`` writes a
        Chrome / Perfetto trace (see :mod:`pipesplit.runtime.engine.trace`). Under ``torchrun``
        each process records its own rank's actions.
        """
        tracer = Trace(self.schedule)
        for w in self.workers.values():
            w.tracer = tracer
        self._tracer = tracer
        try:
            yield tracer
        finally:
            self._tracer = None
            for w in self.workers.values():
                w.tracer = None

    # ---------------------------------------------------------------- parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This process's parameters under the original model's names (a tied one once)."""
        if self.executor == "local":
            yield from self.prog.named_parameters()
            return
        seen: set[int] = set()
        for s in sorted(self.workers):
            for idx, t in sorted(self.prog.stage_entries[s].items()):
                entry = self.prog.state_entry(idx)
                if entry.is_param and idx not in seen:
                    seen.add(idx)
                    yield entry.name, t  # type: ignore[misc]

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self.parameters(), set_to_none)

    # ------------------------------------------------------------------ running
    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, training: bool) -> StepData:
        return prepare_step(self, args, kwargs, target, training)  # see runtime/engine/prepare.py

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """Forward and backward over all microbatches; gradients accumulate into ``.grad``.

        Equals gradient accumulation over the same microbatches on the original model:
        the loss, every gradient and BatchNorm's running statistics (BatchNorm sees each
        microbatch, not the whole batch). Returns the loss of the whole batch (the mean
        of the microbatch losses for ``loss_reduction="mean"``), on every rank.

        Random ops (dropout) of stage ``s`` on microbatch ``m`` draw from their own stream,
        seeded from one draw of torch's default generator per step: after
        ``torch.manual_seed(k)`` the losses and gradients are bit-identical under every
        schedule, executor and checkpointing setting (a program without random ops draws
        nothing). A ``torch.autocast`` block around the call applies in every stage.
        """
        data = self._prepare(args, kwargs, target, training=True)
        self._run("train", data)
        loss = sum(data.losses.values()) if data.losses else None
        return self._share_loss(loss)

    # ------------------------------------------------------ optimizer helpers
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every stage and rank to a global norm of ``max_norm``; returns the
        total norm, as ``torch.nn.utils.clip_grad_norm_`` on the unsplit model would (every rank)."""
        from pipesplit.runtime.state.checkpoint import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type)

    def save(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Save this pipeline's model (and optimizer) state with ``torch.distributed.checkpoint``
        under the original model's names; every rank calls it. See :mod:`pipesplit.runtime.state.checkpoint`."""
        from pipesplit.runtime.state.checkpoint import save

        save(self, path, optimizer)

    def init_weights(self, model: nn.Module, init_fn: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """Initialise this process's stages of a meta-built program: ``model``'s own ``reset_parameters``,
        ``init_fn(name, tensor)`` for the rest. Every rank calls it; tied copies and replicas then agree."""
        init_weights(self.prog, model, init_fn, self.collectives.share_initialised if self.collectives else None)

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None, strict: bool = True) -> None:
        """Load a checkpoint saved by any pipeline layout (or from the plain model's state_dict); every
        rank calls it. ``strict=False`` loads the names the checkpoint and the model both have."""
        from pipesplit.runtime.state.checkpoint import load

        load(self, path, optimizer, strict)

    # -------------------------------------------------------------------- modes
    @property
    def training(self) -> bool:
        return self.prog.training

    def train(self, mode: bool = True) -> "Pipeline":
        """Training or eval mode for every stage (see :meth:`SplitProgram.train`)."""
        self.prog.train(mode)
        return self

    @torch.no_grad()
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """A forward-only pipeline pass in the current mode; outputs merged back to the full batch, on
        a mesh the whole global batch's from every replica (on the last rank; ``None`` on the others)."""
        if (self.num_microbatches * self.dp_size > 1 and self.prog.recapture is not None
                and any(r.kind == UNKNOWN for r in self.prog.output_merges)):  # every rank alike, before running
            generalise(self.prog, "joining the microbatches' outputs")  # the dynamic capture tells how
        data = self._prepare(args, kwargs, None, training=False)
        self._run("forward", data)
        if not data.outputs:
            return None
        per_mb = [data.outputs[m] for m in range(self.num_microbatches)]
        merged, weights = merge_outputs(per_mb, self.prog.output_merges, data.inputs, self.prog.inputs, self.batch_dim,
                                        lambda: output_names(self.prog.out_spec), self.dp_size)
        if self.collectives is not None:  # on a mesh: every replica's rows, in the global batch's order
            merged = self.collectives.gather_replicas(merged, self.prog.output_merges, weights)
        return pytree.tree_unflatten(merged, self.prog.out_spec)

    __call__ = forward

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """``pipe.eval()`` switches to eval mode (returns the pipeline, like ``nn.Module.eval``);
        ``pipe.eval(x)`` runs one forward-only pass in eval mode and restores the mode.

        Eval mode equals ``model.eval()``: dropout off, BatchNorm on its running statistics,
        which it does not update.
        """
        if not args and not kwargs:
            self.prog.eval()
            return self
        was_training = self.prog.training
        self.prog.eval()
        try:
            return self.forward(*args, **kwargs)
        finally:
            if was_training:
                self.prog.train()

    def _run(self, which: str, data: StepData) -> None:
        if self.compiler is not None:
            start = time.perf_counter()
            try:
                self._traced(which, data)
            finally:
                self.compiler.step_done(time.perf_counter() - start)
            return
        self._traced(which, data)

    def _traced(self, which: str, data: StepData) -> None:
        tracer = self._tracer
        if tracer is None:
            self._execute(self._plans[which], data)
            return
        tracer.begin_step(time.perf_counter())
        try:
            self._execute(self._plans[which], data)
        finally:
            tracer.end_step(time.perf_counter())

    def _execute(self, plan: Program, data: StepData) -> None:
        self.prog.sync_tied()
        workers = self.workers

        def like(msg: Any) -> Any:
            return workers[receiver_stage(msg)].like(msg, data)

        if self.collectives is not None:
            comm = RankComm(self.rank, self.transport, like)
            run_distributed_step(self.prog, self.collectives, plan[self.rank], comm, workers, data, self.timeout)
            return
        self.prog.defer_tied_gradients(True)
        if self._threads is None and len(plan) > 1:
            self._threads = RankThreads(len(plan))
        try:
            run_local_step(plan, workers, self.transport, self._threads, like, data)
        finally:
            self.prog.defer_tied_gradients(False)

    def _share_loss(self, loss: Any) -> torch.Tensor | None:
        shared = loss if self.collectives is None else self.collectives.share_loss(loss, self.schedule.stage_to_rank[-1])
        return cast(Optional[torch.Tensor], shared)
