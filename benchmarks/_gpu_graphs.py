"""bench_gpu.py's part ``cuda_graphs`` (issue 25, item 3): compiled stages replayed as CUDA graph
slots (``compile={"mode": "reduce-overhead"}``) against compiled stages without them, the plain
model and ``torch.compile(model)`` with and without its own CUDA graphs, on the host-bound GPT.

Each pipeline's loss after its first step is checked against the plain model's (the "loss rel.
diff." column) and its slots are counted (captures, replays, stages without graphs) before
anything is timed. On a CPU (``--device cpu``, the script's own test) the replays are emulated
(:class:`pipesplit.runtime.graphs.cuda_graphs.EmulatedCapture`): the code path runs, the times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from typing import Any, Callable

import torch

from _gpu_common import Result, ce, interleaved, sync  # noqa: E402
from common import markdown_table  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from pipesplit.runtime.graphs import cuda_graphs  # noqa: E402


def part_cuda_graphs(args: argparse.Namespace, res: Result) -> None:
    dev, begin = args.device, time.perf_counter()
    if not dev.startswith("cuda"):
        cuda_graphs.backend_for = lambda device: cuda_graphs.EmulatedCapture()  # type: ignore[assignment]
    layers, dim, vocab, seq, batch, m = (2, 32, 64, 16, 4, 2) if args.quick else (12, 256, 512, 128, 8, 4)
    backend = "aot_eager" if args.quick else "inductor"
    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq, heads=4).to(dev)
    x, y = torch.randint(0, vocab, (batch, seq), device=dev), torch.randint(0, vocab, (batch, seq), device=dev)

    def accumulate(net: Any, mark: bool = False) -> torch.Tensor:
        if mark:  # torch's cudagraph trees: a new step's outputs may overwrite the last one's
            torch.compiler.cudagraph_mark_step_begin()
        net.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            loss = ce(net(xs), ys)
            loss.backward()
            total += loss.detach()
        return total

    plain = copy.deepcopy(model)
    want = accumulate(plain).item()
    fns: dict[str, Callable[[], Any]] = {"plain (eager)": lambda: accumulate(plain)}
    first_s: dict[str, float] = {}
    rows_info: dict[str, list[Any]] = {}

    def add(label: str, fn: Callable[[], Any]) -> None:
        if time.perf_counter() - begin > 0.5 * args.limit:  # leave the other half for the timing rounds
            rows_info[label] = ["skipped: out of time", "", ""]
            return
        start = time.perf_counter()
        loss = fn()
        sync(dev)
        first_s[label] = time.perf_counter() - start
        fns[label] = fn
        rows_info.setdefault(label, ["", "", ""])[0] = f"{abs(float(loss) - want) / abs(want):.1e}"

    anchor = torch.compile(copy.deepcopy(model), backend=backend)
    add(f"torch.compile(model) ({backend})", lambda: accumulate(anchor))
    if dev.startswith("cuda"):
        graphed = torch.compile(copy.deepcopy(model), backend=backend, mode="reduce-overhead")
        add(f"torch.compile(model, mode='reduce-overhead') ({backend})", lambda: accumulate(graphed, mark=True))
    progs = {k: pipesplit.compile(model, x[: batch // m], num_stages=k, devices=[dev] * k, progress=False)
             for k in (1, 2)}
    for stages, schedule in ((1, "1f1b"), (2, "1f1b"), (2, "zb_h1")):
        for graphs in (True, False):
            options = {"backend": backend, **({"mode": "reduce-overhead"} if graphs else {})}
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                pipe = pipesplit.Pipeline(progs[stages], schedule, num_microbatches=m, loss_fn=ce, compile=options)
            label = f"pipesplit {stages} stage{'s' if stages > 1 else ''}, {schedule}, compiled" + \
                (" + CUDA graphs" if graphs else "")

            def step(pipe: Any = pipe) -> torch.Tensor:
                pipe.zero_grad(set_to_none=True)
                return pipe.step(x, target=y) * m  # the mean over microbatches -> their sum, as accumulate's

            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                add(label, step)
            if graphs and label in fns:
                counts = [(len(s.slots), s.captures) for w in pipe.workers.values() if w.explicit is not None
                          for s in w.explicit.slots.values() if s is not None]
                rows_info[label][1] = " / ".join(f"{n} slots, {c} captures" for n, c in counts) or "none"
                rows_info[label][2] = "; ".join(sorted({str(w.message)[:120] for w in said
                                                       if "pipesplit" in str(w.message)})) or "-"
    for fn in fns.values():
        fn()
    med = interleaved(fns, 3 if args.quick else 20, dev)
    base = med["plain (eager)"]
    rows = [[k, f"{v * 1e3:.2f}", f"{v / base:.3f}", f"{first_s.get(k, 0.0):.1f}", *rows_info.get(k, ["0", "", ""])]
            for k, v in med.items()]
    rows += [[k, "-", "-", "-", *v] for k, v in rows_info.items() if k not in med]
    res.add("step_s", med, f"GPT {layers} x {dim}, batch {batch} x {seq}, {m} microbatches, every stage on {dev}"
            f"{'' if dev.startswith('cuda') else ' (replays EMULATED: times mean nothing)'}; interleaved rounds, "
            "medians\n\n" + markdown_table(["step", "ms", "x plain", "first step s", "loss rel. diff.",
                                            "CUDA graph slots", "warnings"], rows, "lrrrrll"))
