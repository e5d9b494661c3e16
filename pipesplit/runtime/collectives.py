"""What the ranks of a distributed pipeline compute together: its layout on a pp x dp mesh, tied-weight
and data-parallel gradient sums, the step seed, the loss, and barriers that name who did not come.

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
from pipesplit.passes.split.program import SplitProgram


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
        self.tied_groups: list[tuple[Any, int]] = []
        tied = [idx for idx in sorted(self.holders) if len(self.holders[idx]) > 1 and prog.state_entry(idx).is_param]
        replicas = layout.replicas() if tied else []
        for idx in tied:  # every process creates every group, in the same order
            ranks = sorted(self.holders[idx])
            for replica in replicas:
                group = self.dist.new_group([replica[r] for r in ranks])
                if list(replica) == layout.global_ranks and layout.rank in ranks:
                    self.tied_groups.append((group, idx))
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
        """Sum each tied weight's gradient over the pipeline ranks holding it."""
        for group, idx in self.tied_groups:
            local = self.prog.held_tensor(idx)
            if local.grad is None:
                local.grad = torch.zeros_like(local)
            self.dist.all_reduce(local.grad, group=group)

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
