"""The parts of benchmarks/bench_gpu.py, one per subprocess: ``python _gpu_parts.py PART --device D --result F``.

Each part appends rows to a result as it goes and rewrites ``--result`` (JSON: ``data`` and
``markdown``) after each one, so that a part cut off by its time limit still reports what it did.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import subprocess
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
try:
    import pipesplit
except ImportError:  # a plain copy of the repository
    sys.path.insert(0, ROOT)
    import pipesplit

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

from _gpu_common import Result, ce, interleaved, mse_tree, rel, sync  # noqa: E402
from _gpu_graphs import part_cuda_graphs  # noqa: E402
from common import markdown_table  # noqa: E402
from pipesplit.models import gpt  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb_h1", "looped_bfs", "interleaved_1f1b", "zb_v", "dualpipe_v")
TWO_PER_RANK = ("looped_bfs", "interleaved_1f1b", "zb_v", "dualpipe_v")  # two stages per rank


# ---------------------------------------------------------------------------- (a) the CUDA tests
def part_tests(args: argparse.Namespace, res: Result) -> None:
    files = ["tests/test_cuda.py"] if args.smoke else ["tests/test_cuda.py", "tests/test_devices.py"] if args.quick else ["tests"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(args.limit - 10, 10))
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-25:]
    ok = proc.returncode in (0, 5)  # 5: nothing collected (no CUDA test selected)
    res.add("pytest", {"returncode": proc.returncode, "summary": tail[-1:] if tail else []},
            f"`{' '.join(cmd[1:])}` (exit {proc.returncode})\n\n```\n" + "\n".join(tail) + "\n```")
    if not ok:
        raise SystemExit(f"the CUDA tests failed (exit {proc.returncode})")


# ---------------------------------------------------------------------------- (b) exactness
def exact_models(quick: bool) -> list[tuple[str, Callable[[], torch.nn.Module], Callable[[int], Any]]]:
    sys.path.insert(0, ROOT)
    from tests.zoo import CASE_BY_NAME

    names = ["gpt_tied"] if quick == "smoke" else ["gpt_tied", "conv_bn"] if quick else ["gpt_tied", "conv_bn", "mlp", "hf_llama"]
    return [(n, CASE_BY_NAME[n].build, CASE_BY_NAME[n].inputs) for n in names]


def part_exact(args: argparse.Namespace, res: Result) -> None:
    dev, m, batch = args.device, 4, 8
    # exactness, not speed: full float32 matmuls and convolutions (TF32 rounds to 10 bits)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    stage_counts = (2,) if args.quick else (2, 4)
    rows, failures = [], 0
    for name, build, inputs in exact_models("smoke" if args.smoke else args.quick):
        try:
            torch.manual_seed(0)
            model = build().to(dev)
            (xs, kw) = inputs(batch)
        except ImportError as e:  # hf models need transformers
            rows.append([name, "-", "-", f"skipped: {e}", "", ""])
            continue
        xs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in xs)
        kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        with torch.no_grad():
            target = pytree.tree_map(lambda o: torch.randn_like(o.float()) if isinstance(o, torch.Tensor)
                                     and o.is_floating_point() else o, copy.deepcopy(model)(*xs, **kw))
        for k in stage_counts:
            prog = pipesplit.compile(model, tuple(x[: batch // m] if isinstance(x, torch.Tensor) else x for x in xs),
                                     num_stages=k, devices=[dev] * k, progress=False)
            fwd_err = max((rel(a, b) for a, b in zip(pytree.tree_leaves(prog(*xs, **kw)),
                                                      pytree.tree_leaves(copy.deepcopy(model)(*xs, **kw)))
                           if isinstance(a, torch.Tensor) and a.is_floating_point()), default=0.0)
            for sched in SCHEDULES:
                row = [name, k, sched]
                try:
                    ranks = k // 2 if sched in TWO_PER_RANK else None
                    pipe = pipesplit.Pipeline(copy.deepcopy(prog), sched, num_microbatches=m, loss_fn=mse_tree,
                                              num_ranks=ranks)
                except pipesplit.PipesplitError as e:
                    rows.append(row + [f"skipped: {str(e)[:80]}", "", ""])
                    continue
                ref = copy.deepcopy(model)
                want = torch.zeros((), device=dev)
                for i in range(m):  # gradient accumulation over the same microbatches, each loss / m
                    cut = tuple(x[i * batch // m:(i + 1) * batch // m] if isinstance(x, torch.Tensor) else x for x in xs)
                    t = pytree.tree_map(lambda v: v[i * batch // m:(i + 1) * batch // m]
                                        if isinstance(v, torch.Tensor) else v, target)
                    loss = mse_tree(ref(*cut, **kw), t) / m
                    loss.backward()
                    want = want + loss.detach()
                got = pipe.step(*xs, target=target, **kw)
                held = dict(pipe.named_parameters())
                floor = max(p.grad.double().norm().item() for p in ref.parameters() if p.grad is not None)
                grad_err = max(((held[n].grad - p.grad).double().norm().item() / max(p.grad.double().norm().item(),
                                1e-4 * floor)) for n, p in ref.named_parameters() if p.grad is not None)
                loss_err = rel(got.reshape(()), want)
                bad = max(loss_err, grad_err, fwd_err) > (2e-4 if dev.startswith("cuda") else 5e-5)
                failures += bad
                rows.append(row + ["FAIL" if bad else "ok", f"{loss_err:.1e}", f"{grad_err:.1e}"])
                res.add("rows", rows)
            rows.append([name, k, "prog(x)", "FAIL" if fwd_err > 2e-4 else "ok", f"{fwd_err:.1e}", ""])
        res.add("rows", rows)
    res.add("failures", failures, markdown_table(["model", "stages", "schedule", "result", "loss rel err",
                                                  "worst grad rel err"], rows, "lrllrr"))
    if failures:
        raise SystemExit(f"{failures} configurations differ from gradient accumulation")


# ---------------------------------------------------------------------------- (c) overhead and profile
def host_bound_gpt(quick: bool, dev: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    layers, dim, vocab, seq, batch = (2, 64, 256, 32, 4) if quick else (12, 256, 512, 64, 8)
    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq, heads=4).to(dev)
    return model, torch.randint(0, vocab, (batch, seq), device=dev), torch.randint(0, vocab, (batch, seq), device=dev)


def part_overhead(args: argparse.Namespace, res: Result) -> None:
    dev = args.device
    model, x, y = host_bound_gpt(args.quick, dev)
    pipe = pipesplit.Pipeline(pipesplit.compile(model, x, num_stages=1, devices=[dev], progress=False), "1f1b",
                              num_microbatches=1, loss_fn=ce)
    plain = copy.deepcopy(model)

    def plain_step(net: torch.nn.Module = plain) -> None:
        ce(net(x), y).backward()

    prog, stage = pipe.prog, pipe.prog.stages[0].module

    def prog_step() -> None:  # the split program in the caller's thread: no rank thread, stream or event
        ce(prog(x), y).backward()

    def stage_step() -> None:  # the stage's exported graph alone, called as a module
        ce(stage(x)[0], y).backward()

    steps: dict[str, Callable[[], Any]] = {"plain": plain_step, "pipesplit 1 stage": lambda: pipe.step(x, target=y),
                                           "prog(x) + backward": prog_step, "stage graph + backward": stage_step}
    rounds = 3 if args.smoke else 5 if args.quick else 30
    shape = f"GPT {tuple(x.shape)} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)"

    def timed(fns: dict[str, Callable[[], Any]]) -> None:
        for fn in fns.values():  # warm up (and compile)
            fn(), fn()
        med = interleaved(fns, rounds, dev)
        rows = [[k, f"{v * 1e3:.2f}", f"{v / med['plain']:.3f}"] for k, v in med.items()]
        res.add("step_s", med, f"{shape}, {rounds} interleaved rounds, medians\n\n"
                + markdown_table(["step", "ms", "x plain"], rows, "lrr"))

    timed(steps)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
    every_thread, config = all_threads()
    for label in ("pipesplit 1 stage", "plain"):
        with profile(activities=activities, record_shapes=True, **config) as prof:
            for _ in range(3):
                steps[label]()
            sync(dev)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50)
        res.add(f"profile {label}", table, f"torch.profiler, 3 steps of {label} (CPU{'+CUDA' if len(activities) > 1 else ''}"
                f" activities, {every_thread}), by self CPU time:\n\n```\n{table}\n```")
        shapes = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=30, max_shapes_column_width=60)
        res.add(f"shapes {label}", shapes, f"the same, by op and input shapes:\n\n```\n{shapes}\n```")
    # last: inductor's compile takes ~30 s on a GPU, minutes on a CPU: quick runs take dynamo alone (eager backend)
    backend = "eager" if args.quick else "inductor"
    compiled = torch.compile(copy.deepcopy(model), backend=backend)
    timed({**steps, f"torch.compile ({backend})": lambda: plain_step(compiled)})  # type: ignore[arg-type]


def all_threads() -> tuple[str, dict[str, Any]]:
    """The profiler's option to record every thread (the pipeline runs stages in threads of its own),
    where this torch has it; else only the calling thread is seen, and the report says so."""
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return "the calling thread only: this torch cannot profile all threads", {}
    return "every thread", {"experimental_config": config}


# ---------------------------------------------------------------------------- (d) predicted vs measured
def part_predict(args: argparse.Namespace, res: Result) -> None:
    dev = args.device
    layers, dim, vocab, seq, batch, m = ((1, 32, 64, 16, 8, 4) if args.smoke else (2, 64, 256, 32, 8, 4) if args.quick
                                         else (12, 768, 8192, 512, 16, 8))
    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq, heads=max(dim // 64, 2)).to(dev)
    x, y = torch.randint(0, vocab, (batch, seq), device=dev), torch.randint(0, vocab, (batch, seq), device=dev)
    rows = []
    for cost in ("flops", "profile"):
        out = pipesplit.benchmark(model, x, loss_fn=ce, target=y, num_stages=[2] if args.quick else [2, 4],
                                  schedules="1f1b", num_microbatches=m, cost=cost, devices=[dev],
                                  warmup=1 if args.quick else 2, repeats=2 if args.quick else 5, progress=False)
        for r in out.rows:
            rows.append([cost, r.num_stages, f"{r.predicted_step_s * 1e3:.1f}", f"{r.measured_step_s * 1e3:.1f}",
                         f"{r.step_ratio:.2f}",
                         " / ".join(f"{a * 1e3:.1f}" for a in r.predicted_fwd_s),
                         " / ".join(f"{a * 1e3:.1f}" for a in r.measured_fwd_s),
                         " / ".join(f"{a * 1e3:.1f}" for a in r.predicted_bwd_s),
                         " / ".join(f"{a * 1e3:.1f}" for a in r.measured_bwd_s), f"{r.balance:.2f}"])
            res.add("rows", rows)
    from pipesplit.passes.annotate.gpu_rates import gpu_slowdown
    from pipesplit.passes.annotate.rates import device_rates

    from pipesplit.bench.predict import _stage_nodes, device_share
    from pipesplit.passes.annotate.rates import largest_matmul

    one = pipesplit.compile(model, x[: batch // m], num_stages=1, devices=[dev], progress=False)
    nodes = _stage_nodes(one)[0]
    r = device_rates(dev, largest_matmul(nodes))  # what the default cost priced with
    shared = ", ".join(f"{n} streams x{gpu_slowdown(dev, n):.2f}" for n in (2, 4)) if dev.startswith("cuda") else "n/a"
    rates = (f"rates: {r.describe()}; per element (forward, backward): activation {r.activation_s[0]:.3g} / "
             f"{r.activation_s[1]:.3g} s, norm {r.norm_s[0]:.3g} / {r.norm_s[1]:.3g} s; one GPU shared by {shared} "
             f"(large multiplies); the model's device share {device_share(nodes, r, 1.0):.2f}")
    res.add("rates", rates)
    res.add("model", f"GPT {layers}x{dim}, vocab {vocab}, seq {seq}, batch {batch}, m={m}, 1f1b",
            f"GPT {layers}x{dim}, vocab {vocab}, seq {seq}, batch {batch}, {m} microbatches, 1f1b, fp32; "
            "per-stage times per microbatch (ms); goal: measured/predicted within 1.3 (flops), 1.15 (profile)\n\n"
            f"{rates}\n\n"
            + markdown_table(["cost", "stages", "predicted step ms", "measured ms", "measured/predicted",
                              "F predicted", "F measured", "B predicted", "B measured", "balance"], rows,
                             "lrrrrrrrrr"))


# ---------------------------------------------------------------------------- (e) the oracle
def part_oracle(args: argparse.Namespace, res: Result) -> None:
    from bench_oracle import oracle

    dev = args.device
    layers, dim, vocab, seq, batch = ((2, 32, 64, 16, 8) if args.smoke else (3, 64, 512, 32, 8) if args.quick
                                      else (6, 768, 8192, 256, 8))
    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq, heads=max(dim // 64, 2)).to(dev)
    x = torch.randint(0, vocab, (batch, seq), device=dev)
    found = oracle(model, x, 4, 1 if args.smoke else 2 if args.quick else 3, {"default (FLOPs)": "flops", "profile": "profile"},
                   devices=[dev, dev], clock="wall" if dev.startswith("cuda") else "cpu")
    med, best = found["median_s"], found["best"]
    rows = [[label, k, f"{med[k] * 1e3:.2f}", f"{med[k] / med[best]:.3f}"] for label, k in found["where"].items()]
    rows.append(["best measured", best, f"{med[best] * 1e3:.2f}", "1.000"])
    res.add("oracle", {k: v for k, v in found.items()},
            f"GPT {layers}x{dim}, vocab {vocab}, seq {seq}, batch {batch}, 2 stages, 4 microbatches: bottleneck stage "
            f"forward + backward; best's spread ±{found['noise'] * 100:.1f}%; goal ≤ 1.05 x best\n\n"
            + markdown_table(["planner cost", "its split", "bottleneck ms", "x best"], rows, "llrr"))


# ---------------------------------------------------------------------------- (g) compiled stages
def part_compiled(args: argparse.Namespace, res: Result) -> None:
    """Issue 25's anchors on the device: the plain model and torch.compile(model) accumulating over m
    microbatches against 2-stage pipelines, eager and compiled (zb_h1's stages as F/I/W graphs),
    and zb_h1's split backward against 1f1b's fused one."""
    dev = args.device
    layers, dim, vocab, seq, batch, m = (2, 32, 64, 16, 4, 2) if args.quick else (12, 256, 512, 128, 8, 4)
    backend = "aot_eager" if args.quick else "inductor"
    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq, heads=4).to(dev)
    x, y = torch.randint(0, vocab, (batch, seq), device=dev), torch.randint(0, vocab, (batch, seq), device=dev)
    plain, anchor = copy.deepcopy(model), torch.compile(copy.deepcopy(model), backend=backend)

    def accumulate(net: Any) -> None:
        net.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            ce(net(xs), ys).backward()

    fns: dict[str, Callable[[], Any]] = {"plain (eager)": lambda: accumulate(plain),
                                         f"torch.compile(model) ({backend})": lambda: accumulate(anchor)}
    compile_s: dict[str, float] = {}
    prog = pipesplit.compile(model, x[: batch // m], num_stages=2, devices=[dev, dev], progress=False)
    for schedule in ("1f1b", "zb_h1"):
        for compiled in (False, True):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=m, loss_fn=ce,
                                          compile={"backend": backend} if compiled else False)
            label = f"pipesplit 2 stages, {schedule}, {'compiled' if compiled else 'eager'}"

            def step(pipe: Any = pipe) -> None:
                pipe.zero_grad(set_to_none=True)
                pipe.step(x, target=y)

            start = time.perf_counter()
            step()
            sync(dev)
            compile_s[label] = time.perf_counter() - start
            fns[label] = step
    start = time.perf_counter()
    fns[f"torch.compile(model) ({backend})"]()
    compile_s[f"torch.compile(model) ({backend})"] = time.perf_counter() - start
    for fn in fns.values():
        fn()
    med = interleaved(fns, 3 if args.quick else 15, dev)
    base = med["plain (eager)"]
    rows = [[k, f"{v * 1e3:.2f}", f"{v / base:.3f}", f"{compile_s.get(k, 0.0):.1f}"] for k, v in med.items()]
    split = med["pipesplit 2 stages, zb_h1, compiled"] / med["pipesplit 2 stages, 1f1b, compiled"]
    res.add("step_s", med, f"GPT {layers} x {dim}, batch {batch} x {seq}, {m} microbatches, every stage on {dev}; "
            f"interleaved rounds, medians; zb_h1 / 1f1b compiled: {split:.3f}\n\n"
            + markdown_table(["step", "ms", "x plain", "first step s (compile)"], rows, "lrrr"))


# ---------------------------------------------------------------------------- (f) memory
def part_memory(args: argparse.Namespace, res: Result) -> None:
    from pipesplit.bench.predict import predict
    from pipesplit.schedules import resolve_schedule

    dev = args.device
    cuda = dev.startswith("cuda")
    layers, dim, vocab, seq, batch, m = ((1, 32, 64, 16, 8, 4) if args.smoke else (2, 64, 256, 32, 8, 4) if args.quick
                                         else (8, 512, 8192, 256, 16, 4))
    rows = []
    for k in (1, 2):
        torch.manual_seed(0)
        model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq, heads=max(dim // 64, 2))  # on the CPU: moved by compile
        x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
        if cuda:
            gc.collect()  # the previous stage count's program and pipeline hold cycles
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(dev)
        prog = pipesplit.compile(model, x[: batch // m], num_stages=k, devices=[dev] * k, progress=False)
        del model
        pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=m, loss_fn=ce)
        xd, yd = x.to(dev), y.to(dev)
        pipe.step(xd, target=yd)  # the first step allocates the gradients
        estimate = predict(prog, resolve_schedule("1f1b", k, None, m), "flops", batch).memory
        measured = "n/a (CPU)"
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            pipe.step(xd, target=yd)
            sync(dev)
            measured = f"{(torch.cuda.max_memory_allocated(dev) - before) / 2**20:.0f}"
        total = sum(estimate)
        ratio = f"{(float(measured) * 2**20) / total:.2f}" if cuda else ""
        rows.append([k, " / ".join(f"{e / 2**20:.0f}" for e in estimate), f"{total / 2**20:.0f}", measured, ratio])
        res.add("rows", rows)
        del pipe, prog
    res.add("table", rows, f"GPT {layers}x{dim}, vocab {vocab}, seq {seq}, batch {batch}, {m} microbatches, 1f1b, "
            "every stage on one device: the allocator's peak in the second step (above what was allocated before "
            "compile) against the sum of the stages' estimates\n\n"
            + markdown_table(["stages", "estimate per stage MiB", "estimate total MiB", "measured peak MiB",
                              "measured / estimate"], rows, "lrrrr"))


PARTS = {"tests": part_tests, "exact": part_exact, "cuda_graphs": part_cuda_graphs, "overhead": part_overhead,
         "compiled": part_compiled, "predict": part_predict, "oracle": part_oracle, "memory": part_memory}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--device", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--limit", type=float, default=600.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true", help="the smallest sizes (the test of this script)")
    args = p.parse_args()
    args.quick = args.quick or args.smoke
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    PARTS[args.part](args, Result(args.result))


if __name__ == "__main__":
    main()
