"""Which buffers a data-parallel step combines across replicas, and with what decay per microbatch
(pipesplit.runtime.comm.running_stats; the 4-rank checks are in test_dp_mesh)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit.runtime.comm.running_stats import RunningStats
from tests.training import check_training, dot_loss


class NormTwice(nn.Module):
    """One BatchNorm applied twice: its counter is ``add_`` on ``add_``, its statistics decay twice."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.bn(self.l1(self.bn(x))))


def _instance_norm() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (2, 4)), nn.InstanceNorm1d(2, track_running_stats=True),
                         nn.Flatten(), nn.Linear(8, 8))


def _tracked(model: nn.Module) -> dict[str, float]:
    prog = pipesplit.compile(model.train(), torch.randn(8, 8), num_stages=1, progress=False)
    return {prog.state_entry(t.entry).name: t.decay for t in RunningStats(prog, [0], 0).tracked}


def test_a_batchnorm_applied_twice_is_combined_not_refused():
    """A review of defect 7's fix: the chained counter (add_ on add_) was refused on a mesh."""
    assert _tracked(NormTwice()) == pytest.approx(
        {"bn.num_batches_tracked": 1.0, "bn.running_mean": 0.81, "bn.running_var": 0.81})


def test_instance_norm_running_statistics_are_combined_across_replicas():
    """A review of defect 7's fix: InstanceNorm(track_running_stats=True) was not known to write its
    statistics, so on a mesh every replica silently kept its own microbatches' part."""
    assert _tracked(_instance_norm()) == pytest.approx({"2.running_mean": 0.9, "2.running_var": 0.9})


def test_instance_norm_running_statistics_train_as_accumulation():
    torch.manual_seed(0)
    model = _instance_norm()
    prog = pipesplit.compile(model, torch.randn(8, 8), num_stages=2, progress=False)
    assert {"2.running_mean", "2.running_var"} <= set(prog.mutated_targets) | {
        prog.state_entry(prog.target_to_entry[t]).name for t in prog.mutated_targets}
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum")
    check_training(model, pipe, [((torch.randn(8, 8),), {})], m=4)


def test_each_replicas_part_is_weighted_by_where_its_microbatches_sit():
    """Two replicas (dp=2) of two microbatches each, their all-reduce played in one process: each part is
    decayed by the microbatches that follow it in the global batch (replica 0's by D^2, replica 1's by 1), so
    the running statistics end as a plain BatchNorm's over the four microbatches in order. Weighting the
    replicas in the wrong order (mutant M22 of tests/fuzz/mutants.py) leaves running_mean 30% off here."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=0.3), nn.Linear(8, 8)).double()
    model[1].running_mean.uniform_(-1, 1)
    batches = [torch.randn(4, 8, dtype=torch.float64) * (k + 1) + k for k in range(4)]  # 4 microbatches, in order
    ref = __import__("copy").deepcopy(model).train()
    with torch.no_grad():
        for x in batches:
            ref(x)

    def replica(d: int, others: list[torch.Tensor]) -> tuple[nn.Module, list[torch.Tensor]]:
        prog = pipesplit.compile(__import__("copy").deepcopy(model), batches[0], num_stages=1, progress=False).train()
        stats, sent = RunningStats(prog, [0], 0), []

        def all_reduce(flat: torch.Tensor, group: object = None) -> None:
            sent.append(flat.clone())
            for other in others:
                flat += other
        saved = stats.begin()
        with torch.no_grad():
            for x in batches[2 * d:2 * d + 2]:
                prog(x)
        stats.finish(saved, 2, SimpleNamespace(dp_size=2, dp_rank=d, dist=SimpleNamespace(all_reduce=all_reduce),
                                               dp_group=None), torch.device("cpu"))
        return prog, sent

    parts = [replica(d, [])[1][0] for d in range(2)]  # what each replica hands the all-reduce
    for d in range(2):
        prog, _ = replica(d, [parts[1 - d]])
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            got = prog.state_dict()[name]
            want = ref.state_dict()[name]
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert err < 1e-12, f"replica {d}: {name} {err:.2g} off"
