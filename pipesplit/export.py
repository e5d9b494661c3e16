"""Running torch.export quietly, and turning its failures into a CaptureError that says what matters.

torch.export logs (and prints the partial graph, twice) its own account of a failure before
raising; the CaptureError names the failing line of the user's code and a hint, and its
``__cause__`` keeps torch's whole story.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import re
import sys
import time
import traceback
from typing import Any, Iterator, Sequence, cast

import torch
import torch.fx as fx

from pipesplit.compat import TORCH_LOGGERS, pytree
from pipesplit.errors import CaptureError

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__)


def export_quietly(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any) -> tuple[Any, float]:
    """``torch.export.export`` (non-strict) and the seconds it took; a failure raises CaptureError."""
    start = time.perf_counter()
    printed = io.StringIO()
    try:
        with _quiet_export(printed):
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # torch.export raises many unrelated types
        if printed.getvalue():
            log.debug("pipesplit: torch.export printed before failing:\n%s", printed.getvalue())
        raise CaptureError(capture_message(type(model).__name__, e)) from e
    seconds = time.perf_counter() - start
    sys.stderr.write(printed.getvalue())  # what a successful export printed (the model's warnings) is the user's
    return ep, seconds


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (restored as it was after).

    torch.export and the passes create many objects; each full collection on the way scans
    every object alive, the user's model and earlier programs included. Compiling with the
    collector paused is 10-20% faster (benchmarks/RESULTS.md); what the block leaves as
    garbage is collected at the next collection after it.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def unlift(ep: Any) -> tuple[fx.GraphModule, pytree.TreeSpec, pytree.TreeSpec]:
    """``ep``'s graph with its parameters, buffers and constants as ``get_attr`` nodes (flat inputs
    and outputs), and the pytree specs of the model's call; ``ep`` is consumed.

    What ``ep.module()`` does, less what pipesplit never uses (a deep copy of the graph, the
    pytree calling convention, guards, node provenance), which costs 15-20% of a static export.
    A mutated buffer or input gets its ``copy_`` back, as ``ep.module()`` inserts it. The
    module's code is generated on first call (most of pipesplit only reads the graph).
    """
    from torch.export.graph_signature import InputKind, OutputKind

    from pipesplit.compat import STATE_MUTATIONS, LazyGraphModule

    from pipesplit.state import attach

    gm = LazyGraphModule.from_graphmodule(ep.graph_module)
    graph, sig = gm.graph, ep.graph_signature
    _repair_users(graph)
    lifted = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ)
    non_persistent = set(sig.non_persistent_buffers)
    by_target: dict[str, fx.Node] = {}
    inputs: dict[str, fx.Node] = {}
    for node, spec in zip(list(graph.find_nodes(op="placeholder")), sig.input_specs):
        if spec.kind not in lifted:
            inputs[spec.arg.name] = node
            continue
        target = spec.target
        value = ep.state_dict[target] if target in ep.state_dict else ep.constants[target]
        if isinstance(value, torch.Tensor):
            attach(gm, target, value, persistent=target not in non_persistent)
        else:  # a script object
            *prefix, leaf = target.split(".")
            owner = gm.get_submodule(".".join(prefix)) if prefix else gm
            setattr(owner, leaf, value)
        with graph.inserting_after(node):
            getter = graph.get_attr(target)
        node.replace_all_uses_with(getter)
        getter.meta = node.meta
        graph.erase_node(node)
        by_target[target] = getter
    output = graph.output_node()
    values = list(cast(Sequence[Any], output.args[0]))
    kept = []
    for value, spec in zip(values, sig.output_specs):
        if spec.kind in STATE_MUTATIONS:
            with graph.inserting_before(output):
                graph.call_function(torch.ops.aten.copy_.default, (by_target[spec.target], value))
        elif spec.kind is OutputKind.USER_INPUT_MUTATION:
            with graph.inserting_before(output):
                graph.call_function(torch.ops.aten.copy_.default, (inputs[spec.target], value))
        else:
            kept.append(value)
    output.args = (tuple(kept),)
    graph._codegen = fx.graph.CodeGen()  # flat in, flat out
    graph.lint()
    gm.recompile()  # lazy: code is generated on first call
    return gm, ep.call_spec.in_spec, ep.call_spec.out_spec


def _repair_users(graph: fx.Graph) -> None:
    """Make every node a user of each of its inputs. torch.export can hand back a dead node (an unused
    ``linear`` of an embedding's output, next to a buffer written in place) that its input no longer lists
    as a user; rewriting that node's arguments (here, or in any later pass) then fails inside fx."""
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            if node not in arg.users:
                arg.users[node] = None


def capture_message(model_name: str, exc: BaseException) -> str:
    """What a CaptureError says: where the user's code failed (``file:line in function:`` and the
    line itself), pipesplit's hint, then torch's own first paragraph less its boilerplate."""
    where = _user_frame(exc)
    said = torch_summary(str(exc))
    head = f"torch.export could not capture {model_name}"
    lines = [f"{head} at {where[0]}:", f"    {where[1]}"] if where else [f"{head}."]
    lines.append(f"hint: {_export_hint(str(exc))}")
    lines.append(f"torch.export says: {type(exc).__name__}" + (f": {said}" if said else "").replace("\n", "\n  "))
    return "\n".join(lines)


def _user_frame(exc: BaseException) -> tuple[str, str] | None:
    """The innermost traceback frame outside torch, where the user's code failed: its
    ``file:line in function`` and its source line."""
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__ or exc.__context__
    while cause is not None:
        frames += traceback.extract_tb(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    user = [
        f for f in frames
        if not f.filename.startswith((_TORCH_DIR, "<")) and os.sep + "pipesplit" + os.sep not in f.filename
    ]
    if not user:
        return None
    f = user[-1]
    return f"{f.filename}:{f.lineno} in {f.name}", (f.line or "").strip()


# torch's advice to itself: environment variables to set, links, internal APIs to call, where in
# torch it failed and "for more information" pointers. Matched by shape, not by one release's text.
_BOILERPLATE = re.compile(
    r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+=|https?://|guard_or_(?:true|false)|statically_known_true|draft_export"
    r"|^\s*(?:for (?:more|extended|c\+\+)\b|if you (?:suspect|would like|want)|caused by:|the following call"
    r"|the error above|user stack|developer debug|explanation:|hint:|from user code)",
    re.IGNORECASE,
)
_SHOWN_LINES = 3  # of torch's first paragraph
_SHOWN_CHARS = 300  # of each line


def torch_summary(text: str) -> str:
    """The first paragraph of a torch error message that is not boilerplate, at most a few lines.

    >>> torch_summary('Could not guard on x.\\n\\nconsider guard_or_false.\\nFor more information, run with TORCH_LOGS="dynamic"')
    'Could not guard on x.'
    """
    kept = [line for line in text.strip().splitlines() if not _BOILERPLATE.search(line)]
    paragraph: list[str] = []
    for line in kept:
        if line.strip():
            paragraph.append(line.strip()[:_SHOWN_CHARS])
        elif paragraph:
            break
    return "\n".join(paragraph[:_SHOWN_LINES])


def _export_hint(message: str) -> str:
    low = message.lower()
    if "data-dependent" in low or "data dependent" in low or "guardondatadependent" in low:
        return (
            "the model branches or sizes a tensor on tensor *values*; torch.export needs "
            "control flow that depends only on shapes. Rewrite the branch with torch.where "
            "or torch.cond, or move it out of forward()."
        )
    if "cache" in low and ("dynamiccache" in low or "past_key_values" in low):
        return "pass use_cache=False (or config.use_cache=False) so the model returns no KV-cache object."
    if "constraint" in low or "specializ" in low:
        return "the model fixes a dimension the example marks dynamic; pass an example with the real shape."
    return ("the model must be traceable by torch.export (non-strict); torch's full account is this error's "
            "__cause__ (the CLI shows it with --debug).")




@contextlib.contextmanager
def _quiet_export(printed: io.StringIO) -> Iterator[None]:
    """Silence torch's export loggers and collect what it prints to stderr, for this block only."""
    loggers = [logging.getLogger(name) for name in TORCH_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
