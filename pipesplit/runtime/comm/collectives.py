"""What the ranks of a distributed pipeline compute together: its layout on a pp x dp mesh, tied-weight
and data-parallel gradient sums, running statistics and outputs of the global batch, one initial value
per tensor, the step seed, the loss, and barriers that name who did not come.

A step on a ``pp × dp`` mesh is gradient accumulation over the whole global batch: the batch
is cut into ``dp × m`` microbatches, replica ``d`` runs microbatches ``d·m … d·m + m - 1`` through
its pipeline, each stage's gradients are summed over the data-parallel group (launched as soon
as the stage's last backward of the step is done, so it overlaps the rest of the schedule),
and a tied weight's gradient is summed over the pipeline ranks that hold it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence, cast

import torch

from pipesplit.errors import PipesplitError, RuntimeCommError
from pipesplit.meta import is_sparse_lookup
from pipesplit.passes.split.merges import CAT, MAX, MEAN, MIN, SUM, OutputMerge
from pipesplit.passes.split.program import SplitProgram
from pipesplit.runtime.comm.running_stats import RunningStats


_BARRIERS = [0]  # store barriers this process has entered; every rank enters them in the same order


def store_barrier(timeout: float, what: str) -> None:
    """Wait until every rank reaches this point, through the rendezvous store, for at most ``timeout``
    seconds; raise a RuntimeCommError naming the ranks that did not come.

    Unlike a collective, this never breaks off on a closed connection before it knows who is
    missing: a dead rank simply never checks in.
    """
    import time

    import torch.distributed as dist

    _BARRIERS[0] += 1
    me, world = dist.get_rank(), dist.get_world_size()
    keys = [f"pipesplit/barrier/{_BARRIERS[0]}/{r}" for r in range(world)]
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(keys[me], "1")
        deadline = time.monotonic() + timeout
        missing = list(range(world))
        while True:
            missing = [r for r in missing if not store.check([keys[r]])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    except Exception as e:  # the store's host (rank 0) is gone
        raise RuntimeCommError(
            f"rank {me} lost the rendezvous store {what} ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
            "rank 0, which hosts it, died."
        ) from e
    if missing:
        raise RuntimeCommError(
            f"rank {me} waited {timeout:.0f}s {what} for rank(s) {missing}, which never came: they died or are "
            "stuck. Raise timeout= if they are just slow."
        )


class Layout:
    """Where this process sits: its pipeline rank and group, its replica and data-parallel group."""

    def __init__(self, mesh: Any = None, pp_group: Any = None, dp_group: Any = None):
        import torch.distributed as dist

        self.dist = dist
        if mesh is not None:
            names = tuple(mesh.mesh_dim_names or ())
            if "pp" not in names:
                raise PipesplitError(
                    f"the device mesh has dimensions {names}; name the pipeline dimension 'pp' (and the "
                    "data-parallel one 'dp'): init_device_mesh('cpu', (pp, dp), mesh_dim_names=('pp', 'dp'))."
                )
            pp_group = mesh.get_group("pp")
            dp_group = mesh.get_group("dp") if "dp" in names else None
        self.pp_group = pp_group if pp_group is not None else dist.group.WORLD
        self.dp_group = dp_group
        self.pp_size = dist.get_world_size(self.pp_group)
        self.rank = dist.get_rank(self.pp_group)  # this process's rank in the schedule
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.global_ranks = [dist.get_global_rank(cast(Any, self.pp_group), r) for r in range(self.pp_size)]

    def replicas(self) -> list[list[int]]:
        """The global ranks of every replica's pipeline, in a fixed order (every process agrees)."""
        if self.dp_size == 1 and self.pp_size == self.dist.get_world_size():
            return [self.global_ranks]
        gathered: list[Any] = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(gathered, self.global_ranks)
        return [list(g) for g in sorted({tuple(g) for g in gathered})]


def _refuse_sparse_gradients(prog: SplitProgram) -> None:
    """Replicas sum gradients in dense buckets: a sparse one (``nn.Embedding(sparse=True)``) has no place
    there, and a replica's error would leave the others waiting, so refuse it on every rank at once."""
    for stage in prog.stages:
        for node in stage.module.graph.nodes if stage.module is not None else ():
            if is_sparse_lookup(node):
                raise PipesplitError(
                    f"stage {stage.index} looks up a sparse embedding (nn.Embedding(sparse=True), node {node.name!r}); "
                    "on a mesh with data parallelism (dp > 1) pipesplit sums gradients across replicas in dense "
                    "buckets, which cannot hold a sparse gradient. Use nn.Embedding(sparse=False) or dp=1."
                )


class StepCollectives:
    """The collectives of a training step on the distributed executor."""

    def __init__(self, prog: SplitProgram, layout: Layout, stage_to_rank: Sequence[int], device: torch.device):
        self.prog, self.layout, self.device = prog, layout, device
        self.dist = layout.dist
        self.holders: dict[int, list[int]] = {}  # state index -> pipeline ranks holding it
        for s, entries in enumerate(prog.stage_entries):
            for idx in entries:
                ranks = self.holders.setdefault(idx, [])
                if stage_to_rank[s] not in ranks:
                    ranks.append(stage_to_rank[s])
        # every entry several pipeline ranks hold: (this replica's group of its holders, entry, their global ranks)
        self.shared: list[tuple[Any, int, list[int]]] = []
        multi = [idx for idx in sorted(self.holders) if len(self.holders[idx]) > 1]
        replicas = layout.replicas() if multi else []
        mine: dict[tuple[int, ...], Any] = {}  # one group per set of holders
        for idx in multi:  # every process creates every group, in the same order
            holding = tuple(sorted(self.holders[idx]))
            if holding not in mine:
                for replica in replicas:
                    group = self.dist.new_group([replica[r] for r in holding])
                    if list(replica) == layout.global_ranks:
                        mine[holding] = group
            if layout.rank in holding:
                self.shared.append((mine[holding], idx, [layout.global_ranks[r] for r in holding]))
        self.tied_groups = [(group, idx) for group, idx, _ in self.shared if prog.state_entry(idx).is_param]
        self.stats = RunningStats(prog, stage_to_rank, layout.rank) if layout.dp_size > 1 else None
        if layout.dp_size > 1:
            _refuse_sparse_gradients(prog)
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    # -------------------------------------------------------------- gradients
    def counts_here(self, idx: int) -> bool:
        """Whether this rank counts entry ``idx`` in global sums (a tied weight on its first rank)."""
        return idx not in self.holders or min(self.holders[idx]) == self.layout.rank

    def summed_params(self) -> list[torch.Tensor]:
        """The parameters whose step gradient a collective sums: all of them with data parallelism,
        else the tied ones (the others accumulate in place, as on one process)."""
        if self.layout.dp_group is not None:
            return [p for _, p in self.prog.held_params()]
        return [self.prog.held_tensor(idx) for _, idx in self.tied_groups]

    def stage_done(self, params: Sequence[torch.Tensor]) -> None:
        """A stage's gradients of this step are final: start summing them over the replicas."""
        if self.layout.dp_group is None:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one bucket per stage
        work = self.dist.all_reduce(flat, group=self.layout.dp_group, async_op=True)
        self._pending.append((work, flat, grads))

    def finish_data_parallel(self, timeout: float) -> None:
        """Wait for the replicas' sums and write them back into the gradients."""
        pending, self._pending = self._pending, []
        for work, flat, grads in pending:
            error: Exception | None
            try:
                ok = work.wait(timeout=timedelta(seconds=timeout))
            except Exception as e:  # gloo raises on timeouts and closed connections
                ok, error = False, e
            else:
                error = None
            if ok is False:
                peers = self.dist.get_process_group_ranks(self.layout.dp_group)
                raise RuntimeCommError(
                    f"rank {self.dist.get_rank()} gave up summing gradients over its data-parallel group (global "
                    f"ranks {peers}) after at most {timeout:.0f}s"
                    + (f": {str(error).splitlines()[0]}" if error is not None and str(error) else "")
                    + ". One of those replicas died or never finished its step; raise timeout= if it is just slow."
                ) from error
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def reduce_tied(self) -> None:
        """Sum each tied weight's gradient over the pipeline ranks holding it. Where no holder has a
        gradient (frozen, or unused this step) it stays None, as on one process: a zero gradient would
        still move it under weight decay."""
        for group, idx in self.tied_groups:
            local = self.prog.held_tensor(idx)
            # over the holders: whether any has a gradient, any is frozen, any trains
            dense = local.grad is not None and not local.grad.is_sparse
            flags = torch.tensor([local.grad is not None, not local.requires_grad, local.requires_grad, dense],
                                 dtype=torch.int32, device=self.device)
            self.dist.all_reduce(flags, op=self.dist.ReduceOp.MAX, group=group)
            any_grad, any_frozen, any_trains, any_dense = (bool(f) for f in flags.tolist())
            if any_frozen and any_trains:
                raise PipesplitError(
                    f"the tied weight {self.prog.state_entry(idx).name!r} is frozen (requires_grad=False) on some of "
                    f"the pipeline ranks holding it and trains on others; it is one tensor: set requires_grad the "
                    "same on every rank."
                )
            if not any_grad:
                continue
            if local.grad is None:
                local.grad = torch.zeros_like(local)
            elif any_dense and local.grad.is_sparse:  # a sparse embedding's plus its tied head's: dense, as autograd sums them
                local.grad = local.grad.to_dense()
            self.dist.all_reduce(local.grad, group=group)

    # ------------------------------------------------------------ initial state
    def share_initialised(self) -> None:
        """After each process initialised its own tensors (at construction, and after init_weights): an
        entry several pipeline ranks hold takes the values of the lowest of them that initialised it,
        and every replica takes replica 0's, so a tied weight stays one tensor and the replicas start
        equal (as DDP's broadcast at construction). Entries without values yet are left to init."""
        with torch.no_grad():  # in place on parameters
            self._share_initialised()
        self.prog.refresh_tied()

    def _share_initialised(self) -> None:
        uninit = self.prog.uninitialised
        me = self.dist.get_rank()
        for group, idx, ranks in self.shared:
            src = torch.tensor([len(ranks) if idx in uninit else ranks.index(me)], device=self.device)
            self.dist.all_reduce(src, op=self.dist.ReduceOp.MIN, group=group)
            if int(src) < len(ranks):  # else no holder has values: check_initialised names it
                self.dist.broadcast(self.prog.held_tensor(idx), src=ranks[int(src)], group=group)
                uninit.discard(idx)
        if self.layout.dp_group is not None:
            first = self.dist.get_global_rank(self.layout.dp_group, 0)
            for idx, t in self.prog.held_items():  # every replica holds the same entries, initialised alike
                if idx not in uninit:
                    self.dist.broadcast(t, src=first, group=self.layout.dp_group)

    # --------------------------------------------------------- running statistics
    def begin_statistics(self) -> list[torch.Tensor] | None:
        """Before a step in training mode on a data-parallel mesh: set the running statistics aside."""
        return self.stats.begin() if self.stats is not None and self.prog.training else None

    def finish_statistics(self, saved: list[torch.Tensor] | None, num_microbatches: int) -> None:
        """After it: every replica takes what accumulation over the global batch's microbatches gives."""
        if saved is not None and self.stats is not None:
            self.stats.finish(saved, num_microbatches, self.layout, self.device)

    def restore_statistics(self, saved: list[torch.Tensor] | None) -> None:
        if saved is not None and self.stats is not None:
            self.stats.restore(saved)

    # ---------------------------------------------------------------- outputs
    def gather_replicas(self, merged: list[Any], merges: Sequence[OutputMerge],
                        weights: Sequence[torch.Tensor | None]) -> list[Any]:
        """This replica's merged outputs -> the whole global batch's, on every replica, by each output's
        rule (:mod:`pipesplit.passes.split.merges`): batched outputs concatenated along their batch
        dimension in replica order (the order the global batch was split in), sums summed, maxima and
        minima reduced, means weighted by each replica's ``weights`` (samples or labels counted), the
        rest taken from this replica."""
        if self.layout.dp_group is None:
            return merged
        ops = {SUM: self.dist.ReduceOp.SUM, MAX: self.dist.ReduceOp.MAX, MIN: self.dist.ReduceOp.MIN}
        out = []
        for value, rule, weight in zip(merged, merges, weights):
            if not isinstance(value, torch.Tensor) or rule.kind not in (CAT, SUM, MAX, MIN, MEAN):
                out.append(value)
            elif rule.kind == CAT:
                parts = [torch.empty_like(value) for _ in range(self.layout.dp_size)]  # equal shares
                self.dist.all_gather(parts, value.contiguous(), group=self.layout.dp_group)
                out.append(torch.cat(parts, dim=rule.dim))  # type: ignore[arg-type]
            elif rule.kind == MEAN:
                assert weight is not None
                both = torch.cat([(value.to(torch.float64) * weight).reshape(-1), weight.reshape(1)])
                if weight == 0:
                    both[:-1] = 0  # every label ignored here: this replica's mean is 0/0 and adds nothing
                self.dist.all_reduce(both, group=self.layout.dp_group)
                out.append((both[:-1] / both[-1]).reshape(value.shape).to(value.dtype))
            else:
                total = value.detach().clone()
                self.dist.all_reduce(total, op=ops[rule.kind], group=self.layout.dp_group)
                out.append(total)
        return out

    # ------------------------------------------------------------------ values
    def step_seed(self, seed: int) -> int:
        """Every process uses global rank 0's seed."""
        buf = torch.tensor(seed, dtype=torch.int64, device=self.device)
        self.dist.broadcast(buf, src=0)
        return int(buf.item())

    def share_loss(self, loss: Any, last_rank: int) -> torch.Tensor:
        """The step's loss on every process: the last pipeline rank's, summed over the replicas."""
        buf = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.layout.rank == last_rank and loss is not None:
            buf.fill_(float(loss))
        self.dist.broadcast(buf, src=self.layout.global_ranks[last_rank], group=self.layout.pp_group)
        if self.layout.dp_group is not None:
            self.dist.all_reduce(buf, group=self.layout.dp_group)
        return buf
