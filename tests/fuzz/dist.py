"""Run under torchrun (gloo, CPU): fuzz cases with one process per pipeline rank (``--mesh pp``,
2 ranks) or on a 2 (dp) x 2 (pp) DeviceMesh (``--mesh mesh``, 4 ranks). Every rank draws the
same cases from a seeded random, in float64; a case that fails on any rank stops the run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.fuzz.check import ALL_OPS, FuzzFailure, Stats, run  # noqa: E402
from tests.fuzz.coverage import FEATURES, SCHEDULE_FEATURES, Coverage  # noqa: E402
from tests.fuzz.configs import draw_config, draw_length, expected_refusal, features, valid_combos  # noqa: E402
from tests.fuzz.models import draw_model  # noqa: E402
from tests.launch import end_rank  # noqa: E402


# what each case in turn must have: every (torchrun, feature) pair is met, and dropout with checkpointing
# (a stage's recompute must redraw the masks of its forward) and compiled stages (aot_eager; F/I/W graphs)
FORCED = [frozenset(), frozenset({"dropout", "checkpoint"}), frozenset({"compile"}), frozenset({"buffer_write"}),
          frozenset({"shared"}), frozenset({"fiw", "graphed"}), frozenset({"input_grad"}),
          frozenset({"non_batch_first"}), frozenset({"checkpoint"}), frozenset({"dropout"}),
          frozenset({"compile", "dropout"})]  # draw k has FORCED[(k + 1) % 11]: the suite's few cases meet the first


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", choices=["pp", "mesh"], default="pp")
    p.add_argument("--cases", type=int, default=6, help="cases that run (not counting skipped draws)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--include-known", action="store_true")
    p.add_argument("--first-draw", type=int, default=0, help="start at this draw (replay one: --cases 1)")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # check.run runs every case in float64 anyway
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if args.mesh == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "pp"))
    pp = 2 if mesh is not None else world
    combos = valid_combos(ranks=pp)
    stats, failures, draws = Stats(), 0, args.first_draw
    coverage = Coverage()
    deadline = time.monotonic() + 60 * args.minutes
    while stats.ran < args.cases and draws < args.first_draw + 50 * args.cases:
        go = torch.tensor([1 if time.monotonic() < deadline else 0])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)  # every rank stops together: one that stopped alone would hang the rest
        if not go.item():
            break
        rng = random.Random(args.seed * 100_003 + draws)
        draws += 1
        force = FORCED[draws % len(FORCED)]  # each feature in turn, so that every (torchrun, feature) pair is met
        spec = draw_model(rng.choice, rng.randint, ALL_OPS, max_layers=6, force=force)
        if mesh is not None:  # running statistics read in the forward are refused on a mesh by design (a replica's
            # part is not the batch's): the plain norms, whose statistics the replicas combine
            spec = dataclasses.replace(spec, layers=tuple(
                dataclasses.replace(x, arg=x.arg - 2) if (x.op, x.arg % 4) in (("batchnorm", 2), ("instancenorm", 3)) else x
                for x in spec.layers))
        if spec.layout == "tflat":  # refused in pipe(x) by the ranks that join outputs alone: the others hang
            spec = dataclasses.replace(spec, layout="flat")
        cfg = draw_length(draw_config(rng.choice, rng.randint, spec, combos, local=False, force=force), spec)
        if expected_refusal(features(spec, cfg, args.mesh)):  # refused by the rank holding that stage alone
            cfg["checkpoint"] = False
        cfg["eval_pipe"] = False  # a second Pipeline needs a schedule for the same ranks
        if mesh is not None:  # refused on a mesh, by the last stage's ranks alone (tests/test_loss_leaves.py):
            cfg["loss_param"] = False  # the others then time out and the process group is spent
        if cfg["eval"] == "prog":  # a rank holds only its stages: prog(x) is refused by name (test_errors)
            cfg["eval"] = "pipe"
        error = ""
        try:
            outcome = run(spec, cfg, stats=stats, include_known=args.include_known, mesh=mesh,
                          dist=args.mesh, coverage=coverage)
        except FuzzFailure as e:
            outcome, error = "failed", str(e)
            path = os.path.join(tempfile.gettempdir(), f"pipesplit-fuzz-rank{rank}-draw{draws - 1}.txt")
            with open(path, "w") as f:  # the raw error's traceback first (the repro runs one process only)
                cause = e.__cause__
                f.write("".join(traceback.format_exception(cause)) + "\n" if cause is not None else "")
                f.write(error)
        print(f"rank {rank} draw {draws - 1}: {outcome} {error[:300]}", file=sys.stderr, flush=True)
        if error:  # before the all-reduce: the other ranks may still be in the step and time out, ending the group
            print(f"rank {rank}: FAILURE on draw {draws - 1}: {error}", flush=True)
        flag = torch.tensor([1 if error else 0])
        dist.all_reduce(flag)
        if flag.item():
            failures += 1
            break
        if rank == 0:
            print(f"fuzz dist draw {draws - 1}: {outcome} ({cfg['schedule']}, {cfg['stages']} stages, "
                  f"m={cfg['m']})", flush=True)
    dist.barrier()
    if rank == 0:
        print(stats.summary(), flush=True)
        reached = {f for p, n in coverage.count.items() if n for f in p}
        print(f"torchrun ({args.mesh}) pairs reached: " + ", ".join(
            f"{args.mesh} x {f}" for f in (*FEATURES, *SCHEDULE_FEATURES) if f in reached), flush=True)
        print(f"fuzz dist: {failures} failures", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    end_rank(main())
