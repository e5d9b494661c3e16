"""Mutation testing of the fuzzer: ``python -m tests.fuzz.mutants`` puts realistic defects into
pipesplit/ and passes/ one at a time and runs the fuzzer on each for a fixed budget.

Each mutant is a text patch (exact strings, each found once) applied to a copy of the tree in a
temporary folder, never to the working tree; the copy runs with its own ``pipesplit`` first on
the path (a ``sitecustomize.py`` there drops the editable install's finder, and the run checks
``pipesplit.__file__``). Each mutant carries a direct check (``live``): one fixed case, run by the
harness, that fails on the mutant and passes on the tree as it is, so a mutant the fuzzer misses
is known to change behaviour. Historical mutants undo the non-test lines of a fix (the commit is
named); the others are plausible defects of the same kinds.

    python -m tests.fuzz.mutants --list
    python -m tests.fuzz.mutants --live                 # each mutant's direct check (and the clean tree's)
    python -m tests.fuzz.mutants --minutes 3 --seed 7    # the kill table (the torchrun legs ran at 2)
    python -m tests.fuzz.mutants --only M03,M07

Not run in the suite (an hour at a few minutes each); tests/fuzz/test_fuzz.py checks that every
patch still applies, so the mutants follow the code.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Mutant:
    key: str
    area: str  # capture, planning, splitting, runtime, compiled, checkpointing, mesh
    origin: str  # "history <commit>: ..." or "new: ..."
    file: str
    patches: tuple[tuple[str, ...], ...]  # (old, new) in ``file``, or (old, new, another file)
    live: tuple[dict[str, Any], dict[str, Any]] | str  # (spec kwargs, cfg overrides) of a direct check, or a pytest id
    leg: str = "local"  # "local": python -m tests.fuzz; "pp": tests/fuzz/dist.py on 2 ranks; "mesh": on a 2 x 2 mesh
    note: str = ""


def L(op: str, src: int = 0, arg: int = 0, flag: bool = False, frozen: bool = False) -> dict[str, Any]:
    return {"op": op, "src": src, "arg": arg, "flag": flag, "frozen": frozen}


BASE_CFG: dict[str, Any] = dict(seed=1, stages=2, schedule="1f1b", m=2, mb=2, example_batch=2, mb2=2, order="auto",
                                recompute="auto", cost="flops", transport="auto", checkpoint=False, no_zero_grad=False,
                                opt="sgd", eval="none", eval_pipe=False, freeze_mid=False)
MLP = [L("linear", 0, flag=True), L("act", 1), L("linear", 2, flag=True), L("act", 3, 1), L("linear", 4, flag=True)]

MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- capture / storage analysis
    Mutant("M01", "capture", "new: InstanceNorm's running statistics not seen as written (aliasing's BATCH_NORM_OPS)",
           "passes/aliasing.py",
           ((''', "instance_norm": "use_input_stats"}''', "}"),),
           ({"layers": [L("linear", 0, flag=True), L("instancenorm", 1, arg=3), L("linear", 2, flag=True)]}, {})),
    Mutant("M02", "capture", "new: a frozen parameter comes out of capture trainable (capture._own_copy)",
           "pipesplit/capture.py",
           (("    return nn.Parameter(copy, requires_grad=t.requires_grad) if is_param else copy",
             "    return nn.Parameter(copy, requires_grad=True) if is_param else copy"),),
           ({"layers": [L("linear", 0, flag=True, frozen=True), L("act", 1), L("linear", 2, flag=True)]}, {})),
    Mutant("M03", "capture", "new: BatchNorm's running statistics not seen as written (aliasing's BATCH_NORM_OPS)",
           "passes/aliasing.py",
           (('BATCH_NORM_OPS = {"batch_norm": "training", "native_batch_norm": "training", "_native_batch_norm_legit": '
             '"training",', "BATCH_NORM_OPS = {"),),
           ({"layers": [L("linear", 0, flag=True), L("batchnorm", 1, arg=2), L("linear", 2, flag=True)]},
            {"stages": 2, "schedule": "gpipe"}),
           note="a plain BatchNorm hides it locally: its num_batches_tracked add_ still marks the stage as writing "
                "state (the checkpoint refusal holds); it shows where the statistics are read again after the write "
                "(no snapshot), or on a mesh (not combined across replicas)"),
    Mutant("M04", "runtime", "new: a keyword input's microbatches taken in reverse order (split_microbatches)",
           "pipesplit/runtime/engine/microbatch.py",
           (("            for m, piece in enumerate(value.split(per, dim=batch_dim)):",
             "            pieces = value.split(per, dim=batch_dim)\n"
             "            for m, piece in enumerate(pieces if value is flat[0] else pieces[::-1]):"),),
           ({"layers": [L("linear", 0, flag=True), L("gate", 1)], "kwarg": True}, {"m": 2})),
    Mutant("M05", "splitting", "history 59c3b6b: a flattened first dimension taken for the batch's whatever it came from",
           "passes/split/generalise.py",
           (("    if d == 0 and uses == [0] and batch_first and", "    if d == 0 and uses == [0] and"),),
           ({"layers": [L("linear", 0, flag=True)], "layout": "tflat"}, {"eval": "train_forward"})),
    Mutant("M06", "compiled", "new: a compiled W's weight gradient replaces the earlier microbatches' (stage_graphs)",
           "pipesplit/runtime/graphs/stage_graphs.py",
           (("                p.grad += g\n", "                p.grad = g\n"),),
           ({"layers": MLP}, {"schedule": "zb_h1", "compile": True, "m": 2})),
    Mutant("M07", "splitting", "new: a program's outputs joined along dimension 0 whatever the batch's (merge_outputs)",
           "pipesplit/runtime/engine/merge.py",
           (("            out = torch.cat(list(values), dim=rule.dim)  # type: ignore[arg-type]",
             "            out = torch.cat(list(values), dim=0)"),),
           ({"layers": MLP[:2], "layout": "tb"}, {"eval": "pipe"})),
    Mutant("M08", "splitting", "new: the target cut along dimension 0 whatever target_batch_dim says (split_target)",
           "pipesplit/runtime/engine/microbatch.py",
           (("            for m, piece in enumerate(leaf.chunk(num_microbatches, dim=batch_dim)):",
             "            for m, piece in enumerate(leaf.chunk(num_microbatches, dim=0)):"),),
           ({"layers": MLP[:2], "layout": "tb"}, {})),
    # ---------------------------------------------------------------- runtime
    Mutant("M09", "runtime", "new: every microbatch of a stage draws the same dropout masks (worker: stream per stage only)",
           "pipesplit/runtime/engine/worker.py",
           (("        seed = stream_seed(data.seed, self.index, data.microbatch_offset + m)",
             "        seed = stream_seed(data.seed, self.index, data.microbatch_offset)"),),
           ({"layers": [L("linear", 0, flag=True), L("dropout", 1, flag=True)]}, {})),
    Mutant("M10", "runtime", "history (issue 22): an input read by two stages gets only the last stage's gradient",
           "pipesplit/runtime/engine/steps.py",
           (("        total[(m, where)] = g if (m, where) not in total else total[(m, where)] + g\n"
             "    data.input_grads.clear()\n    pieces",
             "        total[(m, where)] = g\n    data.input_grads.clear()\n    pieces"),),
           ({"layers": MLP[:3] + [L("add", 3, 0)], "input_grad": True}, {"stages": 2})),
    Mutant("M11", "runtime", "new: a split backward's weight gradient replaces instead of accumulating (weight_grads)",
           "pipesplit/runtime/engine/weight_grads.py",
           (("            p.grad.add_(grad)\n", "            p.grad.copy_(grad)\n"),),
           ({"layers": MLP}, {"schedule": "zb_h1", "m": 2})),
    Mutant("M12", "runtime", "new: a mean loss scaled by 1/(m + 1) (prepare.prepare_step)",
           "pipesplit/runtime/engine/prepare.py",
           (("    scale = 1.0 / total if pipe.loss_reduction == \"mean\" else 1.0",
             "    scale = 1.0 / (total + (total > 2)) if pipe.loss_reduction == \"mean\" else 1.0"),),
           ({"layers": MLP[:3]}, {"reduction": "mean", "m": 4, "schedule": "gpipe"})),
    Mutant("M13", "runtime", "new: a tied replica's gradient replaces its owner's instead of adding (state.TiedState)",
           "pipesplit/state.py",
           (("        self.owner.grad = g if self.owner.grad is None else sum_grads(self.owner.grad, g)",
             "        self.owner.grad = g"),),
           ({"layers": [L("linear", 0, flag=True), L("act", 1)], "tokens": True, "tied_head": True},
            {"stages": 2})),
    Mutant("M14", "runtime", "history (CHANGELOG, found by the fuzzer): a loss function's own tensor gets no gradient "
           "under torchrun", "pipesplit/runtime/engine/worker.py",
           (("                        saved.loss_leaves, direct = loss_leaves(loss, stop, saved.params, leaves)",
             "                        saved.loss_leaves, direct = loss_leaves(loss, stop, saved.params, leaves)\n"
             "                        saved.loss_leaves = []"),),
           "tests/test_loss_leaves.py", leg="pp"),
    Mutant("M15", "compiled", "history (CHANGELOG, compiled F/I/W review): one gradient tensor for two weights (h * (w1 + w2))",
           "pipesplit/runtime/graphs/stage_graphs.py",
           (("            if ptr in held or ptr in handed or not g.is_contiguous():",
             "            if ptr in held or not g.is_contiguous():"),),
           ({"layers": [L("linear", 0, flag=True), L("wsum", 1)]}, {"schedule": "zb_h1", "compile": True, "m": 2})),
    # both guards undone: since the seventh session compile_limits sends a stage whose weight the outputs do
    # not reach to eager, so the F/I/W parts' own guard alone was unreachable (the mutant survived 520 cases)
    Mutant("M16", "compiled", "history 1d0ed6f: F/I/W graphs give a weight the outputs do not reach a zero gradient",
           "pipesplit/runtime/graphs/stage_parts.py",
           (("            reached[:] = [g is not None for g in got]\n"
             "        return [*(o.detach() if isinstance(o, torch.Tensor) else o for o in got_outs), "
             "*(g for g in got if g is not None)]",
             "            got = [torch.zeros_like(w) if g is None else g for g, w in zip(got, wanted)]\n"
             "            reached[:] = [True for g in got]\n"
             "        return [*(o.detach() if isinstance(o, torch.Tensor) else o for o in got_outs), *got]"),
            ("    if dead:\n", "    if dead and False:\n", "pipesplit/runtime/graphs/compile_limits.py")),
           ({"layers": [L("linear", 0, flag=True), L("detached", 1, arg=0, flag=True), L("act", 2)]},
            {"schedule": "zb_h1", "compile": True, "opt": "adamw", "stages": 2, "m": 2})),
    Mutant("M17", "checkpointing", "new: a checkpointed stage that writes its input in place recomputes from the written "
           "input (no clone inside the stage)", "pipesplit/runtime/engine/stage_inputs.py",
           (("                own.add(len(args))\n", "                pass\n"),),
           # the caller's input written at the front of a checkpointed stage (the old check wrote an activation
           # the planner kept in one stage with its reads: no stage input was written, and it passed on the mutant)
           ({"layers": [L("mul_", 0), L("linear", 1, flag=True), L("act", 2), L("linear", 3, flag=True)]},
            {"stages": 2, "checkpoint": True})),
    Mutant("M18", "compiled", "new: a CUDA graph slot handed back after I, before W read what I kept (cuda_graphs)",
           "pipesplit/runtime/graphs/cuda_graphs.py",
           (("        flat = slots.replay(slot, \"I\", part, [*given, *slot.tangents])",
             "        flat = slots.replay(slot, \"I\", part, [*given, *slot.tangents])\n"
             "        slot.owner = None"),),
           ({"layers": MLP}, {"schedule": "gpipe", "compile": True, "graphs": True, "m": 3})),
    # ---------------------------------------------------------------- activation checkpointing
    Mutant("M19", "checkpointing", "new: a checkpointed stage's recompute draws other dropout masks than its forward",
           "pipesplit/runtime/engine/worker.py",
           (("        def run_stage(*xs: Any) -> Any:  # checkpointing replays it, masks and all, from the same seed\n",
             "        calls = [0]\n\n"
             "        def run_stage(*xs: Any) -> Any:  # checkpointing replays it, masks and all, from the same seed\n"
             "            calls[0] += 1\n"),
            ("            with random_stream(seed, device):\n                if explicit is not None:",
             "            with random_stream(seed + calls[0] - 1, device):\n                if explicit is not None:")),
           ({"layers": [L("linear", 0, flag=True), L("dropout", 1, flag=True), L("linear", 2, flag=True)]},
            {"checkpoint": True})),
    Mutant("M20", "checkpointing", "new: checkpointing a stage that writes buffers is run, not refused (updates twice)",
           "pipesplit/runtime/engine/options.py",
           (("            raise PipesplitError(\n                f\"stage {s.index} updates buffers in place",
             "            if False: raise PipesplitError(\n                f\"stage {s.index} updates buffers in place"),),
           ({"layers": [L("linear", 0, flag=True), L("ema", 1)]}, {"checkpoint": True})),
    # ---------------------------------------------------------------- mesh (data parallel)
    Mutant("M21", "mesh", "new: a mean loss on a mesh scaled by 1/m, not 1/(m * dp) (prepare.prepare_step)",
           "pipesplit/runtime/engine/prepare.py",
           (("    scale = 1.0 / total if pipe.loss_reduction == \"mean\" else 1.0",
             "    scale = 1.0 / m if pipe.loss_reduction == \"mean\" else 1.0"),),
           "tests/test_dp_mesh.py", leg="mesh"),
    Mutant("M22", "mesh", "new: running statistics of the replicas weighted in the wrong order (running_stats.finish)",
           "pipesplit/runtime/comm/running_stats.py",
           (("        parts = [t.detach().to(device, torch.float64).reshape(-1) * tr.decay ** ((dp - 1 - d) * n)",
             "        parts = [t.detach().to(device, torch.float64).reshape(-1) * tr.decay ** (d * n)"),),
           "tests/test_running_stats.py", leg="mesh"),
    Mutant("M24", "planning", "new: a value written in place (through a view, after it was made) counted as "
           "recomputable: a later stage rebuilds it unwritten (plan/recompute.py)", "passes/plan/recompute.py",
           (("        if classes.is_written(node):\n            continue\n", ""),),
           ({"layers": [L("gate", 0), L("mul_", 1, flag=True), L("linear", 2, flag=True), L("act", 3), L("linear", 4, flag=True),
                        L("add", 5, 1)]}, {"stages": 3, "schedule": "gpipe", "recompute": "auto"})),
    Mutant("M25", "planning", "new: a random op counted as pure (the tag and fx's impure_random both dropped): a "
           "later stage redraws a dropout mask it should receive (aliasing.pure_op)", "passes/aliasing.py",
           (("        if torch.Tag.nondeterministic_seeded in target.tags:\n            return False\n"
             "        return _is_check(target) or not node.is_impure()",
             "        return _is_check(target) or not node.is_impure(impure_random=False)"),),
           ({"layers": [L("dropout", 0, flag=True), L("linear", 1, flag=True), L("act", 2), L("linear", 3, flag=True),
                        L("add", 4, 1)]}, {"stages": 3, "schedule": "gpipe", "recompute": "auto"}),
           note="dropping the tag check alone is dead code: fx's Node.is_impure (impure_random=True) refuses random ops"),
    Mutant("M26", "splitting", "new: a read of a buffer the stage writes in place gets no copy of it (split.snapshots): "
           "a microbatch's saved value is the buffer a later forward writes",
           "passes/split/snapshots.py",
           (("    if not roots:\n        return 0", "    if True:\n        return 0"),),
           ({"layers": [L("linear", 0, flag=True), L("batchnorm", 1, arg=2), L("linear", 2, flag=True)]},
            {"stages": 2, "schedule": "1f1b"})),
    Mutant("M27", "runtime", "new: a buffer written in place and read by two stages is run, not refused "
           "(state_writes.check_state_writes)", "pipesplit/runtime/state/state_writes.py",
           (("    shared = prog.shared_mutated_state()\n    if shared:", "    shared = prog.shared_mutated_state()\n"
             "    if False:"),),
           ({"layers": [L("linear", 0, flag=True), L("act", 1), L("linear", 2, flag=True), L("batchnorm", 3, arg=2),
                        L("linear", 4, flag=True), L("linear", 5, flag=True)]}, {"stages": 4, "schedule": "gpipe"})),
    Mutant("M23", "mesh", "new: the replicas' summed gradients not written back (collectives.finish_data_parallel)",
           "pipesplit/runtime/comm/collectives.py",
           (("                g.copy_(flat[offset:offset + g.numel()].view_as(g))\n", "                pass\n"),),
           "tests/test_dp_mesh.py", leg="mesh"),
]


def copy_tree(dest: str) -> None:
    """The working tree's pipesplit/, passes/, tests/ and pyproject.toml (no .git, no .venv)."""
    for name in ("pipesplit", "passes", "tests"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dest, name),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), dest)
    with open(os.path.join(dest, "sitecustomize.py"), "w") as f:  # this copy's pipesplit, not the editable one
        f.write("import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n")


def patches(mutant: Mutant) -> list[tuple[str, str, str]]:
    """(file, old, new) of each patch: a patch names its own file as a third item, else the mutant's."""
    return [(p[2] if len(p) > 2 else mutant.file, p[0], p[1]) for p in mutant.patches]


def apply(mutant: Mutant, root: str) -> None:
    for file, old, new in patches(mutant):
        path = os.path.join(root, file)
        with open(path) as f:
            text = f.read()
        n = text.count(old)
        if n != 1:
            raise ValueError(f"{mutant.key}: the patch's text is found {n} times in {file}: {old[:80]!r}")
        with open(path, "w") as f:
            f.write(text.replace(old, new))


def env(root: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")


_LIVE = """
import sys, pipesplit
assert pipesplit.__file__.startswith({root!r}), pipesplit.__file__
from tests.fuzz.check import run, FuzzFailure
from tests.fuzz.models import Layer, ModelSpec
from tests.fuzz.mutants import BASE_CFG
spec, cfg = {spec!r}, {cfg!r}
spec = ModelSpec(tuple(Layer(**x) for x in spec.pop("layers")), **spec)
try:
    print("outcome:", run(spec, dict(BASE_CFG, **cfg)))
except FuzzFailure as e:
    print("FAILS:", str(e).splitlines()[0][:300])
    sys.exit(1)
"""


def live(mutant: Mutant, root: str) -> tuple[bool, str]:
    """Run the mutant's direct check in ``root``: (failed, what it printed)."""
    if isinstance(mutant.live, str):
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", mutant.live]
    else:
        spec, cfg = mutant.live
        cmd = [sys.executable, "-c", _LIVE.format(root=root, spec=dict(spec), cfg=dict(cfg))]
    out = subprocess.run(cmd, cwd=root, env=env(root), capture_output=True, text=True, timeout=900)
    text = (out.stdout + out.stderr).strip().splitlines()
    said = next((line for line in text if line.startswith(("FAILS:", "outcome:"))), text[-1] if text else "")
    return out.returncode != 0, said


def fuzz_leg(mutant: Mutant, root: str, minutes: float, seed: int) -> tuple[bool, str]:
    """Run the fuzzer on the mutated tree: (killed, the failure's first line or the summary)."""
    if mutant.leg in ("mesh", "pp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={4 if mutant.leg == 'mesh' else 2}", "tests/fuzz/dist.py", "--mesh", mutant.leg, "--cases", "1000", "--minutes", str(minutes), "--seed", str(seed)]
    else:
        cmd = [sys.executable, "-m", "tests.fuzz", "--minutes", str(minutes), "--seed", str(seed), "--first-failure",
               "--out", os.path.join(root, "repros")]
    try:
        out = subprocess.run(cmd, cwd=root, env=env(root), capture_output=True, text=True, timeout=60 * minutes + 600)
    except subprocess.TimeoutExpired:
        return True, "timed out (a hang counts as killed)"
    text = out.stdout + out.stderr
    first = next((line for line in text.splitlines() if line.startswith("FAILURE")
                  or re.match(r"rank \d+: FAILURE", line)), "")
    cases = next((line.split(" cases checked")[0] for line in text.splitlines() if " cases checked" in line), "?")
    tail = " | ".join(line[:200] for line in text.strip().splitlines()[-6:] if "Warning" not in line)
    return out.returncode != 0, (first[:240] or tail) + f" [{cases} cases]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.mutants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=2.5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--only", default="", help="comma-separated keys")
    p.add_argument("--list", action="store_true")
    p.add_argument("--live", action="store_true", help="run each mutant's direct check instead of the fuzzer")
    p.add_argument("--no-control", action="store_true", help="skip the fuzzer's run on the unmutated tree")
    args = p.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.key in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.key} {m.area:13s} {m.file}: {m.origin}")
        return 0
    rows, t0 = [], time.monotonic()
    if args.live:
        with tempfile.TemporaryDirectory() as clean:
            copy_tree(clean)
            for m in chosen:
                if not isinstance(m.live, str):
                    failed, said = live(m, clean)
                    print(f"{m.key} clean tree: {'FAILS' if failed else 'passes'} ({said})", flush=True)
    if not args.live and not args.no_control:  # the clean tree first: a failure there voids the table
        legs = sorted({m.leg for m in chosen})
        for leg in legs:
            with tempfile.TemporaryDirectory(prefix="pipesplit-control-") as root:
                copy_tree(root)
                hit, said = fuzz_leg(Mutant("control", "-", "the tree as it is", "", (), "", leg=leg), root,
                                     args.minutes, args.seed)
                print(f"control ({leg} leg, no mutant): {'FAILS: the table below is void' if hit else 'passes'}"
                      f"\n      {said}", flush=True)
    for m in chosen:
        with tempfile.TemporaryDirectory(prefix=f"pipesplit-{m.key}-") as root:
            copy_tree(root)
            apply(m, root)
            start = time.monotonic()
            hit, said = live(m, root) if args.live else fuzz_leg(m, root, args.minutes, args.seed)
            word = ("live" if hit else "NOT LIVE") if args.live else ("killed" if hit else "SURVIVED")
            rows.append((m, hit))
            print(f"{m.key} {m.area:13s} {word:9s} {time.monotonic() - start:5.0f}s  {m.origin[:90]}\n      {said}",
                  flush=True)
    hits = sum(h for _, h in rows)
    what = "live" if args.live else f"killed at {args.minutes:g} min each, seed {args.seed}"
    print(f"\n{hits} of {len(rows)} mutants {what} ({(time.monotonic() - t0) / 60:.1f} min)")
    by_area: dict[str, list[bool]] = {}
    for m, h in rows:
        by_area.setdefault(m.area, []).append(h)
    for area, hs in by_area.items():
        print(f"  {area:13s} {sum(hs)}/{len(hs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
