"""Data parallelism on a 2 (dp) x 2 (pp) mesh under real torchrun (gloo, 4 ranks): what every replica
holds and returns equals the plain model trained by accumulation over the global batch (issue 22)."""

from __future__ import annotations

import re

import pytest

from tests.launch import torchrun

pytestmark = pytest.mark.slow


def _check(name: str) -> None:
    result = torchrun("dp_check.py", 4, "--check", name, timeout=300)
    assert set(re.findall(rf"rank (\d): ok {name}", result.stdout)) == {"0", "1", "2", "3"}, result.stdout


def test_meta_init_weights_keeps_tied_weights_one_tensor_and_replicas_equal():
    """#3: the first and last pipeline rank reset their own copy of the tied embedding/head from
    different RNG positions, and replicas seeded apart started apart."""
    _check("tied_init")


def test_a_frozen_tied_weight_stays_put_under_weight_decay():
    """#5: reduce_tied gave a frozen tied weight a zero gradient, which AdamW's weight decay applies."""
    _check("frozen_tied")


def test_batchnorm_statistics_equal_accumulation_over_the_global_batch_on_every_replica():
    """#7: each replica kept the statistics of its own microbatches only, and a save kept one replica's."""
    _check("bn_stats")


def test_a_buffer_that_cannot_be_combined_across_replicas_is_refused_on_a_mesh():
    """#7: where the replicas' statistics cannot be made exact, the Pipeline refuses at construction."""
    _check("bn_refused")


def test_forward_on_a_mesh_returns_the_whole_global_batch():
    """#8: pipe(x) and pipe.eval(x) returned this replica's rows only."""
    _check("gather")


def test_batches_of_changing_length_train_exactly_on_a_mesh():
    """Issue 34 on a 2 x 2 mesh: a program compiled at length 32 steps at 32, 17 and 48, each step
    equal to gradient accumulation over the global batch (1f1b, and zb_v's split backward)."""
    _check("lengths")
