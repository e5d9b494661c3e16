"""Run under torchrun (gloo, CPU): one split, one schedule, two ways of syncing the data-parallel gradients.

Launched by ``benchmarks/bench_dp_sync.py``. Every rank builds the same model (same seed) and
compiles the same ``pp``-stage split twice, on a ``dp × pp`` DeviceMesh:

- ``allreduce``: ``pipesplit.Pipeline(..., mesh=mesh)`` as shipped: each stage's gradients
  summed over the dp group in one bucket, launched as soon as the stage's last backward of
  the step is done, waited for at the end of the step.
- ``fsdp2``: the same Pipeline with pipesplit's dp sum switched off (the stage workers'
  ``on_gradients`` hook replaced) and ``torch.distributed.fsdp.fully_shard`` applied to each
  of the rank's stage modules (the GraphModules) on the ``dp`` sub-mesh, with
  ``reshard_after_forward=False`` (one all-gather per step, as torchtitan does under pipeline
  parallelism), ``set_requires_gradient_sync(False)`` / ``set_reshard_after_backward(False)``
  for every backward, and the reduce-scatter issued from the same hook at the same point
  (the stage's last backward of the step), as ``torch.distributed.pipelining``'s
  ``PipelineStage.perform_reduce_grad`` does. Gradients are summed, not averaged
  (``set_gradient_divide_factor(1.0)``): pipesplit's loss is already scaled by 1 / (dp × m).

Two things pipesplit's worker needs for FSDP2 that a plain ``fully_shard`` does not give it
(see ``fsdp2_pipeline``): its backward names the stage's parameters (``autograd.backward(...,
inputs=leaves + params)``) and the split backward's weight graph holds them, both captured
when the Pipeline was built; FSDP2 swaps in other parameter objects (sharded DTensors, and
unsharded ones during the step), so without pointing the worker at FSDP's unsharded
parameters every gradient silently stays None (``--no-redirect`` shows it).

First a correctness phase (fresh models, a few AdamW steps, loss and every gradient against
the plain model accumulating the global batch), then timing (one step of each variant per
round, alternating which goes first; each step = zero_grad + pipeline step + gradient
sync + AdamW step, timed on rank 0 between two barriers), then one profiled step of each for
memory. Rank 0 prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pipesplit  # noqa: E402
from _torch_vs_pipesplit_worker import ResidualMLP, untied_gpt  # noqa: E402

VARIANTS = ("allreduce", "fsdp2")


def build(name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Callable[[Any, Any], torch.Tensor], str]:
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        depth, width, hidden = 8, 256, 1024
        model = ResidualMLP(depth, width, hidden)
        x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
        return model, x, y, lambda o, t: F.mse_loss(o, t), (
            f"residual MLP, {depth} blocks, width {width}, hidden {hidden}, global batch {batch}, MSE")
    if name == "gpt":
        layers, dim, vocab, seq = 4, 128, 2048, 32
        model = untied_gpt(layers, dim, vocab, seq)
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        return model, x, y, lambda o, t: F.cross_entropy(o.reshape(-1, o.shape[-1]), t.reshape(-1)), (
            f"GPT without weight tying, {layers} blocks, dim {dim}, vocab {vocab}, seq {seq}, global batch {batch}")
    raise SystemExit(f"unknown model {name!r}")


class Variant:
    """A pipeline, its optimizer, and how one training step runs; ``named_grads`` gives full gradients."""

    def __init__(self, kind: str, model: torch.nn.Module, example: torch.Tensor, plan: Any, args: Any,
                 mesh: Any, loss_fn: Any, redirect: bool = True):
        self.kind = kind
        self.phases: list[tuple[float, float]] = []
        pp = mesh["pp"].size()
        prog = pipesplit.compile(model, example, num_stages=pp, plan=plan, progress=False)
        self.pipe = pipesplit.Pipeline(prog, args.schedule, num_microbatches=args.microbatches, loss_fn=loss_fn,
                                       mesh=mesh, timeout=120)
        self.mods: list[Any] = []
        if kind == "allreduce":
            self.opt = torch.optim.AdamW(self.pipe.parameters(), lr=1e-3)
            return
        # fsdp2: names under the original model, taken before fully_shard replaces the parameters
        self.names: dict[int, dict[str, str]] = {}
        for s, w in self.pipe.workers.items():
            gm = w.stage.module
            ident = {id(t): prog.state_entry(idx).name for idx, t in prog.stage_entries[s].items()}
            self.names[s] = {n: ident[id(p)] for n, p in gm.named_parameters()}
            fully_shard(gm, mesh=mesh["dp"], reshard_after_forward=False)
            gm.set_gradient_divide_factor(1.0)  # a sum: the loss is already scaled by 1 / (dp * m)
            gm.set_force_sum_reduction_for_comms(True)  # a factor other than dp asks for PREMUL_SUM: not on gloo
            self.mods.append(gm)
        self.opt = torch.optim.AdamW([p for gm in self.mods for p in gm.parameters()], lr=1e-3)
        for s, w in self.pipe.workers.items():
            gm = w.stage.module
            w.on_gradients = lambda params, gm=gm: self._reduce(gm)  # pipesplit's dp all-reduce is off
            if redirect:
                # Point the worker at FSDP's unsharded parameters (stable objects from the first
                # all-gather on): its backward passes them as inputs=, the weight graph holds them.
                gm.unshard()
                w.params = [p for p in gm.parameters() if p.requires_grad]
                w._weight_graphs.clear()
                if w.split_backward:
                    w._weights()  # zero-bubble's weight graph, over the same unsharded parameters
                gm.reshard()

    def _reduce(self, gm: Any) -> None:
        """The stage's last backward of the step is done: reduce-scatter its gradients now."""
        gm.set_requires_gradient_sync(True)
        gm.set_reshard_after_backward(True)
        gm.set_is_last_backward(True)
        for group in fully_shard.state(gm)._fsdp_param_groups:
            group.post_backward()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        for gm in self.mods:
            gm.set_requires_gradient_sync(False)
            gm.set_reshard_after_backward(False)
            gm.set_is_last_backward(False)
        loss = self.pipe.step(x, target=y)
        for gm in self.mods:  # waits for the reduce-scatters, as the root's end-of-backward callback does
            fully_shard.state(gm)._root_post_backward_final_callback()
        t1 = time.perf_counter()
        self.opt.step()
        self.phases.append((t1 - t0, time.perf_counter() - t1))  # (pipeline step with its sync, optimizer)
        return float(loss)

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        if self.kind == "allreduce":
            return {n: p.grad for n, p in self.pipe.named_parameters()}
        out: dict[str, torch.Tensor | None] = {}
        for s, w in sorted(self.pipe.workers.items()):
            for n, p in w.stage.module.named_parameters():
                out[self.names[s][n]] = None if p.grad is None else p.grad.full_tensor()
        return out

    def resident_bytes(self) -> int:
        """Bytes of the parameters, gradients and optimizer state this rank holds between steps
        (its local shards for FSDP2); each storage once."""
        seen: dict[int, int] = {}

        def add(t: Any) -> None:
            if isinstance(t, torch.Tensor):
                local = t.to_local() if hasattr(t, "to_local") else t
                st = local.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()

        for group in self.opt.param_groups:
            for p in group["params"]:
                add(p)
                add(p.grad)
                for v in self.opt.state.get(p, {}).values():
                    add(v)
        return sum(seen.values())


def reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, n: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = sum(loss_fn(model(xm), ym) / n for xm, ym in zip(x.chunk(n), y.chunk(n)))
    loss.backward()
    return float(loss), {k: p.grad for k, p in model.named_parameters()}


def check(args: Any, mesh: Any, name: str) -> dict[str, Any]:
    """A few AdamW steps of each variant against the plain model: worst loss and gradient differences."""
    out: dict[str, Any] = {}
    dp = mesh["dp"].size()
    for kind in VARIANTS:
        torch.manual_seed(0)
        model, x, y, loss_fn, _ = build(name, args.batch)
        ref = copy.deepcopy(model)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        try:
            v = Variant(kind, model, x[:2], None, args, mesh, loss_fn, redirect=not args.no_redirect)
            gen = torch.Generator().manual_seed(5)
            loss_diff = grad_diff = 0.0
            missing: list[str] = []
            for _ in range(args.check_steps):
                order = torch.randperm(x.shape[0], generator=gen)  # another global batch each step
                xs, ys = x[order], y[order]
                # Run the variant's step without its optimizer step, compare, then step both.
                v.opt.zero_grad(set_to_none=True)
                step_opt, v.opt.step = v.opt.step, lambda *a, **k: None  # type: ignore[method-assign]
                try:
                    loss = v.step(xs, ys)
                finally:
                    v.opt.step = step_opt  # type: ignore[method-assign]
                want, ref_grads = reference(ref, xs, ys, loss_fn, dp * args.microbatches)
                loss_diff = max(loss_diff, abs(loss - want) / max(abs(want), 1e-12))
                for n, g in v.named_grads().items():
                    r = ref_grads[n]
                    if g is None:
                        missing.append(n)
                        continue
                    grad_diff = max(grad_diff, float((g - r).norm() / r.norm().clamp_min(1e-12)))
                v.opt.step()
                opt_ref.step()
            out[kind] = {"loss_rel": loss_diff, "grad_rel": grad_diff, "missing": sorted(set(missing))}
        except Exception as e:  # report how it fails, keep going with the other variant
            out[kind] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                         "trace": traceback.format_exc()[-1500:]}
        dist.barrier()
    return merge_ranks(out)


def merge_ranks(mine: dict[str, Any]) -> dict[str, Any]:
    """Every rank's check, combined: the worst differences, every missing gradient, the first error."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out: dict[str, Any] = {}
    for kind in VARIANTS:
        results = [g[kind] for g in gathered]
        errors = [r for r in results if "error" in r]
        if errors:
            out[kind] = errors[0]
            continue
        out[kind] = {"loss_rel": max(r["loss_rel"] for r in results), "grad_rel": max(r["grad_rel"] for r in results),
                     "missing": sorted({n for r in results for n in r["missing"]})}
    return out


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def peak_during(fn: Callable[[], Any]) -> int:
    """The peak of live bytes allocated through torch's CPU allocator while ``fn`` runs, above
    what was live when it started: the profiler's per-op self allocations (and the ``[memory]``
    events outside ops) summed in time order, so at op granularity. Frees of tensors allocated
    before ``fn`` are not reported by the profiler, so nothing live at the start may be freed
    inside (gradients are set to None before)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def bench(args: Any, mesh: Any, name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, x, y, loss_fn, desc = build(name, args.batch)
    plan = pipesplit.compile(model, x[:2], num_stages=mesh["pp"].size(), progress=False).plan
    variants = {k: Variant(k, copy.deepcopy(model), x[:2], plan, args, mesh, loss_fn) for k in VARIANTS}
    runs = {k: (lambda v=v: v.step(x, y)) for k, v in variants.items()}
    for _ in range(args.warmup):
        for fn in runs.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.steps):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for k in order:
            times[k].append(timed(runs[k]))
    memory: dict[str, dict[str, int]] = {}
    for k, v in variants.items():
        v.opt.zero_grad(set_to_none=True)
        dist.barrier()
        resident = v.resident_bytes()
        peak = peak_during(runs[k])
        memory[k] = {"resident": resident, "step_peak": peak}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, memory)
    phases = {k: v.phases[args.warmup:args.warmup + args.steps] for k, v in variants.items()}  # this rank's
    return {"model": name, "description": desc, "times": times, "phases": phases, "memory": gathered}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--models", default="mlp")
    p.add_argument("--microbatches", type=int, default=4, help="per replica")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--check-steps", type=int, default=2)
    p.add_argument("--no-redirect", action="store_true", help="fsdp2 without pointing the worker at FSDP's parameters")
    p.add_argument("--check-only", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
    result: dict[str, Any] = {"world": world, "pp": args.pp, "dp": world // args.pp, "schedule": args.schedule,
                              "microbatches": args.microbatches, "warmup": args.warmup, "steps": args.steps,
                              "models": []}
    for name in args.models.split(","):
        entry = {"model": name, "check": check(args, mesh, name)}
        if not args.check_only and all("error" not in c and not c["missing"] for c in entry["check"].values()):
            entry.update(bench(args, mesh, name))
        result["models"].append(entry)
        if dist.get_rank() == 0:
            print(f"  {name} {args.schedule} pp={args.pp}: {json.dumps(entry['check'])[:600]}", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # no rank closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
