"""One fuzz case: a model trained through pipesplit against a deep copy trained by gradient
accumulation over the same microbatches. Imports only torch and pipesplit: a repro script
carries this file's text whole.

What is compared, step by step: the loss, every parameter gradient, the input's gradient,
every buffer, and the parameters after one optimizer step (SGD with momentum or AdamW with
weight decay); then outputs in train mode (``pipe(x)``), in eval mode (``pipe.eval(x)``,
a second Pipeline for eval, ``prog.eval(); prog(x)``). Every case runs in float64 (the caller
sets the default dtype) and each tensor is held to ``RTOL`` relative, plus an absolute floor at
float64's rounding (``NOISE`` times the scale of its kind: a gradient that is zero up to rounding
is noise in both runs). A model with dropout (p > 0) trains the plain model too: pipesplit draws
each (stage, microbatch) mask from its own stream (pipesplit/rng.py), and the reference's dropout
modules draw from the same streams (:class:`Streams`: the stage each one runs in is read off the
capture), so the split program itself is not the reference.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

import pipesplit
from pipesplit.rng import seeded, stream_seed

RTOL = 1e-10  # relative norm of the difference, per tensor, in float64: sums in another order (a compiled
# stage, gradients accumulated in another order) stay below ~1e-12 on these models; a defect is far above
NOISE = 1e-12  # absolute floor, times the scale of a tensor's kind (|loss| for a gradient, the largest
# buffer for a buffer): rounding on a value that is zero in exact arithmetic, and nothing larger
MAX_ERR = [0.0]  # the largest relative error seen that passed (the fuzzer prints it: how tight RTOL is)
MAX_AT = [""]  # the name of the tensor that had it (the fuzzer names its case too)
FAILED: list = [0.0, ""]  # the last failed comparison's relative error and tensor (tests/fuzz/conditioning.py)


class Invalid(Exception):
    """The plain model itself fails on this case (e.g. autograd refuses an in-place write): no test."""


class Refused(Exception):
    """pipesplit refused the case with a PipesplitError: allowed, counted, not a failure."""


def close(name: str, got: Any, want: Any, scale: float = 1.0) -> None:
    """``got`` equals ``want`` to RTOL relative (norm of the difference over the larger norm), with an
    absolute floor of NOISE * max(1, scale)."""
    if not isinstance(want, torch.Tensor):
        assert got == want, f"{name}: {got!r} != {want!r}"
        return
    assert isinstance(got, torch.Tensor), f"{name}: expected a tensor, got {got!r}"
    got, want = (t.detach().to_dense() if t.is_sparse else t.detach() for t in (got, want))
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not want.is_floating_point():
        assert torch.equal(got, want), f"{name}: integer values differ: {got.tolist()} vs {want.tolist()}"
        return
    assert torch.isfinite(want).all(), f"{name}: the plain model's value is not finite"
    diff = torch.linalg.vector_norm(got.double() - want.double()).item()
    den = max(torch.linalg.vector_norm(want.double()).item(), torch.linalg.vector_norm(got.double()).item())
    atol = NOISE * max(1.0, scale)
    err = 0.0 if diff <= atol else diff / max(den, 1e-300)
    if err > RTOL:
        FAILED[:] = [err, name]
    assert err <= RTOL, (f"{name}: relative error {err:.3g} > {RTOL:g} (|diff| {diff:.3g}, |want| {den:.3g}, "
                         f"floor {atol:.3g})")
    if err > MAX_ERR[0]:
        MAX_ERR[0], MAX_AT[0] = err, name


def close_tree(name: str, got: Any, want: Any) -> None:
    g, gs = pytree.tree_flatten(got)
    w, ws = pytree.tree_flatten(want)
    assert gs == ws, f"{name}: structure {gs} != {ws}"
    for i, (a, b) in enumerate(zip(g, w)):
        close(f"{name}[{i}]", a, b)


def make_inputs(io: dict, batch: int, gen: torch.Generator) -> tuple[tuple, dict]:
    if io["tokens"]:
        x = torch.randint(0, io["vocab"], (batch, io["seq"]), generator=gen)
    else:
        x = torch.randn(batch, io["seq"], io["dim"], generator=gen)
    kw = {"gate": torch.randn(batch, io["seq"], io["dim"], generator=gen)} if io["kwarg"] else {}
    if io.get("table"):  # a (T, D) table without a batch dimension: every microbatch reads it whole
        return (x, torch.randn(io["seq"], io["dim"], generator=gen)), kw
    return (x,), kw


def fresh(args: tuple, kw: dict, grad: bool, table_grad: bool = False) -> tuple[tuple, dict]:
    """Copies of the inputs (a model may write them in place); the first one a leaf needing grad
    (``grad``), the table (the second) one too with ``table_grad``."""
    args = tuple(a.clone().requires_grad_((grad and i == 0) or (table_grad and i == 1)) for i, a in enumerate(args))
    return args, {k: v.clone() for k, v in kw.items()}


def dot_loss(out: Any, target: Any) -> torch.Tensor:
    total: Any = 0.0
    for o, t in zip(pytree.tree_leaves(out), pytree.tree_leaves(target)):
        total = total + (o.to(t.dtype) * t).sum()
    return total


def chunks(args: tuple, kw: dict, target: Any, m: int, tdim: int = 0) -> list[tuple[tuple, dict, Any]]:
    """m microbatches: the first input and the kwargs cut along dim 0, the target along ``tdim`` (the
    outputs' batch dimension); the other positional inputs (a table) and 0-dim target leaves (an
    auxiliary scalar's) whole to each."""
    def cut(tree: Any, dim: int) -> list[Any]:
        leaves, spec = pytree.tree_flatten(tree)
        parts = [x.chunk(m, dim) if x.dim() else [x] * m for x in leaves]
        return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(m)]
    cuts = cut((args[:1], kw), 0)
    return [((*a, *args[1:]), k, t) for (a, k), t in zip(cuts, cut(target, tdim) if target is not None else [None] * m)]


def reference_step(ref: torch.nn.Module, args: tuple, kw: dict, target: Any, m: int,
                   loss_fn: Callable[[Any, Any], torch.Tensor] = dot_loss, scale: float = 1.0, tdim: int = 0,
                   streams: "Streams | None" = None) -> torch.Tensor:
    """Gradient accumulation over m microbatches, each loss times ``scale`` (1/m for a mean); dropout
    drawing from ``streams`` where given."""
    total = torch.zeros(())
    try:
        for i, (a, k, t) in enumerate(chunks(args, kw, target, m, tdim)):
            if streams is not None:
                streams.microbatch(i)
            loss = loss_fn(ref(*a, **k), t) * scale
            loss.backward()
            total = total + loss.detach()
    except Exception as e:  # the plain model cannot run this case: not a test of pipesplit
        raise Invalid(f"{type(e).__name__}: {e}") from e
    return total


def reference_forward(ref: torch.nn.Module, args: tuple, kw: dict, m: int, tdim: int = 0) -> Any:
    """The plain model per microbatch, its outputs joined along ``tdim`` (0-dim ones: the mean)."""
    with torch.no_grad():
        outs = [ref(*a, **k) for a, k, _ in chunks(args, kw, None, m)]
    leaves = [pytree.tree_flatten(o)[0] for o in outs]  # a 0-dim output: the microbatches' mean, as pipesplit merges it
    return pytree.tree_unflatten([torch.cat(col, tdim) if col[0].dim() else torch.stack(col).mean()
                                  for col in zip(*leaves)], pytree.tree_flatten(outs[0])[1])


def dropout_stages(prog: Any) -> dict[str, int]:
    """The stage that runs each random op, by the path of the module the capture saw it in."""
    where = {}
    for stage in prog.stages:
        for node in stage.module.graph.nodes:
            if node.op == "call_function" and node.target is seeded:
                path = list(node.meta.get("nn_module_stack", {}).values())[-1][0]
                assert path not in where, f"{path} runs random ops in two stages"
                where[path] = stage.index
    return where


class Streams:
    """The plain model's dropout modules drawing as pipesplit's stages do (pipesplit/rng.py): in
    microbatch i, the module stage s runs draws from a generator seeded with stream_seed(step seed, s,
    i), continued from the stage's previous random op in that microbatch; torch's own state is put back
    after each, and each draws over its inputs made contiguous as pipesplit does. Only which stage runs which
    module comes from pipesplit; the values are the model's."""

    def __init__(self, model: torch.nn.Module, where: dict[str, int], seed: int):
        self.where, self.seed, self.mb = where, seed, 0
        self.states: dict[int, torch.Tensor] = {}
        self.handles = []
        for name, mod in model.named_modules():
            if name in where:
                self.handles.append(mod.register_forward_pre_hook(self._enter(where[name])))
                self.handles.append(mod.register_forward_hook(self._leave(where[name])))
        missing = set(where) - {n for n, _ in model.named_modules()}
        assert not missing, f"random ops in modules the model does not have: {missing}"
        self.saved: torch.Tensor | None = None

    def microbatch(self, i: int) -> None:
        self.mb, self.states = i, {}

    def _enter(self, stage: int) -> Callable[..., None]:
        def hook(mod: Any, args: Any) -> Any:
            if stage not in self.states:
                self.states[stage] = torch.Generator().manual_seed(stream_seed(self.seed, stage, self.mb)).get_state()
            self.saved = torch.get_rng_state()
            torch.set_rng_state(self.states[stage])
            # pipesplit draws over the values made contiguous (rng.seeded): the masks follow no layout
            return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        return hook

    def _leave(self, stage: int) -> Callable[..., None]:
        def hook(mod: Any, args: Any, out: Any) -> None:
            self.states[stage] = torch.get_rng_state()
            assert self.saved is not None
            torch.set_rng_state(self.saved)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad] or [torch.zeros(1, requires_grad=True)]  # all frozen
    if kind == "adamw":  # eps well above rounding noise: a gradient that is ~0 must not become +-lr
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9 if kind == "sgd" else 0.0)


def compare_step(step: int, loss: Any, want: torch.Tensor, held: dict, ref: torch.nn.Module,
                 state: dict, x: Any, x_ref: Any, table: Any = None, table_ref: Any = None) -> None:
    close(f"loss at step {step}", loss, want)
    ref_params = dict(ref.named_parameters())
    # a gradient that is zero in exact arithmetic is rounding on the scale of the loss and of the largest
    # gradient summed with it (seed 3535: a bias before an InstanceNorm, 6.5e-12 against a loss of 6.5 and
    # gradients of 59); a defect is orders of magnitude above 1e-12 of either
    scale = max([abs(float(want))] + [ref_params[n].grad.double().norm().item() for n in held
                                      if ref_params[n].grad is not None])
    for name, p in held.items():
        g = ref_params[name].grad
        if g is None:
            assert p.grad is None, f"step {step}: {name} has a gradient, the model none (None: an optimizer skips it)"
        else:
            assert p.grad is not None, f"step {step}: no gradient for {name}"
            close(f"gradient of {name} at step {step}", p.grad, g, scale)
    if x_ref is not None:
        assert x.grad is not None, f"step {step}: the input's gradient is None (the model computes it)"
        close(f"input gradient at step {step}", x.grad, x_ref.grad, scale)
    if table_ref is not None:  # an input without a batch dimension: its gradient sums over the microbatches
        assert table.grad is not None, f"step {step}: the table input's gradient is None (the model computes it)"
        close(f"table input gradient at step {step}", table.grad, table_ref.grad, scale)
    ref_state = ref.state_dict()
    for name in state:
        close(f"{name} after step {step}", state[name], ref_state[name], state_scale(ref_state))


def state_scale(state: dict) -> float:
    """The largest floating tensor's norm: a buffer at ~0 (a running mean of centred values) rounds on it."""
    return max((t.double().norm().item() for t in state.values() if t.is_floating_point()), default=0.0)


def held_state(pipe: Any) -> dict:
    """The program's state this process holds (under torchrun a rank's copy of other stages is stale)."""
    state = pipe.prog.state_dict()
    if pipe.executor == "local":
        return state
    names = {pipe.prog.state_entry(i).name for s in pipe.workers for i in pipe.prog.stage_entries[s]}
    return {k: v for k, v in state.items() if k in names}


GRAPH_REPLAYS = 0  # emulated CUDA graph replays so far (the fuzzer counts the cases that replayed any)
FIW_BUILT = 0  # compiled F/I/W graphs built so far (stages that ran as explicit graphs, not eager)


def run_case(make_model: Callable[[], torch.nn.Module], io: dict, cfg: dict, mesh: Any = None) -> None:
    """Raises AssertionError on a difference, Refused on a PipesplitError, Invalid if the model fails.
    ``cfg["graphs"]``: compiled stages replay CUDA graph slots, emulated on CPU (a replay overwrites its
    outputs in place, as a CUDA graph's does: pipesplit/runtime/graphs/cuda_graphs.py)."""
    from pipesplit.runtime.graphs import cuda_graphs, stage_graphs

    class Counted(cuda_graphs.EmulatedCapture):
        def replay(self, graph: Any) -> None:
            global GRAPH_REPLAYS
            GRAPH_REPLAYS += 1
            super().replay(graph)

    def counted_build(*args: Any, **kwargs: Any) -> Any:
        global FIW_BUILT
        FIW_BUILT += 1
        return build(*args, **kwargs)

    real, build = cuda_graphs.backend_for, stage_graphs.build_parts
    if cfg.get("graphs"):
        cuda_graphs.backend_for = lambda device: Counted()
    stage_graphs.build_parts = counted_build
    try:
        return _run_case(make_model, io, cfg, mesh)
    finally:
        cuda_graphs.backend_for, stage_graphs.build_parts = real, build


def _run_case(make_model: Callable[[], torch.nn.Module], io: dict, cfg: dict, mesh: Any = None) -> None:
    torch.manual_seed(cfg["seed"])
    model = make_model()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(cfg["seed"])
    m, dp = cfg["m"], (mesh["dp"].size() if mesh is not None and "dp" in mesh.mesh_dim_names else 1)
    tdim = io.get("out_dim", 0)
    # the loss function may train a scale of its own, outside the model: each side has its copy
    scale_p, scale_r = (torch.tensor(1.5, requires_grad=True) for _ in range(2)) if cfg.get("loss_param") else (None, None)
    loss_p, loss_r = (dot_loss, dot_loss) if scale_p is None else \
        (lambda o, t: dot_loss(o, t) * scale_p, lambda o, t: dot_loss(o, t) * scale_r)
    try:
        ex_args, ex_kw = make_inputs(io, cfg["example_batch"], gen)
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # under torchrun a cut the
            # example compiled without a gradient is refused, not grown: the example requires grad as inputs will
            ex_args, ex_kw = fresh(ex_args, ex_kw, io["input_grad"], io.get("table_grad", False))
            try:  # the plain model on such an example first (a relu_ on an input that requires grad fails there)
                a = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in ex_args)  # leaves, as given
                copy.deepcopy(ref)(*a, **{n: t.detach().clone() for n, t in ex_kw.items()})
            except Exception as e:
                raise Invalid(f"{type(e).__name__}: {e}") from e
        planned = cfg["checkpoint"] and cfg.get("checkpoint_plan", False)  # the plan names the stages
        ckpt: Any = [s for s in range(cfg["stages"]) if cfg.get("checkpoint_mask", 0) >> s & 1] if planned else None
        if planned and cfg.get("checkpoint_partial"):  # each of them recomputes its first block only
            ckpt = {s: 1 for s in ckpt}
        prog = pipesplit.compile(model, ex_args, example_kwargs=ex_kw, num_stages=cfg["stages"], cost=cfg["cost"],
                                 order=cfg["order"], recompute=cfg["recompute"], progress=False,
                                 unbatched=["pos"] if io.get("table") else (), checkpoint=ckpt)
        # which stage runs each random op, read before a distributed Pipeline cuts prog to this rank's stages
        where = dropout_stages(prog) if io["dropout"] else {}
        pipe = pipesplit.Pipeline(prog, cfg["schedule"], num_microbatches=m, loss_fn=loss_p,
                                  loss_reduction=cfg.get("reduction", "sum"), target_batch_dim=tdim,
                                  checkpoint=None if planned else cfg["checkpoint"], transport=cfg["transport"],
                                  timeout=60, mesh=mesh, progress=False,
                                  compile=({"backend": "aot_eager", "mode": "reduce-overhead"} if cfg.get("graphs")
                                           else {"backend": "aot_eager"}) if cfg.get("compile") else False)
        eval_pipe = pipesplit.Pipeline(prog, "gpipe", num_microbatches=1, timeout=60, mesh=mesh) \
            if cfg["eval_pipe"] and cfg["eval"] == "pipe" else pipe
    except pipesplit.PipesplitError as e:
        raise Refused(f"{type(e).__name__}: {e}") from e
    scale = 1.0 / (m * dp) if cfg.get("reduction") == "mean" else 1.0  # what the Pipeline multiplies each loss by
    held = dict(pipe.named_parameters())
    runs_loss = pipe.executor == "local" or prog.num_stages - 1 in pipe.workers
    extra_p, extra_r = ([scale_p], [scale_r]) if scale_p is not None else ([], [])
    opt, opt_ref = optimizer(cfg["opt"], [*held.values(), *extra_p]), optimizer(cfg["opt"], [*ref.parameters(), *extra_r])
    for step, mb in enumerate((cfg["mb"], cfg["mb2"])):
        if step == 1 and cfg["freeze_mid"]:  # freeze the first trainable parameter of both
            name = next((n for n, p in ref.named_parameters() if p.requires_grad), None)
            if name is not None:
                dict(ref.named_parameters())[name].requires_grad_(False)
                if name in held:
                    held[name].requires_grad_(False)
        args, kw = make_inputs({**io, "seq": cfg.get("seq2", io["seq"])} if step else io, mb * m * dp, gen)
        with torch.no_grad():
            shapes = copy.deepcopy(ref).eval()(*fresh(args, kw, False)[0], **fresh(args, kw, False)[1])
        target = pytree.tree_map(lambda o: torch.randn(o.shape, generator=gen), shapes)
        tg = io.get("table_grad", False)
        r_args, r_kw = fresh(args, kw, io["input_grad"], tg)
        p_args, p_kw = fresh(args, kw, io["input_grad"], tg)
        streams = None
        if where:  # masks from pipesplit's streams: the step seed pipe.step draws, then the same streams
            torch.manual_seed(1000 + step)
            streams = Streams(ref, where, int(torch.randint(0, 2**62, ()).item()))
        try:
            want = reference_step(ref, r_args, r_kw, target, m * dp, loss_r, scale, tdim, streams)
        finally:
            if streams is not None:
                streams.remove()
        torch.manual_seed(1000 + step)
        try:
            loss = pipe.step(*p_args, target=target, **p_kw)
        except pipesplit.PipesplitError as e:
            raise Refused(f"{type(e).__name__} at step {step}: {e}") from e
        state = held_state(pipe)
        compare_step(step, loss, want, held, ref, state, p_args[0] if io["input_grad"] else None,
                     r_args[0] if io["input_grad"] else None, p_args[1] if tg else None, r_args[1] if tg else None)
        if scale_p is not None and runs_loss:  # under torchrun the rank holding the last stage runs the loss
            assert scale_p.grad is not None, f"step {step}: the loss function's own scale got no gradient"
            close(f"gradient of the loss function's scale at step {step}", scale_p.grad, scale_r.grad, abs(float(want)))
        if cfg["no_zero_grad"] and step == 0:
            continue  # the second step accumulates into the first one's gradients
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        ref_params = dict(ref.named_parameters())
        pscale = max((q.detach().double().norm().item() for q in ref_params.values()), default=0.0)
        for name, p in held.items():  # a bias at ~0 moved by a ~0 gradient rounds on its neighbours' scale
            close(f"{name} after the optimizer step {step}", p, ref_params[name], pscale)
        if scale_p is not None and runs_loss:
            close(f"the loss function's scale after the optimizer step {step}", scale_p, scale_r)
    check_outputs(cfg, io, ref, pipe, eval_pipe, prog, gen)


def check_outputs(cfg: dict, io: dict, ref: torch.nn.Module, pipe: Any, eval_pipe: Any, prog: Any,
                  gen: torch.Generator) -> None:
    """Outputs after training: ``pipe(x)`` (train mode), ``pipe.eval(x)`` or ``prog.eval(); prog(x)``."""
    tdim = io.get("out_dim", 0)
    mode, n = cfg["eval"], (eval_pipe.num_microbatches if cfg["eval"] == "pipe" else
                            pipe.num_microbatches if cfg["eval"] == "train_forward" else 1)
    # on a mesh the batch is cut into n microbatches per replica: n * dp in all, in order (a BatchNorm in train
    # mode normalises over each microbatch, so the reference must cut as finely)
    n *= getattr(pipe, "dp_size", 1) if mode != "prog" else 1
    args, kw = make_inputs(io, cfg["mb2"] * n, gen)
    try:
        if mode == "train_forward" and not io["dropout"]:
            got = pipe(*fresh(args, kw, False)[0], **kw)
            if got is not None:
                close_tree("pipe(x) in train mode", got, reference_forward(ref, fresh(args, kw, False)[0], kw, n, tdim))
        if mode == "pipe":
            got = eval_pipe.eval(*fresh(args, kw, False)[0], **kw)
            if got is not None:
                close_tree("pipe.eval(x)", got, reference_forward(ref.eval(), fresh(args, kw, False)[0], kw, n, tdim))
            ref.train()
        if mode == "prog":
            prog.eval()
            got = prog(*fresh(args, kw, False)[0], **kw)
            close_tree("prog.eval(); prog(x)", got, reference_forward(ref.eval(), fresh(args, kw, False)[0], kw, 1, tdim))
            prog.train(), ref.train()
    except pipesplit.PipesplitError as e:
        raise Refused(f"{type(e).__name__} in {mode}: {e}") from e
    if mode != "none" and pipe.executor == "local":
        state, ref_state = prog.state_dict(), ref.state_dict()
        for name in state:
            close(f"{name} after {mode}", state[name], ref_state[name], state_scale(ref_state))
