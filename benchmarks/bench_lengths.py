"""Training on batches of varying sequence length (issue 34): each batch at its own length against every
batch padded to the maximum length, tokens per second on CPU.

The same built-in GPT, split the same way, trains on the same batches of real tokens under 1F1B.
``own length`` pads each batch only to its own longest row (the program is captured once more,
with every dimension dynamic, at the first new size); ``padded to max`` pads every batch to the
longest length the model takes, as a pipeline with fixed shapes must. Both count the same real
tokens (padding is masked out of the loss); the padded run computes on the padding too.

    python benchmarks/bench_lengths.py            # ~1 minute on 2 cores
    python benchmarks/bench_lengths.py --steps 20 --max-len 256
    python benchmarks/bench_lengths.py --plan-only   # the plan across lengths alone (compile(plan_lengths=...))

The second section plans one GPT three ways, for short batches, for long ones and for the expected step
over both (``compile(..., plan_lengths={32: 0.9, 512: 0.1})``), and predicts and measures each at both lengths.
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


def plan_section(args: argparse.Namespace) -> None:
    """The plan across lengths: a split planned for short batches, one for long ones and one for the mix
    (``plan_lengths={short: w, long: 1 - w}``), each predicted and measured at both lengths."""
    from pipesplit.passes.annotate.rates import device_rates, largest_matmul
    from pipesplit.passes.plan.lengths import length_mix, steps_over_lengths
    from pipesplit.schedules import resolve_schedule

    short, long, w = args.short, args.long, args.short_weight
    torch.manual_seed(0)
    k, m, batch = args.plan_stages, args.plan_microbatches, args.plan_batch
    model = gpt(layers=args.plan_layers, dim=args.plan_dim, vocab=args.plan_vocab, seq=long, heads=4)
    tokens = torch.randint(0, args.plan_vocab, (batch, long + 1))
    example = tokens[: batch // m, :short]
    mixture = {short: w, long: 1 - w}
    emit(header("The plan across lengths: planned for short batches, long ones, or the expected step over both",
                "python benchmarks/bench_lengths.py " + " ".join(sys.argv[1:]),
                [f"GPT {args.plan_layers} x {args.plan_dim}, vocabulary {args.plan_vocab}, {k} stages, 1F1B, batch "
                 f"{batch} in {m} microbatches; lengths {short} (weight {w}) and {long} "
                 f"(weight {1 - w:.2g}); predicted: the planner's simulated step at this machine's measured rates; "
                 f"measured: median of {args.plan_repeats} steps after one"]))
    rows = []
    for label, lengths in ((f"for {short} only", [short]), (f"for {long} only", [long]), ("for the mix", mixture)):
        prog = pipesplit.compile(model, example, num_stages=k, schedule="1f1b", num_microbatches=m, dynamic_dims={"idx": 1}, plan_lengths=lengths,
                                 progress=False)
        gm = prog.captured_gm
        mix = length_mix(gm, prog.inputs, 0, mixture)
        schedule = resolve_schedule("1f1b", k, None, m)
        predicted = steps_over_lengths(gm, prog.plan.stages, mix, schedule, flops_per_s=1.0,
                                       rates=device_rates("cpu", largest_matmul(gm.graph.nodes)))
        pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=m, loss_fn=loss_fn, loss_reduction="sum")
        measured = []
        for length in (short, long):
            x, y = tokens[:, :length], tokens[:, 1:length + 1]
            times = []
            for _ in range(args.plan_repeats + 1):
                start = time.perf_counter()
                pipe.step(x, target=y)
                times.append(time.perf_counter() - start)
                pipe.zero_grad()
            measured.append(statistics.median(times[1:]))
        nodes = "/".join(str(len(s)) for s in prog.plan.stages)

        def mean(xs: list[float]) -> float:
            return w * xs[0] + (1 - w) * xs[1]

        rows.append([label, nodes, *(f"{t * 1e3:.1f}" for t in predicted), f"{mean(predicted) * 1e3:.1f}",
                     *(f"{t * 1e3:.1f}" for t in measured), f"{mean(measured) * 1e3:.1f}"])
    emit(markdown_table(["plan", "nodes per stage", f"pred {short} (ms)", f"pred {long} (ms)", "pred expected (ms)",
                         f"meas {short} (ms)", f"meas {long} (ms)", "meas expected (ms)"], rows, "llrrrrrr"))


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
    p.add_argument("--plan-only", action="store_true", help="only the plan-across-lengths section")
    p.add_argument("--short", type=int, default=32)
    p.add_argument("--long", type=int, default=512)
    p.add_argument("--short-weight", type=float, default=0.9)
    p.add_argument("--plan-layers", type=int, default=8)
    p.add_argument("--plan-stages", type=int, default=4)
    p.add_argument("--plan-microbatches", type=int, default=8)
    p.add_argument("--plan-batch", type=int, default=16)
    p.add_argument("--plan-dim", type=int, default=64)
    p.add_argument("--plan-vocab", type=int, default=2048)
    p.add_argument("--plan-repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.plan_only:
        plan_section(args)
        return
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
    plan_section(args)


if __name__ == "__main__":
    main()
