"""State written in place inside the forward: where a pipeline can still equal gradient accumulation."""

from __future__ import annotations

import operator

import torch

from pipesplit.errors import PipesplitError, ScheduleError
from pipesplit.passes.split.program import SplitProgram
from pipesplit.schedules import ActionKind, Schedule, resolve_schedule
from pipesplit.schedules.registry import list_schedules


def overlapping_stages(schedule: Schedule) -> dict[int, tuple[int, int]]:
    """Stage -> (k, j) for every stage that runs the forward of microbatch ``k`` while microbatch ``j``'s
    backward is not done (its B, or its W after I); the stages missing run one microbatch at a time."""
    out: dict[int, tuple[int, int]] = {}
    for actions in schedule.actions:
        open_: dict[int, set[int]] = {}  # stage -> microbatches forwarded whose backward is not done
        for a in actions:
            if a.kind is ActionKind.FORWARD:
                pending = open_.setdefault(a.stage, set())
                if pending and a.stage not in out:
                    out[a.stage] = (a.microbatch, min(pending))
                pending.add(a.microbatch)
            elif a.kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_WEIGHT):
                open_.get(a.stage, set()).discard(a.microbatch)
    return out


def _writer(prog: SplitProgram, stage: int, target: str) -> str:
    """The name of the op of stage ``stage`` that writes ``target`` in place (as its graph names it)."""
    graph = prog.stages[stage].module.graph
    users = [u for n in graph.nodes if n.op == "get_attr" and n.target == target for u in n.users]
    writers = [u for u in users if u.name.rstrip("0123456789").rstrip("_").endswith("_")
               or "higher_order" in str(u.target) or str(u.target).endswith("_.default")]
    return (writers or users)[0].name if users else "?"


def _backward_reads(prog: SplitProgram, stage: int, target: str) -> bool:
    """Whether a backward of stage ``stage`` may read the value of ``target``: some op with a gradient
    reads it (or a value aliasing it), other than an embedding's lookup table, whose backward needs
    only the indices, and reads inside a no-grad block, which save nothing."""
    graph = prog.stages[stage].module.graph
    todo = [n for n in graph.nodes if n.op == "get_attr" and n.target == target]
    like = todo[0].meta.get("val") if todo else None

    def may_alias(n: object) -> bool:  # a no-grad block's output of another shape or dtype is another tensor
        val = getattr(n, "meta", {}).get("val")
        return not (isinstance(val, torch.Tensor) and isinstance(like, torch.Tensor)) or (
            val.dtype == like.dtype and val.shape == like.shape)

    seen: set[object] = set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.target is operator.getitem or user.target is torch.ops.aten.detach.default:
                if may_alias(user):
                    todo.append(user)  # the value again (a no-grad block's result aliases what it wrote)
            elif "wrap_with_set_grad_enabled" in str(user.target) and user.args and user.args[0] is False:
                todo.append(user)  # reads in there save nothing; its outputs may alias the tensor
            elif not (user.target is torch.ops.aten.embedding.default and user.args[0] is node):
                return True
    return False


def check_state_writes(prog: SplitProgram, schedule: Schedule, num_microbatches: int, distributed: bool = False) -> None:
    """Refuse state written in place where microbatches would see each other's writes: a buffer that
    several stages use, and a parameter written in place inside the forward (``with torch.no_grad(): w.clamp_(...)``)
    on a stage that holds several microbatches at once under ``schedule``.

    Gradient accumulation runs each microbatch's forward and backward before the next forward, so the
    backward sees the parameter as its own forward left it. A stage with microbatch ``k``'s forward
    before ``j``'s backward would hand that backward the parameter as ``k``'s forward wrote it (autograd
    refuses: "modified by an inplace operation"). A stage that runs one microbatch at a time (every
    stage at one microbatch; 1F1B's last stage) equals accumulation exactly.
    """
    check_input_writes(prog)
    if distributed:
        check_state_across_ranks(prog, schedule)
    if num_microbatches <= 1:
        return
    check_forward_order(prog, schedule)
    shared = prog.shared_mutated_state()
    if shared:
        name, stages = next(iter(shared.items()))
        raise PipesplitError(
            f"buffer {name!r} is written in place and used by stages {stages} ({len(shared)} such buffer(s)). "
            "With several microbatches in flight a stage would see another microbatch's write, so the "
            "pipeline could not equal gradient accumulation. Keep its users in one stage "
            "(compile(..., no_split=[...]) or pins={...}), or use num_microbatches=1."
        )
    overlap = overlapping_stages(schedule)
    for stage in prog.stages:
        if stage.module is None or stage.index not in overlap:
            continue
        for target in stage.attr_targets:
            idx = prog.target_to_entry.get(target)
            if target not in prog.mutated_targets or idx is None or not prog.state_entry(idx).is_param:
                continue
            if not prog.state_entry(idx).tensor.requires_grad and not _backward_reads(prog, stage.index, target):
                continue  # frozen, and no backward reads its value (an EMA codebook looked up by index)
            k, j = overlap[stage.index]
            raise ScheduleError(
                f"parameter {prog.state_entry(idx).name!r} is written in place inside the forward (op "
                f"{_writer(prog, stage.index, target)!r} in stage {stage.index}), and under {schedule.name!r} with "
                f"{num_microbatches} microbatches stage {stage.index} runs microbatch {k}'s forward before microbatch "
                f"{j}'s backward: that backward would see the parameter as the later forward wrote it, so the "
                "pipeline could not equal gradient accumulation. "
                f"{_working(prog, stage.index, num_microbatches)}Or use num_microbatches=1, or write the parameter "
                "after the optimizer step instead (with torch.no_grad(): p.clamp_(...))."
            )


def check_state_across_ranks(prog: SplitProgram, schedule: Schedule) -> None:
    """Under torchrun each rank holds its own copy of a buffer: one written in place by a stage and used by
    a stage on another rank (BatchNorm's ``running_var`` read after its update, a cut between) would reach
    that stage unwritten, at any number of microbatches (the torchrun fuzz leg, seed 22 draw 66: loss 3.8% off)."""
    rank_of = schedule.stage_to_rank
    for name, stages in prog.shared_mutated_state().items():
        ranks = sorted({rank_of[s] for s in stages})
        if len(ranks) > 1:
            raise PipesplitError(
                f"buffer {name!r} is written in place and used by stages {stages}, which run on ranks {ranks}: "
                "each rank holds its own copy of it, so a stage on another rank than the writer's would not see "
                "the write, and the pipeline could not equal the model. Keep its users in one stage "
                "(compile(..., no_split=[...]) or pins={...}), or run them on one rank.")


def forward_orders(schedule: Schedule) -> dict[int, list[int]]:
    """Stage -> the microbatches its forwards run, in the order its rank runs them."""
    out: dict[int, list[int]] = {}
    for actions in schedule.actions:
        for a in actions:
            if a.kind is ActionKind.FORWARD:
                out.setdefault(a.stage, []).append(a.microbatch)
    return out


def check_forward_order(prog: SplitProgram, schedule: Schedule) -> None:
    """Refuse a schedule that runs a stage's forwards out of microbatch order where that stage writes
    state in place (BatchNorm's running statistics, an EMA): gradient accumulation updates it microbatch
    after microbatch, and another order leaves other values (every built-in schedule runs them in order;
    a custom one may not)."""
    for stage, order in forward_orders(schedule).items():
        if order == sorted(order) or stage >= len(prog.stages) or prog.stages[stage].module is None:
            continue
        written = [t for t in prog.stages[stage].attr_targets if t in prog.mutated_targets]
        if written:
            idx = prog.target_to_entry.get(written[0])
            name = prog.state_entry(idx).name if idx is not None else written[0]
            raise ScheduleError(
                f"schedule {schedule.name!r} runs stage {stage}'s forwards in the order {order}, and stage {stage} "
                f"writes {name!r} in place in its forward ({len(written)} such tensor(s): BatchNorm's running "
                "statistics?). Gradient accumulation updates it microbatch after microbatch, so another order "
                "leaves other values. Run each stage's forwards in microbatch order (every built-in schedule does)."
            )


def _working(prog: SplitProgram, stage: int, num_microbatches: int) -> str:
    """The registered schedules under which ``stage`` runs one microbatch at a time, as a sentence."""
    ok = []
    for name in list_schedules():
        try:
            if stage not in overlapping_stages(resolve_schedule(name, prog.num_stages, None, num_microbatches)):
                ok.append(name)
        except PipesplitError:  # not defined for this many stages or microbatches
            continue
    if not ok:
        return f"No schedule runs stage {stage} one microbatch at a time with {num_microbatches} microbatches. "
    return f"Schedules that run stage {stage} one microbatch at a time (at their default rank count): {', '.join(ok)}. "


def check_input_writes(prog: SplitProgram) -> None:
    """Refuse a program input that one stage writes in place (``x.relu_()``) and another stage reads, where
    neither stage depends on the other: nothing orders the read before or after the write (the stages run
    concurrently), so the reader could see either value. A reader downstream of the writer runs after the
    write (the model reads it after the write), one upstream of it before (the model reads it before)."""
    after: dict[int, set[int]] = {s.index: set() for s in prog.stages}  # stage -> the stages depending on it
    for b in sorted((b for b in prog.boundaries if b.kind == "tensor"), key=lambda b: -b.src):  # sizes never travel
        after[b.src] |= {b.dst} | after[b.dst]
    for w in prog.stages:
        for name, kind, where in w.inputs:
            if kind != "input" or name not in w.mutated_inputs:
                continue
            for r in prog.stages:
                reads = any(k == "input" and i == where for _, k, i in r.inputs)
                if r.index != w.index and reads and r.index not in after[w.index] and w.index not in after[r.index]:
                    raise PipesplitError(
                        f"input {name!r} is written in place by stage {w.index} and read by stage {r.index}, and "
                        f"neither stage depends on the other, so nothing orders stage {r.index}'s read before or after "
                        f"the write. Keep the write and the read in one stage (compile(..., pins={{...}}) or "
                        f"no_split=[...]), or write a copy in the model (x = x.relu() instead of x.relu_())."
                    )
