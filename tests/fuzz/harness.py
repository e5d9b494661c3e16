"""One fuzz case: a model trained through pipesplit against a deep copy trained by gradient
accumulation over the same microbatches. Imports only torch and pipesplit: a repro script
carries this file's text whole.

What is compared, step by step: the loss, every parameter gradient, the input's gradient,
every buffer, and the parameters after one optimizer step (SGD with momentum or AdamW with
weight decay); then outputs in train mode (``pipe(x)``), in eval mode (``pipe.eval(x)``,
a second Pipeline for eval, ``prog.eval(); prog(x)``). A model with dropout (p > 0) is not
compared bit for bit with the plain model: pipesplit draws each (stage, microbatch) mask
from its own stream (pipesplit/rng.py), so its training step is compared with the split
program run stage after stage on those same streams, and its eval outputs with the model.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

import pipesplit
from pipesplit.rng import random_stream, stream_seed

LOSS_FLOOR = 0.0  # a float64 rerun sets 1: gradients compare against at least |loss| (see check.rounding)
RTOL = 5e-4  # relative norm: float32 sums in another order reach ~1e-4 where activations grow large (x 2 in
# place, repeated); a gradient 0.1% off is still caught


class Invalid(Exception):
    """The plain model itself fails on this case (e.g. autograd refuses an in-place write): no test."""


class Refused(Exception):
    """pipesplit refused the case with a PipesplitError: allowed, counted, not a failure."""


def close(name: str, got: Any, want: Any, floor: float = 0.0, rtol: float | None = None) -> None:
    rtol = RTOL if rtol is None else rtol  # read at each call: a float64 rerun tightens it
    if not isinstance(want, torch.Tensor):
        assert got == want, f"{name}: {got!r} != {want!r}"
        return
    assert isinstance(got, torch.Tensor), f"{name}: expected a tensor, got {got!r}"
    got, want = (t.detach().to_dense() if t.is_sparse else t.detach() for t in (got, want))
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not want.is_floating_point():
        assert torch.equal(got, want), f"{name}: integer values differ: {got.tolist()} vs {want.tolist()}"
        return
    diff = torch.linalg.vector_norm(got.double() - want.double()).item()
    den = max(torch.linalg.vector_norm(want.double()).item(), torch.linalg.vector_norm(got.double()).item(), floor)
    err = 0.0 if den == 0.0 else diff / den
    assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol:g} (|diff| {diff:.3g}, |want| {den:.3g})"


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


def chunks(args: tuple, kw: dict, target: Any, m: int) -> list[tuple[tuple, dict, Any]]:
    """m microbatches: the first input, the kwargs and the target cut along dim 0; the other positional
    inputs (a table) and 0-dim target leaves (an auxiliary scalar's) whole to each."""
    def cut(tree: Any) -> list[Any]:
        leaves, spec = pytree.tree_flatten(tree)
        parts = [x.chunk(m) if x.dim() else [x] * m for x in leaves]
        return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(m)]
    cuts = cut((args[:1], kw))
    return [((*a, *args[1:]), k, t) for (a, k), t in zip(cuts, cut(target) if target is not None else [None] * m)]


def reference_step(ref: torch.nn.Module, args: tuple, kw: dict, target: Any, m: int,
                   loss_fn: Callable[[Any, Any], torch.Tensor] = dot_loss, scale: float = 1.0) -> torch.Tensor:
    """Gradient accumulation over m microbatches, each loss times ``scale`` (1/m for a mean)."""
    total = torch.zeros(())
    try:
        for a, k, t in chunks(args, kw, target, m):
            loss = loss_fn(ref(*a, **k), t) * scale
            loss.backward()
            total = total + loss.detach()
    except Exception as e:  # the plain model cannot run this case: not a test of pipesplit
        raise Invalid(f"{type(e).__name__}: {e}") from e
    return total


def reference_forward(ref: torch.nn.Module, args: tuple, kw: dict, m: int) -> Any:
    with torch.no_grad():
        outs = [ref(*a, **k) for a, k, _ in chunks(args, kw, None, m)]
    leaves = [pytree.tree_flatten(o)[0] for o in outs]  # a 0-dim output: the microbatches' mean, as pipesplit merges it
    return pytree.tree_unflatten([torch.cat(col) if col[0].dim() else torch.stack(col).mean() for col in zip(*leaves)],
                                 pytree.tree_flatten(outs[0])[1])


class _Streamed(fx.Interpreter):
    """The split program's root, stage ``s`` drawing from the stream (step seed, s, microbatch)."""

    def __init__(self, prog: Any, seed: int, microbatch: int):
        super().__init__(prog.root)
        self.seed, self.microbatch = seed, microbatch

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        with random_stream(stream_seed(self.seed, int(str(target).rsplit("_", 1)[1]), self.microbatch)):
            return super().call_module(target, args, kwargs)


def streamed_step(prog: Any, args: tuple, kw: dict, target: Any, m: int, seed: int,
                  loss_fn: Callable[[Any, Any], torch.Tensor] = dot_loss, scale: float = 1.0) -> torch.Tensor:
    total = torch.zeros(())
    for i, (a, k, t) in enumerate(chunks(args, kw, target, m)):
        prog.sync_tied()
        flat = _Streamed(prog, seed, i).run(*prog.flatten_inputs(a, k))
        loss = loss_fn(pytree.tree_unflatten(prog.assemble_outputs(flat), prog.out_spec), t) * scale
        loss.backward()
        total = total + loss.detach()
    return total


def optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad] or [torch.zeros(1, requires_grad=True)]  # all frozen
    if kind == "adamw":  # eps well above rounding noise: a gradient that is ~0 must not become +-lr
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9 if kind == "sgd" else 0.0)


def compare_step(step: int, loss: Any, want: torch.Tensor, held: dict, ref: torch.nn.Module,
                 state: dict, x: Any, x_ref: Any, table: Any = None, table_ref: Any = None) -> None:
    close(f"loss at step {step}", loss, want)
    ref_params = dict(ref.named_parameters())
    norms = [p.grad.to_dense().double().norm().item() for p in ref_params.values() if p.grad is not None]
    floor = 1e-3 * max(norms, default=0.0)  # a gradient that is 0 up to rounding (a bias before a norm) is noise
    floor = max(floor, LOSS_FLOOR * abs(float(want)))  # and where every gradient is (a norm cancels them all)
    for name, p in held.items():
        g = ref_params[name].grad
        if g is None:
            assert p.grad is None or not p.grad.to_dense().any(), f"step {step}: {name} has a gradient, the model none"
        else:
            assert p.grad is not None, f"step {step}: no gradient for {name}"
            close(f"gradient of {name} at step {step}", p.grad, g, floor)
    if x_ref is not None:
        assert x.grad is not None, f"step {step}: the input's gradient is None (the model computes it)"
        close(f"input gradient at step {step}", x.grad, x_ref.grad)
    if table_ref is not None:  # an input without a batch dimension: its gradient sums over the microbatches
        assert table.grad is not None, f"step {step}: the table input's gradient is None (the model computes it)"
        close(f"table input gradient at step {step}", table.grad, table_ref.grad)
    ref_state = ref.state_dict()
    floor = 1e-4 * max((t.double().norm().item() for t in ref_state.values() if t.is_floating_point()), default=0.0)
    for name in state:
        close(f"{name} after step {step}", state[name], ref_state[name], floor)


def held_state(pipe: Any) -> dict:
    """The program's state this process holds (under torchrun a rank's copy of other stages is stale)."""
    state = pipe.prog.state_dict()
    if pipe.executor == "local":
        return state
    names = {pipe.prog.state_entry(i).name for s in pipe.workers for i in pipe.prog.stage_entries[s]}
    return {k: v for k, v in state.items() if k in names}


GRAPH_REPLAYS = 0  # emulated CUDA graph replays so far (the fuzzer counts the cases that replayed any)


def run_case(make_model: Callable[[], torch.nn.Module], io: dict, cfg: dict, mesh: Any = None) -> None:
    """Raises AssertionError on a difference, Refused on a PipesplitError, Invalid if the model fails.
    ``cfg["graphs"]``: compiled stages replay CUDA graph slots, emulated on CPU (a replay overwrites its
    outputs in place, as a CUDA graph's does: pipesplit/runtime/graphs/cuda_graphs.py)."""
    if not cfg.get("graphs"):
        return _run_case(make_model, io, cfg, mesh)
    from pipesplit.runtime.graphs import cuda_graphs

    class Counted(cuda_graphs.EmulatedCapture):
        def replay(self, graph: Any) -> None:
            global GRAPH_REPLAYS
            GRAPH_REPLAYS += 1
            super().replay(graph)

    real = cuda_graphs.backend_for
    cuda_graphs.backend_for = lambda device: Counted()
    try:
        return _run_case(make_model, io, cfg, mesh)
    finally:
        cuda_graphs.backend_for = real


def _run_case(make_model: Callable[[], torch.nn.Module], io: dict, cfg: dict, mesh: Any = None) -> None:
    torch.manual_seed(cfg["seed"])
    model = make_model()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(cfg["seed"])
    m, dp = cfg["m"], (mesh["dp"].size() if mesh is not None and "dp" in mesh.mesh_dim_names else 1)
    # the loss function may train a scale of its own, outside the model: each side has its copy
    scale_p, scale_r = (torch.tensor(1.5, requires_grad=True) for _ in range(2)) if cfg.get("loss_param") else (None, None)
    loss_p, loss_r = (dot_loss, dot_loss) if scale_p is None else \
        (lambda o, t: dot_loss(o, t) * scale_p, lambda o, t: dot_loss(o, t) * scale_r)
    try:
        ex_args, ex_kw = make_inputs(io, cfg["example_batch"], gen)
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # under torchrun a cut the
            # example compiled without a gradient is refused, not grown: the example requires grad as inputs will
            ex_args, ex_kw = fresh(ex_args, ex_kw, io["input_grad"], io.get("table_grad", False))
        planned = cfg["checkpoint"] and cfg.get("checkpoint_plan", False)  # the plan names the stages
        ckpt = [s for s in range(cfg["stages"]) if cfg.get("checkpoint_mask", 0) >> s & 1] if planned else None
        prog = pipesplit.compile(model, ex_args, example_kwargs=ex_kw, num_stages=cfg["stages"], cost=cfg["cost"],
                                 order=cfg["order"], recompute=cfg["recompute"], progress=False,
                                 unbatched=["pos"] if io.get("table") else (), checkpoint=ckpt)
        pipe = pipesplit.Pipeline(prog, cfg["schedule"], num_microbatches=m, loss_fn=loss_p, target_batch_dim=0,
                                  loss_reduction=cfg.get("reduction", "sum"),
                                  checkpoint=None if planned else cfg["checkpoint"], transport=cfg["transport"],
                                  timeout=60, mesh=mesh,
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
            shapes = copy.deepcopy(ref)(*fresh(args, kw, False)[0], **fresh(args, kw, False)[1])
        target = pytree.tree_map(lambda o: torch.randn(o.shape, generator=gen), shapes)
        tg = io.get("table_grad", False)
        r_args, r_kw = fresh(args, kw, io["input_grad"], tg)
        p_args, p_kw = fresh(args, kw, io["input_grad"], tg)
        if io["dropout"]:  # Invalid if the model cannot train
            reference_step(copy.deepcopy(ref), r_args, r_kw, target, m * dp, loss_r, scale)
        torch.manual_seed(1000 + step)
        seed = int(torch.randint(0, 2**62, ()).item())  # the draw pipe.step makes for its streams
        torch.manual_seed(1000 + step)
        if io["dropout"]:  # masks from pipesplit's streams: compare with the stages run in turn on them
            before = {k: v.clone() for k, v in prog.state_dict().items()}  # the stages run again from here
            try:
                loss = pipe.step(*p_args, target=target, **p_kw)
            except pipesplit.PipesplitError as e:
                raise Refused(f"{type(e).__name__} at step {step}: {e}") from e
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in held.items()}
            pipe.zero_grad()
            with torch.no_grad():
                for k, v in prog.state_dict().items():
                    v.copy_(before[k])
            s_args, s_kw = fresh(args, kw, io["input_grad"], tg)  # a model without parameters needs a graph too
            scale_s = None if scale_p is None else scale_p.detach().clone().requires_grad_()  # its own leaf
            want = streamed_step(prog, s_args, s_kw, target, m, seed, loss_p if scale_s is None else
                                 lambda o, t: dot_loss(o, t) * scale_s, scale)
            close("loss (dropout, streamed)", loss, want)
            if tg:
                close("table input gradient (dropout, streamed)", p_args[1].grad, s_args[1].grad)
            for n, p in held.items():
                if p.grad is not None:
                    close(f"gradient of {n} (dropout, streamed)", grads[n], p.grad, max(1e-4 * max(
                        (q.grad.to_dense().norm().item() for q in held.values() if q.grad is not None), default=0),
                        LOSS_FLOOR * abs(float(want))))  # the float64 rerun's floor, as compare_step's
            with torch.no_grad():  # the statistics the masks gave, so that eval compares the same state
                ref.load_state_dict(prog.state_dict(), strict=False)
            break
        want = reference_step(ref, r_args, r_kw, target, m * dp, loss_r, scale)
        try:
            loss = pipe.step(*p_args, target=target, **p_kw)
        except pipesplit.PipesplitError as e:
            raise Refused(f"{type(e).__name__} at step {step}: {e}") from e
        state = held_state(pipe)
        compare_step(step, loss, want, held, ref, state, p_args[0] if io["input_grad"] else None,
                     r_args[0] if io["input_grad"] else None, p_args[1] if tg else None, r_args[1] if tg else None)
        if scale_p is not None and runs_loss:  # under torchrun the rank holding the last stage runs the loss
            assert scale_p.grad is not None, f"step {step}: the loss function's own scale got no gradient"
            close(f"gradient of the loss function's scale at step {step}", scale_p.grad, scale_r.grad)
        if cfg["no_zero_grad"] and step == 0:
            continue  # the second step accumulates into the first one's gradients
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        ref_params = dict(ref.named_parameters())
        floor = 1e-4 * max((q.detach().double().norm().item() for q in ref_params.values()), default=0.0)
        for name, p in held.items():  # a bias at ~0 moved by a ~0 gradient compares against its neighbours' scale
            close(f"{name} after the optimizer step {step}", p, ref_params[name], floor)
        if scale_p is not None and runs_loss:
            close(f"the loss function's scale after the optimizer step {step}", scale_p, scale_r)
    check_outputs(cfg, io, ref, pipe, eval_pipe, prog, gen)


def check_outputs(cfg: dict, io: dict, ref: torch.nn.Module, pipe: Any, eval_pipe: Any, prog: Any,
                  gen: torch.Generator) -> None:
    """Outputs after training: ``pipe(x)`` (train mode), ``pipe.eval(x)`` or ``prog.eval(); prog(x)``."""
    mode, n = cfg["eval"], (eval_pipe.num_microbatches if cfg["eval"] == "pipe" else
                            pipe.num_microbatches if cfg["eval"] == "train_forward" else 1)
    args, kw = make_inputs(io, cfg["mb2"] * n * (getattr(pipe, "dp_size", 1) if mode != "prog" else 1), gen)
    try:
        if mode == "train_forward" and not io["dropout"]:
            got = pipe(*fresh(args, kw, False)[0], **kw)
            if got is not None:
                close_tree("pipe(x) in train mode", got, reference_forward(ref, fresh(args, kw, False)[0], kw, n))
        if mode == "pipe":
            got = eval_pipe.eval(*fresh(args, kw, False)[0], **kw)
            if got is not None:
                close_tree("pipe.eval(x)", got, reference_forward(ref.eval(), fresh(args, kw, False)[0], kw, n))
            ref.train()
        if mode == "prog":
            prog.eval()
            got = prog(*fresh(args, kw, False)[0], **kw)
            close_tree("prog.eval(); prog(x)", got, reference_forward(ref.eval(), fresh(args, kw, False)[0], kw, 1))
            prog.train(), ref.train()
    except pipesplit.PipesplitError as e:
        raise Refused(f"{type(e).__name__} in {mode}: {e}") from e
    if mode != "none" and pipe.executor == "local":
        state, ref_state = prog.state_dict(), ref.state_dict()
        for name in state:
            close(f"{name} after {mode}", state[name], ref_state[name], floor=1e-4)  # rounding on near-zero entries
