"""Running statistics (BatchNorm's) on a data-parallel mesh: every replica ends a step with what
accumulation over the global batch's microbatches, in order, gives.

A training-mode ``batch_norm`` updates ``r <- (1 - m) r + m s_k`` per microbatch ``k`` (momentum
``m``, ``s_k`` the microbatch's mean or unbiased variance), so after the ``K = dp·n`` microbatches
of a step, in order, ``r_K = D^K r_0 + sum_k D^(K-k) m s_k`` with ``D = 1 - m``: linear in each
microbatch's statistics with known weights. Each replica starts the step from zero, so it ends
with exactly its own microbatches' part ``c_d = sum_j D^(n-j) m s_(d·n+j)``; one all-reduce over
the replicas then gives ``r_K = D^K r_0 + sum_d D^((dp-1-d)·n) c_d``. A counter
(``num_batches_tracked += 1``) adds up the same way, with ``D = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pipesplit.errors import PipesplitError
from pipesplit.passes.split.program import SplitProgram

# Args as batch_norm's (instance_norm's flag is use_input_stats; its update averages each instance's
# statistics over the batch, so it is as linear in each microbatch's part as batch_norm's)
aten = torch.ops.aten
_NORMS = {aten.batch_norm.default, aten._native_batch_norm_legit.default, aten.instance_norm.default}
_RUNNING, _TRAINING, _MOMENTUM = (3, 4), 5, 6


@dataclass
class Tracked:
    """A buffer updated once per microbatch as ``r <- decay·r + (this microbatch's part)``."""

    entry: int
    decay: float  # the factor the previous value keeps per microbatch (1 for a counter)


def _counter_chain(user: Any, node: Any) -> bool:
    """``node.add_(c1).add_(c2)...`` with constants, nothing else reading any link."""
    while user.target is torch.ops.aten.add_.Tensor and user.args[0] is node and isinstance(user.args[1], (int, float)):
        if not user.users:
            return True
        if len(user.users) != 1:
            return False
        node, user = user, next(iter(user.users))
    return False


def _decay(node: Any, name: str) -> float:
    """The per-microbatch decay of the buffer read by get_attr ``node``; raises where pipesplit cannot
    split its update into each microbatch's part."""
    decay = 1.0
    for user in node.users:
        if user.target in _NORMS and any(user.args[i] is node for i in _RUNNING) \
                and user.args[_TRAINING] is True and isinstance(user.args[_MOMENTUM], (int, float)) \
                and not any(a is node for i, a in enumerate(user.args) if i not in _RUNNING):
            decay *= 1.0 - float(user.args[_MOMENTUM])
        elif len(node.users) == 1 and _counter_chain(user, node):
            pass  # a counter: every microbatch adds the same (a module called twice: add_ on add_)
        else:
            raise PipesplitError(
                f"buffer {name!r} is written in place by {user.target} (node {user.name!r}), which pipesplit cannot "
                "split into each microbatch's part, so on a mesh with data parallelism (dp > 1) the replicas "
                "could not end a step with what gradient accumulation over the global batch gives. Only "
                "BatchNorm's and InstanceNorm's running statistics (with a momentum) and counters are combined across replicas: "
                "use dp=1, keep the module in eval mode, or make the buffer a BatchNorm's."
            )
    return decay


class RunningStats:
    """The buffers of this rank's stages that a training step updates, and how to combine them."""

    def __init__(self, prog: SplitProgram, stage_to_rank: Sequence[int], rank: int):
        self.prog = prog
        self.tracked: list[Tracked] = []
        stage_of: dict[int, int] = {}
        for stage in prog.stages:  # every stage's, so that every rank refuses alike
            module = stage.modes.get(True)
            if module is None:  # captured in eval mode: nothing is updated
                continue
            decays: dict[int, float] = {}
            for node in module.graph.nodes:
                if node.op == "get_attr" and node.target in prog.mutated_targets:
                    idx = prog.target_to_entry[node.target]
                    decays[idx] = decays.get(idx, 1.0) * _decay(node, str(node.target))
            for idx, decay in decays.items():
                if stage_of.setdefault(idx, stage.index) != stage.index:
                    raise PipesplitError(
                        f"buffer {prog.state_entry(idx).name!r} is written in place by stages {stage_of[idx]} and "
                        f"{stage.index}; on a mesh with data parallelism (dp > 1) pipesplit combines running "
                        "statistics of one stage only. Keep its users in one stage (compile(..., no_split=[...])), "
                        "or use dp=1."
                    )
                if stage_to_rank[stage.index] == rank:
                    self.tracked.append(Tracked(idx, decay))

    def begin(self) -> list[torch.Tensor]:
        """Set each buffer's value aside and start it from zero; returns the values set aside."""
        saved = []
        with torch.no_grad():
            for t in self._tensors():
                saved.append(t.clone())
                t.zero_()
        return saved

    def finish(self, saved: list[torch.Tensor], num_microbatches: int, layout: Any, device: torch.device) -> None:
        """Each replica's part weighted by where its microbatches sit in the global batch, summed over
        the replicas in one all-reduce, plus the start value decayed over every microbatch."""
        tensors = self._tensors()
        if not tensors:
            return
        n, dp, d = num_microbatches, layout.dp_size, layout.dp_rank
        parts = [t.detach().to(device, torch.float64).reshape(-1) * tr.decay ** ((dp - 1 - d) * n)
                 for t, tr in zip(tensors, self.tracked)]
        flat = torch.cat(parts)
        layout.dist.all_reduce(flat, group=layout.dp_group)
        offset = 0
        with torch.no_grad():
            for t, r0, tr in zip(tensors, saved, self.tracked):
                total = flat[offset:offset + t.numel()].view(t.shape).to(t.device)
                t.copy_(r0.to(torch.float64) * tr.decay ** (dp * n) + total)
                offset += t.numel()

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Put back what :meth:`begin` set aside (a step that failed)."""
        with torch.no_grad():
            for t, r0 in zip(self._tensors(), saved):
                t.copy_(r0)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.prog.held_tensor(tr.entry) for tr in self.tracked]
