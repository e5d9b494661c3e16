"""What a pipeline step must equal: gradient accumulation over the same microbatches on the model."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

import pipesplit
from pipesplit.rng import random_stream, stream_seed
from tests.close import assert_close, assert_grads_close


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position of a language model's logits."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def dot_loss(out: Any, target: Any) -> torch.Tensor:
    """A sum over every float output element times the matching target element."""
    total = 0.0
    for o, t in zip(pytree.tree_leaves(out), pytree.tree_leaves(target)):
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            total = total + (o.float() * t).sum()
    return total  # type: ignore[return-value]


def make_target(out: Any) -> Any:
    """A random weight for every float output element (zeros for other tensors)."""
    return pytree.tree_map(
        lambda o: (torch.randn(o.shape) if o.is_floating_point() else torch.zeros(o.shape))
        if isinstance(o, torch.Tensor) else o, out
    )


def chunk_tree(tree: Any, m: int, batch_dim: int = 0) -> list[Any]:
    """``m`` pytrees, each tensor leaf cut along ``batch_dim``."""
    leaves, spec = pytree.tree_flatten(tree)
    cut = [x.chunk(m, dim=batch_dim) if isinstance(x, torch.Tensor) and x.dim() > batch_dim else [x] * m
           for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in cut], spec) for i in range(m)]


def chunk_inputs(args: tuple, kwargs: dict, m: int, batch_dim: int = 0, unbatched: tuple[str, ...] = ()) -> list:
    """Split tensors with a batch dimension into ``m`` microbatches; everything else is shared."""
    def cut(x: Any) -> Any:
        return x.chunk(m, dim=batch_dim) if isinstance(x, torch.Tensor) and x.dim() > batch_dim else [x] * m

    arg_pieces = [cut(a) for a in args]
    kw_pieces = {k: ([v] * m if k in unbatched else cut(v)) for k, v in kwargs.items()}
    return [(tuple(p[i] for p in arg_pieces), {k: p[i] for k, p in kw_pieces.items()}) for i in range(m)]


def accumulate(model: torch.nn.Module, args: tuple, kwargs: dict, target: Any, m: int,
               loss_fn: Callable[[Any, Any], torch.Tensor] = dot_loss, **cut: Any) -> torch.Tensor:
    """Run ``model`` microbatch by microbatch, summing the losses and accumulating gradients."""
    total = torch.zeros(())
    for (a, k), t in zip(chunk_inputs(args, kwargs, m, **cut), chunk_tree(target, m)):
        loss = loss_fn(model(*a, **k), t)
        loss.backward()
        total = total + loss.detach().float()
    return total


def accumulate_tree(model: torch.nn.Module, args: tuple, kwargs: dict, target: Any, m: int) -> torch.Tensor:
    """:func:`accumulate` with every tensor cut, those nested in lists and dicts too (``dot_loss``)."""
    total = torch.zeros(())
    for (a, k), t in zip(chunk_tree((args, kwargs), m), chunk_tree(target, m)):
        loss = dot_loss(model(*a, **k), t)
        loss.backward(retain_graph=True)  # inputs computed outside share their graph between microbatches
        total = total + loss.detach().float()
    return total


def check_training(model: torch.nn.Module, pipe: pipesplit.Pipeline, batches: list[tuple[tuple, dict]], *,
                   m: int, steps: int = 2, rtol: float | None = None, ref_kwargs: dict | None = None,
                   **cut: Any) -> None:
    """``steps`` optimizer steps through ``pipe`` equal the same steps of accumulation on a copy of
    ``model``: the loss, every gradient, every buffer (BatchNorm stats) and the updated parameters.
    ``ref_kwargs`` go to the reference model only (``use_cache=False``, which pipesplit adds itself)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(steps):
        args, kwargs = batches[step % len(batches)]
        ref_kw = {**kwargs, **(ref_kwargs or {})}
        with torch.no_grad():
            target = make_target(copy.deepcopy(ref)(*args, **ref_kw))
        want = accumulate(ref, args, ref_kw, target, m, **cut)
        got = pipe.step(*args, target=target, **kwargs)
        assert_close(got.float(), want, name=f"loss at step {step}", rtol=rtol)
        assert_grads_close(pipe.named_parameters(), ref, rtol=rtol)
        state = pipe.prog.state_dict()
        for name, buf in ref.state_dict().items():
            assert_close(state[name], buf, name=f"{name} at step {step}", rtol=rtol)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    held = dict(pipe.named_parameters())
    floor = 1e-4 * max(torch.linalg.vector_norm(p.detach().double()).item() for p in ref.parameters())
    for name, p in ref.named_parameters():
        assert_close(held[name].detach(), p.detach(), name=f"{name} after {steps} steps", rtol=rtol, scale=floor)


class StreamedRoot(fx.Interpreter):
    """The split program run stage after stage, stage ``s`` drawing from the random stream of
    (step seed, s, microbatch): an independent reference for what the pipeline runtime computes."""

    def __init__(self, prog: pipesplit.SplitProgram, seed: int, microbatch: int):
        super().__init__(prog.root)
        self.seed, self.microbatch = seed, microbatch

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        stage = int(str(target).rsplit("_", 1)[1])
        with random_stream(stream_seed(self.seed, stage, self.microbatch)):
            return super().call_module(target, args, kwargs)


def streamed_reference(prog: pipesplit.SplitProgram, args: tuple, kwargs: dict, target: Any, m: int,
                       seed: int) -> torch.Tensor:
    """Loss and gradients (into ``prog``'s parameters) of the stages run one after another per microbatch."""
    total = torch.zeros(())
    for i, ((a, k), t) in enumerate(zip(chunk_inputs(args, kwargs, m), chunk_tree(target, m))):
        flat = prog.flatten_inputs(a, k)
        prog.sync_tied()
        out = pytree.tree_unflatten(prog.assemble_outputs(StreamedRoot(prog, seed, i).run(*flat)), prog.out_spec)
        loss = dot_loss(out, t)
        loss.backward()
        total = total + loss.detach()
    return total
