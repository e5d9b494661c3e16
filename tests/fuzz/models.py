"""Random models as plain data: a list of layer specs that becomes Python source, a module, a repro."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

D, T, VOCAB, HEADS = 8, 4, 16, 2  # hidden size, sequence length, vocabulary, attention heads

# op -> (has parameters, writes its source in place)
OPS: dict[str, tuple[bool, bool]] = {
    "linear": (True, False), "conv1d": (True, False), "conv2d": (True, False), "layernorm": (True, False),
    "batchnorm": (True, False), "instancenorm": (True, False), "groupnorm": (True, False),
    "dropout": (False, False), "sdpa": (True, False), "mha": (True, False), "act": (False, False),
    "relu_": (False, True), "add": (False, False), "add_": (False, True), "mul_": (False, True),
    "ema": (False, False), "gate": (False, False), "reuse": (False, False), "branch": (False, False),
    "clamp_w": (True, False), "shared_w": (True, False), "wsum": (True, False), "detached": (True, False),
}
ACTS = ("relu", "gelu", "tanh", "silu")


@dataclass(frozen=True)
class Layer:
    """One node of the DAG: reads value ``src`` (0 is the input's hidden state, i the i-th layer's
    output) and ``arg`` (a second value, a layer to reuse, or a variant), makes value i+1."""

    op: str
    src: int = 0
    arg: int = 0
    flag: bool = False  # bias / affine / causal / p > 0, by op
    frozen: bool = False


@dataclass(frozen=True)
class ModelSpec:
    layers: tuple[Layer, ...] = ()
    tokens: bool = False  # token ids through an nn.Embedding, else float (B, T, D) input
    sparse: bool = False
    padding_idx: bool = False
    tied_head: bool = False  # logits = F.linear(h, embedding.weight)
    kwarg: bool = False  # a ``gate`` keyword input
    input_grad: bool = False  # the float input requires grad
    outputs: str = "tensor"  # "tensor" | "tuple" | "dict"
    table: bool = False  # a second positional input ``pos`` (T, D) without a batch dimension, added to v0
    table_grad: bool = False  # ... which requires grad (its gradient sums over the microbatches)
    aux: bool = False  # a tuple/dict output also carries a 0-dim scalar (an auxiliary loss term)
    layout: str = "bt"  # every non-scalar output as (B, T, .) "bt", sequence-first (T, B, .) "tb", "flat" (B * T, .),
    # or "tflat" (T * B, .): sequence-first rows flattened, which microbatches cannot be joined along
    extra: tuple[str, ...] = field(default=())  # reserved for future features


LAYOUT_DIM = {"bt": 0, "tb": 1, "flat": 0, "tflat": 0}  # the dimension that carries the batch in each output (and target)


def _src(spec: ModelSpec, i: int, v: int) -> str:
    return f"v{min(v, i - 1)}"


def _init_line(spec: ModelSpec, i: int, layer: Layer) -> list[str]:
    op, f, name = layer.op, layer.flag, f"self.l{i}"
    lines = {
        "linear": [f"{name} = nn.Linear({D}, {D}, bias={f})"],
        "detached": [f"{name} = nn.Linear({D}, {D}, bias={f})"],
        "clamp_w": [f"{name} = nn.Linear({D}, {D}, bias={f})"],
        "conv1d": [f"{name} = nn.Conv1d({D}, {D}, 3, padding=1, bias={f})"],
        "conv2d": [f"{name} = nn.Conv2d(1, 1, 3, padding=1, bias={f})"],
        "layernorm": [f"{name} = nn.LayerNorm({D}, elementwise_affine={f})"],
        "batchnorm": [f"{name} = nn.BatchNorm1d({D}, affine={f}, track_running_stats={layer.arg % 2 == 0})"],
        "instancenorm": [f"{name} = nn.InstanceNorm1d({D}, affine={f}, track_running_stats={layer.arg % 2 == 1})"],
        "groupnorm": [f"{name} = nn.GroupNorm(2, {D}, affine={f})"],
        "dropout": [f"{name} = nn.Dropout({0.25 if f else 0.0})"],
        "sdpa": [f"{name} = nn.Linear({D}, {3 * D}, bias={f})", f"self.o{i} = nn.Linear({D}, {D})"],
        "mha": [f"{name} = nn.MultiheadAttention({D}, {HEADS}, bias={f}, batch_first=True)"],
        "relu_": ["self.relu_inplace = nn.ReLU(inplace=True)"] if f else [],
        "ema": [f"self.register_buffer('ema{i}', torch.zeros({D}))"],
        # F.linear on an earlier linear's weight, without its bias (the weight read two ways), else its own
        "shared_w": [] if _linears(spec, i) else [f"self.w{i} = nn.Parameter(torch.randn({D}, {D}) * 0.3)"],
        # two parameters summed before use (one gradient tensor for both); flag: the second read again alone
        "wsum": [f"self.a{i} = nn.Parameter(torch.randn({D}) * 0.5)", f"self.b{i} = nn.Parameter(torch.randn({D}) * 0.5)"],
    }.get(op, [])
    if layer.frozen and OPS[op][0]:  # the layer's own parameters (a shared weight stays trainable)
        own = {"wsum": f"self.a{i}", "shared_w": None if _linears(spec, i) else f"self.w{i}"}.get(op, name)
        if own is not None:
            lines.append(f"{own}.requires_grad_(False)")
    return lines


def _linears(spec: ModelSpec, i: int) -> list[int]:
    """The values made by an nn.Linear layer before value i."""
    return [j for j in range(1, i) if spec.layers[j - 1].op == "linear"]


def _forward_line(spec: ModelSpec, i: int, layer: Layer) -> list[str]:
    """Lines computing ``v{i}`` (layer i-1 of the list, 1-based value numbering)."""
    op, f, a, x, out = layer.op, layer.flag, layer.arg, _src(spec, i, layer.src), f"v{i}"
    other = _src(spec, i, a)
    m = f"self.l{i}"
    linears = _linears(spec, i)
    if op == "reuse":  # the module of an earlier parametrised layer, called a second time
        return [f"{out} = self.l{linears[a % len(linears)]}({x})"] if linears else [f"{out} = {x} * 0.5"]
    if op == "shared_w":
        w = f"self.l{linears[a % len(linears)]}.weight" if linears else f"self.w{i}"
        return [f"{out} = F.linear({x}, {w})"]
    if op == "wsum":
        return [f"{out} = {x} * (self.a{i} + self.b{i})" + (f" + self.b{i}" if f else "")]
    return {
        "linear": [f"{out} = {m}({x})"],
        "clamp_w": ["with torch.no_grad():", f"    {m}.weight.clamp_(-0.3, 0.3)", f"{out} = {m}({x})"],
        "conv1d": [f"{out} = {m}({x}.transpose(1, 2)).transpose(1, 2)"],
        "conv2d": [f"{out} = {m}({x}.unsqueeze(1)).squeeze(1)"],
        "layernorm": [f"{out} = {m}({x})"],
        # arg % 4 == 2: the statistics it has just written are read again (saved for the backward of the
        # product: each microbatch must keep the value it read, while later forwards write the buffer)
        "batchnorm": [f"{out} = {m}({x}.transpose(1, 2)).transpose(1, 2)"
                      + (f" * {m}.running_var" if a % 4 == 2 else "")],
        "instancenorm": [f"{out} = {m}({x}.transpose(1, 2)).transpose(1, 2)"
                         + (f" * {m}.running_var" if a % 4 == 3 else "")],  # arg 3: tracked, read again
        "groupnorm": [f"{out} = {m}({x}.transpose(1, 2)).transpose(1, 2)"],
        "dropout": [f"{out} = {m}({x})"],
        "sdpa": [f"q, k, v = {m}({x}).view({x}.shape[0], {T}, 3, {HEADS}, {D // HEADS}).permute(2, 0, 3, 1, 4)",
                 f"{out} = self.o{i}(F.scaled_dot_product_attention(q, k, v, is_causal={f})"
                 f".transpose(1, 2).reshape({x}.shape[0], {T}, {D}))"],
        "mha": [f"{out} = {m}({x}, {x}, {x}, need_weights=False)[0]"],
        "act": [f"{out} = F.{ACTS[a % len(ACTS)]}({x})"],
        "relu_": [f"{out} = self.relu_inplace({x})" if f else f"{out} = {x}.relu_()"],
        "add": [f"{out} = {x} + {other}"],
        "add_": [f"{out} = {x}.add_({other})"],
        # flag: written through a view, so a later read of {x} is the value from before the write in the graph
        "mul_": [f"{out} = {x}.transpose(1, 2).mul_(2.0).transpose(1, 2)" if f else f"{out} = {x}.mul_(2.0)"],
        # a weight read only on a branch cut from autograd: no gradient reaches it (None in plain PyTorch)
        "detached": [f"{out} = {x} + {m}({other}).detach()"],
        "ema": ["with torch.no_grad():", f"    self.ema{i}.mul_(0.9).add_({x}.mean((0, 1)), alpha=0.1)",
                f"{out} = {x} + self.ema{i}"],
        "gate": [f"{out} = {x} * gate" if spec.kwarg else f"{out} = {x} * 1.5"],
        "branch": [f"{out} = {x} * 2.0 if {x}.shape[0] > 2 else {x} - 1.0"],
    }[op]


def source(spec: ModelSpec) -> str:
    """The model as a standalone Python class ``Model`` (imports included)."""
    init = ["super().__init__()"]
    if spec.tokens:
        pad = ", padding_idx=0" if spec.padding_idx else ""
        init.append(f"self.emb = nn.Embedding({VOCAB}, {D}, sparse={spec.sparse}{pad})")
    for i, layer in enumerate(spec.layers, 1):
        init += _init_line(spec, i, layer)
    fwd = ["v0 = self.emb(x)" if spec.tokens else "v0 = x"]
    if spec.table:
        fwd = [fwd[0] + " + pos"]
    for i, layer in enumerate(spec.layers, 1):
        fwd += _forward_line(spec, i, layer)
    n = len(spec.layers)
    last = f"F.linear(v{n}, self.emb.weight)" if spec.tokens and spec.tied_head else f"v{n}"
    aux = f"v{max(0, n // 2)}"
    if spec.layout != "bt":
        fwd.append(f"out = {last}")
        last = "out"
    if spec.layout == "tb":  # sequence-first: the batch in dimension 1
        last, aux = f"{last}.transpose(0, 1)", f"{aux}.transpose(0, 1)"
    elif spec.layout == "flat":  # (B * T, features): the batch and the sequence flattened, batch-major
        last, aux = f"{last}.reshape(-1, {last}.shape[-1])", f"{aux}.reshape(-1, {D})"
    elif spec.layout == "tflat":  # (T * B, features): time-major rows
        last, aux = f"{last}.transpose(0, 1).reshape(-1, {last}.shape[-1])", f"{aux}.transpose(0, 1).reshape(-1, {D})"
    reg = f"v{max(0, n // 2)}.pow(2).mean()"  # a scalar each microbatch has its own of
    ret = {"tensor": last, "tuple": f"({last}, {aux}, {reg})" if spec.aux else f"({last}, {aux})",
           "dict": f"{{'out': {last}, 'aux': {aux}, 'reg': {reg}}}" if spec.aux else
           f"{{'out': {last}, 'aux': {aux}}}"}[spec.outputs]
    fwd.append(f"return {ret}")
    sig = "self, x" + (", pos" if spec.table else "") + (", gate=None" if spec.kwarg else "")
    body = ["import torch", "import torch.nn.functional as F", "from torch import nn", "", "",
            "class Model(nn.Module):", "    def __init__(self):"]
    body += [f"        {line}" for line in init]
    body += ["", f"    def forward({sig}):"] + [f"        {line}" for line in fwd]
    return "\n".join(body) + "\n"


def build(spec: ModelSpec) -> nn.Module:
    """An instance of the class :func:`source` writes (the very code a repro runs)."""
    scope: dict[str, Any] = {}
    exec(compile(source(spec), "<fuzz model>", "exec"), scope)
    return scope["Model"]()


def io(spec: ModelSpec) -> dict[str, Any]:
    """What the harness needs to make inputs for this model (plain data)."""
    return {"tokens": spec.tokens, "vocab": VOCAB, "dim": D, "seq": T, "kwarg": spec.kwarg,
            "input_grad": spec.input_grad and not spec.tokens,
            "dropout": any(layer.op == "dropout" and layer.flag for layer in spec.layers),
            "sparse": spec.tokens and spec.sparse, "table": spec.table, "table_grad": spec.table and spec.table_grad,
            "out_dim": LAYOUT_DIM[spec.layout]}


def model_features(spec: ModelSpec) -> set[str]:
    """Names of what this model exercises (for the statistics and the KNOWN table)."""
    out = {layer.op for layer in spec.layers}
    for layer in spec.layers:
        if layer.frozen and OPS[layer.op][0]:
            out.add("frozen")
        if layer.op == "batchnorm" and layer.arg % 2:
            out.add("batchnorm_untracked")
        if layer.op == "instancenorm" and layer.arg % 2:
            out.add("instancenorm_tracked")
        if layer.op == "dropout" and layer.flag:
            out.add("dropout_p")
        if layer.op == "linear" and not layer.flag:
            out.add("linear_nobias")
        if (layer.op, layer.arg % 4) in (("batchnorm", 2), ("instancenorm", 3)):
            out.add("state_read")  # running statistics read after the write, in the same forward
        if layer.op == "mul_" and layer.flag:
            out.add("view_write")
    alias = {0} if not spec.tokens and not spec.table else set()  # values that are the caller's input tensor itself
    for i, layer in enumerate(spec.layers, 1):
        if OPS[layer.op][1] and min(layer.src, i - 1) in alias:
            alias.add(i)
            out.add("inplace_input")
        elif layer.op == "dropout" and not layer.flag and min(layer.src, i - 1) in alias:
            alias.add(i)  # Dropout(0.0) returns its input itself (eager and captured alike)
    for name in ("tokens", "sparse", "padding_idx", "tied_head", "kwarg", "input_grad"):
        if getattr(spec, name) and (name == "tokens" or spec.tokens or name in ("kwarg", "input_grad")):
            out.add(name)
    if spec.input_grad and spec.tokens:
        out.discard("input_grad")
    if spec.tied_head and not spec.tokens:
        out.discard("tied_head")
    out.add(f"out_{spec.outputs}")
    if spec.table:
        out.add("table_grad" if spec.table_grad else "table")
    if spec.aux and spec.outputs != "tensor":
        out.add("aux_scalar")
    n = len(spec.layers)
    live = {n} | ({n // 2} if spec.outputs != "tensor" else set())
    for i in range(n, 0, -1):  # values no output depends on (in-place writes count as used)
        layer = spec.layers[i - 1]
        if i in live or OPS[layer.op][1] or layer.op == "ema":
            live |= {min(layer.src, i - 1)} | ({min(layer.arg, i - 1)} if layer.op in ("add", "add_") else set())
    if any(i not in live and OPS[spec.layers[i - 1].op][0] for i in range(1, n + 1)):
        out.add("dead_code")
    if any(OPS[layer.op][1] for layer in spec.layers):
        out.add("inplace")
    if any(layer.op in ("ema", "clamp_w") or (layer.op == "batchnorm" and layer.arg % 2 == 0)
           or (layer.op == "instancenorm" and layer.arg % 2) for layer in spec.layers):
        out.add("state_write")  # a buffer or parameter written in place inside forward (running stats too)
    if writes_buffers(spec.layers):
        out.add("buffer_write")
    linears = {i for i, x in enumerate(spec.layers, 1) if x.op == "linear"}
    if ("tied_head" in out or any(x.op == "wsum" for x in spec.layers) or any(
            x.op in ("shared_w", "reuse") and linears & set(range(1, i)) for i, x in enumerate(spec.layers, 1))):
        out.add("shared")  # a weight two ops read (a tied head, a module called twice, F.linear on its
        # weight without its bias) or two weights summed before use
    if spec.layout != "bt":
        out |= {"non_batch_first", f"layout_{spec.layout}"}
    return out


# ops that keep a stage off compiled F/I/W graphs and CUDA graph slots (compile_limits.unsupported): random
# ops, writes in place, state written in the forward, BatchNorm over a transposed input (runs eager)
NOT_GRAPHED = frozenset({"dropout", "relu_", "add_", "mul_", "ema", "clamp_w", "batchnorm", "instancenorm"})


def writes_buffers(layers: tuple[Layer, ...]) -> bool:
    """A layer updates a buffer in place in the forward (an EMA, running statistics)."""
    return any(x.op == "ema" or (x.op == "batchnorm" and x.arg % 2 == 0) or (x.op == "instancenorm" and x.arg % 2)
               for x in layers)


def draw_model(pick: Callable[[Any], Any], integer: Callable[[int, int], int], ops: tuple[str, ...],
               max_layers: int = 8, force: frozenset[str] = frozenset()) -> ModelSpec:
    """A random model from ``pick(sequence)`` and ``integer(lo, hi)`` (hypothesis or a seeded random).

    ``force`` names model features the draw must have (tests/fuzz/coverage.py picks them so that every
    pair of features is reached): "dropout" (p > 0), "buffer_write", "shared" (a weight read by two ops
    or two ways), "input_grad", "non_batch_first" (sequence-first or flattened outputs); "graphed" keeps
    off the ops that stop compiled F/I/W graphs."""
    if "graphed" in force:
        ops = tuple(op for op in ops if op not in NOT_GRAPHED)
    n = integer(1, max_layers)
    layers = []
    for i in range(1, n + 1):
        op = pick(ops)
        layers.append(Layer(op, src=integer(0, i - 1), arg=integer(0, i - 1), flag=pick((False, True)),
                            frozen=integer(0, 5) == 5))

    def put(layer: Layer) -> None:  # last, reading the last value: on the way to the output, so it counts
        layers.append(Layer(layer.op, src=len(layers), arg=layer.arg, flag=layer.flag))

    if "dropout" in force and not any(x.op == "dropout" and x.flag for x in layers):
        put(Layer("dropout", flag=True))
    if "buffer_write" in force and not writes_buffers(tuple(layers)):
        op = pick(("ema", "batchnorm", "batchnorm", "instancenorm"))  # each with running state it writes
        # running statistics read again after the write (arg 2, 3; the drawn layers have the plain norms too)
        put(Layer(op, arg=3 if op == "instancenorm" else 2 if op == "batchnorm" else 0, flag=pick((False, True))))
    shared = "shared" in force and pick(("tied_head", "shared_w", "wsum"))
    if shared in ("shared_w", "wsum"):
        if shared == "shared_w" and not any(x.op == "linear" for x in layers):
            put(Layer("linear", flag=True))
        layers.append(Layer(shared, src=len(layers), arg=integer(0, 7), flag=pick((False, True))))
    if "graphed" in force:  # compiled stages: weights their F/I/W graphs treat apart (tests/fuzz/mutants.py M15, M16)
        if not any(x.op == "wsum" for x in layers) and pick((False, True)):
            put(Layer("wsum"))  # h * (w1 + w2): autograd hands one gradient tensor to both weights
        if not any(x.op == "detached" for x in layers) and pick((False, True)):  # a weight no gradient reaches
            layers.append(Layer("detached", src=len(layers), arg=integer(0, len(layers)), flag=pick((False, True))))
    # a value made from the float input alone at the front, read again by a last layer: the planner may rebuild
    # it in a later stage rather than receive it (recompute="auto"), which it must not do for a random op's
    # result or for a value written in place (through a view) after it was made (tests/fuzz/mutants.py M24, M25)
    bait = shared != "tied_head" and "input_grad" not in force and integer(0, 2) == 2
    if bait:
        kind = pick(("gate", "act") if "graphed" in force else ("dropout", "gate", "act"))
        layers[0] = Layer(kind, 0, arg=integer(0, 3), flag=True)
        if kind != "dropout" and "graphed" not in force and n > 1 and pick((False, True)):  # a drawn layer
            layers[1] = Layer("mul_", 1, flag=True)
        layers.append(Layer("add", src=len(layers), arg=1))
    tokens = not bait and (shared == "tied_head" or ("input_grad" not in force and pick((False, True))))
    sparse = tokens and "graphed" not in force and integer(0, 3) == 3
    layout = (pick(("tb", "flat", "tflat")) if "non_batch_first" in force else
              ("bt", "bt", "bt", "bt", "tb", "flat", "tflat")[integer(0, 6)])
    return ModelSpec(tuple(layers), tokens=tokens, sparse=sparse,
                     padding_idx=tokens and pick((False, True)), tied_head=tokens and (shared == "tied_head" or pick(
                         (False, True))), kwarg=pick((False, True)),
                     input_grad=not tokens and ("input_grad" in force or (not bait and integer(0, 2) == 2)),
                     outputs=pick(("tensor", "tuple", "dict")), table=integer(0, 3) == 3,
                     table_grad=pick((False, True)), aux=pick((False, True)), layout=layout)
