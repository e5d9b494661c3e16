"""Training semantics under real torchrun (gloo, 2 ranks): accumulation with tied weights,
dropout bit-identical to the local executor, in-place ops at cuts."""

from __future__ import annotations

import re

import pytest

from tests.launch import torchrun
pytestmark = pytest.mark.slow


def test_training_semantics_hold_across_processes():
    result = torchrun("train_check.py", 2, "--schedule", "1f1b,zb_h1,zb_v", "--timeout", "60")
    for schedule in ("1f1b", "zb_h1", "zb_v"):
        for what in ("accumulation over 2 steps, tied", "dropout bit-identical to the local executor",
                     "in-place ResNet"):
            ranks = set(re.findall(rf"rank (\d): ok \({re.escape(what)}[^)]*\b{schedule}\b", result.stdout))
            assert ranks == {"0", "1"}, f"{what} ({schedule}) not confirmed by both ranks:\n{result.stdout}"


def test_dropout_on_a_transposed_activation_received_over_a_cut_is_bit_identical_to_local():
    """A random op on a stream draws over its inputs made contiguous (a dropout fills its mask in memory
    order, and a transport delivers a transposed activation contiguous)."""
    result = torchrun("train_check.py", 2, "--schedule", "1f1b", "--only", "dropout_layout", "--timeout", "60")
    for model in ("TransposedDropout", "NormTransposedDropout"):
        ranks = set(re.findall(rf"rank (\d): ok \(dropout on a transposed activation[^)]*\b{model}\)", result.stdout))
        assert ranks == {"0", "1"}, result.stdout


def test_a_buffer_written_on_one_rank_and_read_on_another_is_refused():
    """BatchNorm's running_var updated by stage 0 and read by stage 1 on another rank: that rank's copy was
    never written, so the loss was off at any number of microbatches (one microbatch: the local executor
    shares the buffer and is exact, so only torchrun refuses)."""
    result = torchrun("train_check.py", 2, "--schedule", "1f1b", "--only", "buffer_across_ranks", "--timeout", "60")
    assert set(re.findall(r"rank (\d): ok \(a buffer used across ranks refused", result.stdout)) == {"0", "1"}, \
        result.stdout


def test_a_partial_head_that_writes_its_received_input_in_place_trains_exactly_across_processes():
    """Stage 1 recomputes only its head, a relu_ on the GroupNorm output it receives transposed: its backward
    raised autograd's "modified by an inplace operation" on rank 1 (the fuzzer's torchrun leg, seed 23 draw 73)
    until 4b02790 made the head's clones of what it writes inside what recomputes."""
    result = torchrun("train_check.py", 2, "--schedule", "1f1b,looped_bfs", "--only", "partial_inplace_head",
                      "--timeout", "60")
    for schedule in ("1f1b", "looped_bfs"):
        ranks = set(re.findall(rf"rank (\d): ok \(a partial head that writes its received input in place, {schedule}\)",
                               result.stdout))
        assert ranks == {"0", "1"}, result.stdout


def test_lengths_that_change_train_exactly_across_processes():
    """A GPT and a tiny Llama compiled at length 32 step at 32, 17, 48, 64, 17 on 2 ranks (1f1b, and
    zb_v: two stages a rank), then the GPT with compiled stages; every rank's gradients equal
    accumulation, and the last rank's pipe(x) in eval equals the model at length 40 (tests/lengths_check.py)."""
    result = torchrun("lengths_check.py", 2, "--schedule", "1f1b,zb_v", "--compile", "aot_eager", "--timeout", "120")
    for what in ("gpt, 1f1b", "gpt, zb_v", "hf_llama, 1f1b", "hf_llama, zb_v", "gpt, 1f1b, compiled"):
        ranks = set(re.findall(rf"rank (\d): ok \(lengths {re.escape(what)}\)", result.stdout))
        assert ranks == {"0", "1"}, f"lengths ({what}) not confirmed by both ranks:\n{result.stdout}"
