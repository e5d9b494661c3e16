"""Training on batches of varying sequence length (issue 34): each batch at its own length against every
batch padded to the maximum length, tokens per second on CPU.

The same built-in GPT, split the same way, trains on the same batches of real tokens under 1F1B.
``own length`` pads each batch only to its own longest row (the program is captured once more,
with every dimension dynamic, at the first new size); ``padded to max`` pads every batch to the
longest length the model takes, as a pipeline with fixed shapes must. Both count the same real
tokens (padding is masked out of the loss); the padded run computes on the padding too.

    python benchmarks/bench_lengths.py            # ~1 minute on 2 cores
    python benchmarks/bench_lengths.py --steps 20 --max-len 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, markdown_table  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.models import gpt  # noqa: E402

PAD = -100  # labels of padding: cross_entropy ignores them


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=PAD, reduction="sum")


def batches(steps: int, batch: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Per step, the row lengths of one batch: documents of 8..max_len tokens, skewed short as in fine-tuning."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = (8 + (torch.rand(batch, generator=g) ** 2) * (max_len - 8)).long().tolist()
        out.append(lengths)
    return out


def padded(lengths: list[int], width: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels, each row padded to ``width`` (padding's labels ignored)."""
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(1, vocab, (n + 1,), generator=g)
        ids[i, :n], labels[i, :n] = row[:-1], row[1:]
    return ids, labels


def run(mode: str, plan: list[list[int]], args: argparse.Namespace) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    model = gpt(layers=args.layers, dim=args.dim, vocab=args.vocab, seq=args.max_len, heads=4)
    example = torch.randint(0, args.vocab, (args.batch // args.microbatches, args.max_len))
    prog = pipesplit.compile(model, example, num_stages=args.stages, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=args.microbatches, loss_fn=loss_fn, loss_reduction="sum")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    width = (lambda lengths: max(lengths)) if mode == "own" else (lambda lengths: args.max_len)
    for lengths in ([args.max_len] * args.batch, [args.max_len // 2] * args.batch):  # warm-up (and the capture)
        ids, labels = padded(lengths, width(lengths), args.vocab, g)
        pipe.step(ids, target=labels)
        opt.zero_grad()
    times = []
    for lengths in plan:
        ids, labels = padded(lengths, width(lengths), args.vocab, g)
        start = time.perf_counter()
        pipe.step(ids, target=labels)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return sum(sum(lengths) for lengths in plan) / sum(times), times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    plan = batches(args.steps, args.batch, args.max_len, args.vocab, args.seed)
    mean_width = statistics.mean(max(lengths) for lengths in plan)
    emit(header("Varying sequence lengths: each batch at its own length vs padded to the maximum",
                "python benchmarks/bench_lengths.py " + " ".join(sys.argv[1:]),
                [f"GPT {args.layers} x {args.dim}, {args.stages} stages, 1F1B, batch {args.batch} in "
                 f"{args.microbatches} microbatches, {args.steps} steps; row lengths 8..{args.max_len} skewed short "
                 f"(mean batch width {mean_width:.0f}); tokens/s counts real tokens only; median step after a "
                 "warm-up that includes the one re-capture"]))
    rows, rates = [], {}
    for mode, label in (("max", f"padded to max ({args.max_len})"), ("own", "own length (dynamic)")):
        rate, times = run(mode, plan, args)
        rates[mode] = rate
        rows.append([label, f"{rate:,.0f}", f"{statistics.median(times) * 1e3:.0f}", f"{sum(times):.2f}"])
    rows[-1].append(f"{rates['own'] / rates['max']:.2f}x")
    rows[0].append("1.00x")
    emit(markdown_table(["batches", "tokens/s", "median step (ms)", "total (s)", "speed-up"], rows, "lrrrr"))


if __name__ == "__main__":
    main()
