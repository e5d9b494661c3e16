"""A program captured at the example's batch size, generalised to every batch size once.

``compile`` exports at the example's shapes by default: a static ``torch.export`` costs
0.4-0.7x one with a dynamic batch dimension (benchmarks/RESULTS.md, compile speed), but
its graph takes that batch size only. The first time the program meets another (``prog(x)``
with another batch, a ``Pipeline`` whose microbatches differ from the example) it captures
the model once more with a dynamic batch, carries the plan over to the new graph and swaps
in the new stage graphs. The parameters, buffers, their gradients and any optimizer over
them stay the same tensors. ``torch.compile`` does alike: static first, dynamic at the first
new shape. ``compile(..., dynamic_batch=True)`` captures dynamically from the start.

Another dimension (a sequence length, an image size) goes the same way: that one capture makes
every dimension of the batched inputs dynamic where the model allows (``Dim.AUTO``), so a
program captures at most twice however its batch and lengths change. A dimension it keeps
static is one the model fixes (a reshape to a constant), and a call that changes it is refused
saying so. Where the model cannot be captured with every dimension dynamic and only the batch
changed, the batch alone is made dynamic, as before. ``compile(..., dynamic_dims=...)``
declares the dimensions up front; a program compiled with ``dynamic_batch=True`` keeps the
model until a length changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import operator
import time
from typing import TYPE_CHECKING, Any, Callable, Collection

import torch
import torch.fx as fx
from torch import nn

from pipesplit.capture import Captured, capture, rebind, static_dim
from pipesplit.compat import data_dependent
from pipesplit.dims import EVERY_DIM, DimSpec
from pipesplit.errors import CaptureError, InputError, PlanError
from pipesplit.export import paused_gc
from pipesplit.meta import COMPUTE_OPS, META_KEY, node_cost, set_node_cost
from pipesplit.passes.annotate.costs import annotate_costs
from pipesplit.passes.plan.recompute import recomputable
from pipesplit.passes.split import split_graph
from pipesplit.structure import Structure, hooks_as_compiled

if TYPE_CHECKING:
    from pipesplit.passes.split.program import SplitProgram

log = logging.getLogger(__name__)


def recapture_fn(
    model: nn.Module, args: Any, kwargs: dict[str, Any] | None, batch_dim: int, unbatched: Collection[str],
    dims: DimSpec | None = None,
) -> Callable[[bool], Captured]:
    """Captures ``model`` again with a dynamic batch (and the ``dims`` it was compiled with; with
    ``every_dim``, every dimension of its batched inputs), as it was compiled: every submodule in the
    training mode and with the forward hooks it had then (its own put back after), the same grad
    mode, outside any autocast or inference mode the call that needs it runs in, without copying
    the model's state. A model whose modules, parametrizations or state names changed since is
    refused, naming the change."""
    grad_enabled = torch.is_grad_enabled()
    compiled = [(m, m.training) for m in model.modules()]
    structure = Structure.of(model)

    def recapture(every_dim: bool = False) -> Captured:
        changed = structure.changes(Structure.of(model))
        if changed:
            raise CaptureError(
                f"{type(model).__name__} changed since it was compiled: {'; '.join(changed)}. The program captures "
                "the model again for a new batch size or length and would capture the changed model, not the one it "
                "holds. Put the model back as it was, or compile it again (pipesplit.compile) to run the changed "
                "model; compile(..., dynamic_batch=True, dynamic_dims=True) captures once and never again. (Changed "
                "weight values are fine: the program holds its own.)"
            )
        modes = [(m, m.training) for m in model.modules()]
        for m, mode in compiled:
            m.training = mode
        try:
            with contextlib.ExitStack() as scope:
                scope.enter_context(torch.inference_mode(False))
                scope.enter_context(torch.set_grad_enabled(grad_enabled))
                for device_type in ("cpu", "cuda"):
                    if torch.is_autocast_enabled(device_type):
                        scope.enter_context(torch.autocast(device_type, enabled=False))
                scope.enter_context(hooks_as_compiled(structure))  # not one added since (transformers' recorders)
                return capture(model, args, kwargs, batch_dim=batch_dim, unbatched=unbatched, copy_state=False,
                               dims={EVERY_DIM: {}} if every_dim else dims)
        finally:
            for m, mode in modes:
                m.training = mode

    return recapture


UNMERGEABLE = -1  # an output that carries the batch where microbatches cannot be joined (seq * batch, flattened)
UNKNOWN = -2  # static capture: an output computed from the batch, not with the batch's size at batch_dim
DATA_DEPENDENT = -3  # a size computed from the inputs' values (torch.nonzero, a boolean mask): joined by no rule


def output_batch_dims(captured: Captured) -> list[int | None]:
    """Per flat output: the dimension that carries the batch (microbatches' outputs concatenate
    there), None for an output without one, or ``UNMERGEABLE``.

    Dynamic capture: the dimension whose size is the batch symbol (two such dimensions, ``h @ h.T``,
    are ``UNMERGEABLE``); a first dimension that is a multiple of it is a flattened batch-first batch
    (``(batch * seq, vocab)`` logits: contiguous per sample, as the targets' rule takes it) where
    the inputs carry the batch first; any other use of the symbol is ``UNMERGEABLE``. Static
    capture: the inputs' batch dimension where the output depends on a batched input and has the
    example's batch size there and nowhere else; ``UNKNOWN`` for another output that depends on one (sizes alone
    cannot tell a (seq, batch) output or flattened rows from a count that happens to have the
    batch's size): the dynamic capture decides, if the microbatches' values need joining. Either
    capture: ``DATA_DEPENDENT`` for an output with a size computed from the inputs' values
    (``h[torch.nonzero(mask)]``), which no rule joins.
    """
    d, static = captured.batch_dim, captured.static_batch
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    batched_in = {n for n, info in zip(placeholders, captured.inputs) if info.batched}
    symbols = {n.meta["val"].shape[d].node.expr for n in batched_in
               if static_dim(n.meta["val"].shape[d]) is None}
    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    result: list[int | None] = []
    for v in out_node.args[0]:
        val = v.meta.get("val") if isinstance(v, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            result.append(None)
        elif data_dependent(val):
            result.append(DATA_DEPENDENT)
        elif static is None:
            result.append(_symbolic_batch_dim(val.shape, symbols, d, _flattened_from(v)))
        elif not _depends_on(v, batched_in):
            result.append(None)
        else:
            sized = [j for j, size in enumerate(val.shape) if int(size) == static]
            result.append(d if sized == [d] else UNKNOWN)  # (B, B): one batch dimension, or two? dynamic decides
    return result


_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "clone", "contiguous", "alias", "detach"}


def _flattened_from(node: Any) -> Any:
    """The value an output was reshaped from (through views, reshapes and copies), itself if none."""
    while (isinstance(node, fx.Node) and node.op == "call_function" and node.args
           and isinstance(node.args[0], fx.Node)
           and getattr(node.target, "_opname", None) in _RESHAPES):
        node = node.args[0]
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _symbolic_batch_dim(shape: Any, symbols: set[Any], d: int, source: Any = None) -> int | None:
    """See :func:`output_batch_dims`; ``source`` is the value the output was reshaped from: a
    flattened first dimension is the batch's, in batch-major order, only where that value carried
    the batch first (``(B, T, V).reshape(-1, V)``, not ``(T, B, V).reshape(-1, V)``)."""
    exprs = [None if static_dim(s) is not None else s.node.expr for s in shape]
    at = [j for j, e in enumerate(exprs) if e is not None and e in symbols]
    if len(at) > 1:
        return UNMERGEABLE  # (batch, batch): an in-batch similarity, each microbatch holds only its diagonal block
    if at:
        return at[0]
    uses = [j for j, e in enumerate(exprs) if e is not None and e.free_symbols & {x for s in symbols for x in s.free_symbols}]
    if not uses:
        return None
    first = source.shape[0] if isinstance(source, torch.Tensor) and source.dim() else None
    batch_first = first is not None and static_dim(first) is None and first.node.expr in symbols  # type: ignore[attr-defined]
    if d == 0 and uses == [0] and batch_first and any(_per_sample(exprs[0] / s, symbols) for s in symbols):
        return 0  # (batch * seq, ...): batch-first, flattened
    return UNMERGEABLE


def _per_sample(rows: Any, symbols: set[Any]) -> bool:
    """``rows`` (a flattened first dimension over the batch) is a count per sample: a whole number, or
    an expression of other sizes (a sequence length) without the batch's and without a fraction."""
    if rows.is_Integer:
        return True
    batch = {x for s in symbols for x in s.free_symbols}
    return not (rows.free_symbols & batch) and bool(rows.is_polynomial()) and rows.as_numer_denom()[1] == 1


def _depends_on(node: fx.Node, sources: set[fx.Node]) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in sources:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def carry_stages(
    old_gm: fx.GraphModule, old_stages: list[list[str]], new_gm: fx.GraphModule
) -> tuple[list[list[str]], dict[str, str]]:
    """The plan's stages on another capture of the same model, and the old name of each matched
    node -> its new name (export numbers each graph's nodes on its own).

    Nodes are matched by aligning the two graphs' operation sequences (export numbers nodes
    per graph, and a graph with a dynamic batch has size reads, and in Hugging Face models
    masks built another way, that the static one lacks); an operation on a parameter is
    named by it, so every parameter's users anchor the alignment. A matched node keeps its
    stage; a tensor only the new graph has goes as late as its users allow, never before its
    inputs, and a size (read from an input, sent for free) right after its inputs. Raises PlanError if the matched nodes themselves leave no consistent order.
    """
    where = {name: s for s, names in enumerate(old_stages) for name in names}
    old = [n for n in old_gm.graph.nodes if n.op in COMPUTE_OPS]
    compute = [n for n in new_gm.graph.nodes if n.op in COMPUTE_OPS]
    matcher = difflib.SequenceMatcher(None, [_signature(n, old_gm) for n in old],
                                      [_signature(n, new_gm) for n in compute], autojunk=False)
    stage: dict[fx.Node, int] = {}
    renamed: dict[str, str] = {}
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            before, after = old[block.a + i], compute[block.b + i]
            renamed[before.name] = after.name
            if before.name in where:
                stage[after] = where[before.name]
    for n in reversed(compute):  # unmatched tensors: as late as the users allow
        if n not in stage and isinstance(n.meta.get("val"), torch.Tensor):
            users = [stage[u] for u in n.users if u in stage]
            if users:
                stage[n] = min(users)
    for n in compute:  # ... and never before an input
        low = max((stage[a] for a in n.all_input_nodes if a in stage), default=0)
        if n not in stage:
            stage[n] = low
        elif stage[n] < low:
            raise PlanError(
                f"the model's graph with a dynamic batch differs from the one captured at the example's batch: "
                f"{n.name!r} lands in stage {stage[n]} before its input in stage {low}. Compile with "
                "dynamic_batch=True so the plan is made on the dynamic graph."
            )
    return [[n.name for n in compute if stage[n] == s] for s in range(len(old_stages))], renamed


def carry_heads(old_stages: list[list[str]], new_stages: list[list[str]], renamed: dict[str, str],
                heads: dict[int, int]) -> dict[int, int]:
    """``Plan.checkpoint_partial`` (stage -> how many of its first nodes recompute) on the new capture's
    stages: the head ends where its last node that the new graph has ends (sizes the new graph reads
    may sit inside it); a head none of whose nodes the new graph has recomputes its stage's first node."""
    out = {}
    for s, n in heads.items():
        at = {name: i for i, name in enumerate(new_stages[s])}
        ends = [at[renamed[name]] for name in old_stages[s][:n] if renamed.get(name) in at]
        out[s] = min(max(ends, default=0) + 1, len(new_stages[s]))
    return out


def carry_times(old_gm: fx.GraphModule, new_gm: fx.GraphModule, renamed: dict[str, str]) -> int:
    """Copy the profiled (or calibrated) times of ``old_gm``'s nodes onto their matches in
    ``new_gm``, whose costs were just annotated from scratch; returns how many were carried.

    The times stay those measured at the example's batch, as before: predictions scale them
    to a microbatch. A node only the new graph has (a size read) keeps its FLOP cost.
    """
    new = {n.name: n for n in new_gm.graph.nodes}
    carried = 0
    for n in old_gm.graph.nodes:
        if META_KEY not in n.meta or n.name not in renamed or META_KEY not in new[renamed[n.name]].meta:
            continue
        c = node_cost(n)
        if c.time_s is None and c.bwd_time_s is None:
            continue
        target = new[renamed[n.name]]
        set_node_cost(target, dataclasses.replace(node_cost(target), time_s=c.time_s, bwd_time_s=c.bwd_time_s))
        carried += 1
    return carried


def _signature(n: fx.Node, gm: fx.GraphModule) -> str:
    """An operation and the parameters and buffers it reads (not the submodules export numbers)."""
    attrs = ",".join(str(a.target) for a in n.all_input_nodes
                     if a.op == "get_attr" and isinstance(operator.attrgetter(str(a.target))(gm), torch.Tensor))
    return f"{n.target}({attrs})" if attrs else str(n.target)


def generalise(prog: "SplitProgram", why: str, lengths: bool = False) -> None:
    """Capture the model again with every dimension of its batched inputs dynamic where the model
    allows (the batch, a sequence length) and swap the program's stage graphs for it; ``lengths``:
    a dimension besides the batch changed. Where that capture fails and only the batch changed, one
    with a dynamic batch alone is taken instead (and no length can change after it)."""
    static = prog.static_batch
    if prog.batch_pinned is not None and not lengths:  # found by an earlier attempt: not worth another export
        raise InputError(f"{why}: {prog.batch_pinned}")
    if prog.recapture is None:
        raise InputError(
            f"{why}: this program's graphs were captured at the example's batch size {static} and it holds no "
            f"model to capture again. Use batches of {static}, or compile with dynamic_batch=True."
        )
    start = time.perf_counter()
    log.info("pipesplit: %s: capturing the model again with every dimension dynamic (once)", why)
    what = "a dynamic batch and every other dimension dynamic where the model allows"
    recapture = prog.recapture
    with paused_gc():
        try:
            _swap_in_dynamic_capture(prog, why, True, lengths)
        except (CaptureError, PlanError, InputError) as e:  # InputError: that capture pinned the batch
            if lengths or static is None:
                prog.recapture = None
                raise
            prog.recapture, prog.batch_pinned = recapture, None
            said = str(e).splitlines()[0]
            log.info("pipesplit: capturing with every dimension dynamic failed (%s); the batch alone", said)
            _swap_in_dynamic_capture(prog, why, False, lengths)
            prog.recapture = None  # a length cannot become dynamic: that capture failed
            what = f"a dynamic batch dimension (every dimension dynamic failed: {said})"
    seconds = time.perf_counter() - start
    prog.notes.append(f"{why}: captured again with {what} ({seconds:.2f} s, once)")
    prog.timings["generalise"] = prog.timings.get("generalise", 0.0) + seconds


def _swap_in_dynamic_capture(prog: "SplitProgram", why: str, every_dim: bool, lengths: bool) -> None:
    static = prog.static_batch
    assert prog.recapture is not None
    captured = prog.recapture(every_dim)
    if lengths and not captured.batch_dynamic:
        prog.recapture = None
        raise InputError(f"{why}: the model pins the batch dimension ({'; '.join(captured.notes)}), so pipesplit cannot "
                         "capture it with other dimensions dynamic either. Make the model read the batch size from "
                         "its input, or keep this dimension at its example's size.")
    if not captured.batch_dynamic:
        prog.batch_pinned = (
            f"the model pins the batch dimension to {static} (e.g. a reshape with a literal batch size; "
            f"{'; '.join(captured.notes)}). Call it with that batch, or make the model read the batch size from "
            "its input."
        )
        prog.recapture = None
        raise InputError(f"{why}: {prog.batch_pinned}")
    # The costs (and so which cuts carry a gradient) read each parameter's requires_grad as it was
    # compiled, not as it is now: under torchrun every rank captures again on its own and must cut
    # alike, and a rank sees only its own parameters' flags (cuts only grow; see runtime/grad_edges).
    then = {str(n.target): bool(getattr(node_cost(n), "trainable", False))
            for n in prog.captured_gm.graph.nodes if n.op == "get_attr"}
    for target, idx in captured.target_to_entry.items():
        t = prog.state_entry(idx).tensor
        flag = then.get(target, t.requires_grad)
        rebind(captured.gm, target, t.detach().requires_grad_(flag) if t.is_floating_point() or not flag else t)
    requires = [isinstance(x, torch.Tensor) and x.requires_grad for x in captured.example_flat]
    gm = annotate_costs(captured.gm, requires)
    for target, idx in captured.target_to_entry.items():  # the program's tensors, never the model's
        rebind(gm, target, prog.state_entry(idx).tensor)
    stages, renamed = carry_stages(prog.captured_gm, prog.plan.stages, gm)
    carry_times(prog.captured_gm, gm, renamed)
    keep = recomputable(gm, captured.mutated_targets)
    recompute = [renamed[r] for r in prog.plan.recompute if renamed.get(r) in keep]
    plan = dataclasses.replace(prog.plan, stages=stages, recompute=recompute,
                               capture="every_dim" if captured.every_dim else "dynamic",
                               checkpoint_partial=carry_heads(prog.plan.stages, stages, renamed,
                                                              prog.plan.checkpoint_partial))
    split = split_graph(gm, stages, [str(s.device) for s in prog.stages], recompute=recompute)
    prog.respecialise(captured, split, plan)
    prog.recapture = None  # the last capture: the model is no longer needed
