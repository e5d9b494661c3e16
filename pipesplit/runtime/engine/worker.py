"""One rank's interpreter: runs its schedule actions on its stages for one step."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from pipesplit.compat import pytree
from pipesplit.errors import PipesplitError
from pipesplit.passes.split.program import SplitProgram, Stage
from pipesplit.passes.split.sizes import size_key
from pipesplit.rng import random_stream, stream_seed
from pipesplit.runtime.engine.weight_grads import WeightGraph, input_grads, weight_backward, weight_graph
from pipesplit.runtime.graphs.compiled import StageCompiler
from pipesplit.runtime.comm.exchange import RankComm
from pipesplit.runtime.engine.loss_leaves import called_loss, loss_leaves, output_nodes
from pipesplit.runtime.engine.recompute_head import RecomputedHead
from pipesplit.runtime.engine.stage_inputs import StageInputs
from pipesplit.runtime.graphs import cuda_graphs
from pipesplit.runtime.graphs.stage_graphs import Deferred, StageGraphs, run_forward, run_weights
from pipesplit.runtime.graphs.stage_parts import Parts
from pipesplit.runtime.engine.target_probe import TargetProbe
from pipesplit.runtime.comm.transport import Like
from pipesplit.schedules import Action, ActionKind
from pipesplit.schedules.rendezvous import Message


@dataclass
class StepData:
    """What every worker of one step shares: microbatched inputs, targets, loss, sizes."""

    inputs: list[list[Any]]  # per microbatch: flat program inputs
    targets: list[Any] | None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    loss_scale: float
    training: bool
    microbatch_size: int
    seed: int = 0  # the step's random seed: stage s, microbatch m draws from stream_seed(seed, s, m)
    microbatch_offset: int = 0  # this replica's first microbatch in the global batch (data parallel)
    whole: list[Any] = field(default_factory=list)  # the flat inputs the microbatches were cut from
    outputs: dict[int, list[Any]] = field(default_factory=dict)  # microbatch -> flat outputs (last stage)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    # (microbatch, stage, flat input index, gradient) for program inputs that require grad; added to
    # the caller's tensors after the step (runtime/engine/steps.py: route_input_grads)
    input_grads: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    dp_size: int = 1  # data-parallel replicas of the pipeline (a mesh's dp dimension)
    target_probe: TargetProbe | None = None  # target leaves the loss must confirm were right to cut (target_probe.py)
    # the microbatches' other dynamic sizes (a sequence length) by the graphs' symbols, and what tells
    # one microbatch shape from another (the size alone where there are none): see passes/split/sizes.py
    sizes: dict[Any, int] = field(default_factory=dict)
    size_key: Any = None

    def __post_init__(self) -> None:
        if self.size_key is None:
            self.size_key = size_key(self.microbatch_size, self.sizes)


@dataclass
class _Saved:
    inputs: list[tuple[str, int, torch.Tensor]]  # (boundary name, source stage, leaf that needs a grad)
    user_inputs: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (flat input index, its leaf here)
    tensors: list[torch.Tensor] = field(default_factory=list)  # what backward starts from
    grads: list[torch.Tensor | None] = field(default_factory=list)
    outputs: tuple[Any, ...] = ()
    inters: list[torch.Tensor] = field(default_factory=list)  # weight consumers' outputs (split backward)
    inter_grads: list[torch.Tensor | None] = field(default_factory=list)
    weights: WeightGraph | None = None  # the weight graph the forward ran (split backward)
    params: list[torch.Tensor] = field(default_factory=list)  # the stage's trainable parameters at the forward
    loss_leaves: list[torch.Tensor] = field(default_factory=list)  # what the loss function trains (last stage)
    deferred: Deferred | None = None  # compiled F/I/W: the graphs and what passes between them

    def release(self) -> None:
        """Let go of everything the microbatch's record holds. A checkpointed stage's forward closure keeps the
        record itself alive from any output whose backward never ran (an output no loss reaches: its graph's
        saved tensors hold checkpoint's frame, which holds the closure), a cycle through autograd's C++ nodes
        that Python's collector cannot see: a GPT-like stage returning an unused tanh(h) grew 0.5 MiB a step."""
        self.inputs, self.user_inputs, self.tensors, self.grads, self.outputs = [], [], [], [], ()
        self.inters, self.inter_grads, self.params, self.loss_leaves = [], [], [], []
        self.weights, self.deferred = None, None


class StageWorker(StageInputs):
    """Runs F, B, I and W actions of one stage (its boundaries and inputs: :class:`StageInputs`).

    An action takes its inputs from, and hands its outputs to, its rank's
    :class:`~pipesplit.runtime.comm.exchange.RankComm`; when they travel is the rank's
    communication plan's business (:func:`pipesplit.schedules.rendezvous.comm_plan`).
    """

    def __init__(
        self,
        prog: SplitProgram,
        stage: Stage,
        rank_of: Sequence[int],
        *,
        checkpointing: bool = False,
        stream: Any = None,
        on_gradients: Callable[[Sequence[torch.Tensor]], None] | None = None,
        split_backward: bool = False,
        compiler: StageCompiler | None = None,
        head: Sequence[str] = (),
    ):
        self.rank_of = rank_of
        self.compiler = compiler  # Pipeline(..., compile=...): the stage runs as torch.compile'd code
        self.stream = stream
        StageInputs.__init__(self, prog, stage, checkpointing)
        self.saved: dict[int, _Saved] = {}
        self.tracer: Any = None  # a pipesplit.runtime.engine.trace.Trace while Pipeline.trace() is active
        self.on_gradients = on_gradients  # called once a step's last weight gradients are in
        # ``head``: the stage's first nodes, recomputed in the backward (the plan's partial checkpointing); such
        # a stage runs its backward whole (under a split schedule, all of it at I: a compiled backward runs
        # once), its head and tail as two compiled graphs under compile=
        self.head, self._heads = list(head), dict[int, RecomputedHead]()
        self.split_backward = split_backward and not checkpointing and not self.head  # I then W: see runtime/engine/weight_grads.py
        self.schedule_splits = split_backward  # the schedule issues I and W for this stage (checkpointed or not)
        # (id(stage module), which parameters are trainable) -> its weight graph: freezing or
        # unfreezing a parameter between steps picks (or makes) the graph for the new set
        self._weight_graphs: dict[tuple[int, tuple[bool, ...]], WeightGraph | None] = {}
        # compile= under a split backward: the stage as compiled F/I/W graphs (runtime/graphs/stage_graphs.py)
        # (or under any schedule where CUDA graphs are asked for and the device can capture them)
        self.explicit = (StageGraphs(compiler, stage.index, self.split_backward, stage.device)
                         if compiler is not None and not self.head and (self.split_backward or (
                             compiler.graphs and cuda_graphs.backend_for(stage.device) is not None)) else None)
        self.backwards_done = 0
        self._slots: tuple[torch.nn.Module, list[tuple[dict[str, Any], str]]] | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def params(self) -> list[torch.Tensor]:
        """The stage's parameters that are trainable now (``requires_grad_`` may change between steps)."""
        return [p for p in self._all_params() if p.requires_grad]

    def _all_params(self) -> list[torch.Tensor]:
        """``module.parameters()``, read through the (submodule, name) slots that hold them, found once
        per module: walking the module tree cost ~0.25 ms a call on a 12-block GPT, twice a step.
        Reading each slot every call still sees a parameter replaced in place (``to_empty``, ``.to``)."""
        module = self.stage.module
        if self._slots is None or self._slots[0] is not module:
            self._slots = (module, [(sub._parameters, name) for _, sub in module.named_modules()
                                    for name, p in sub._parameters.items() if p is not None])
        found = [slots.get(name) for slots, name in self._slots[1]]
        return list({id(p): p for p in found if p is not None}.values())  # tied ones once, in order

    def _ctx(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _event(self) -> Any:
        """An event marking the work queued so far on this stage's stream (None without one)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    # ------------------------------------------------------------------ actions
    def run(self, action: Action, data: StepData, comm: RankComm, begin: float | None = None) -> None:
        """Run ``action``; its inputs are in ``comm`` (``begin``: when its rank started waiting for them)."""
        tracer = self.tracer
        ready = time.perf_counter() if tracer is not None else 0.0
        if self.stage.device.type == "cuda":
            torch.cuda.set_device(self.stage.device)
        with self._ctx():
            if action.kind is ActionKind.FORWARD:
                self.forward(action.microbatch, data, comm)
            elif action.kind is ActionKind.FULL_BACKWARD:
                self.backward_input(action.microbatch, data, comm)
                self.backward_weight(action.microbatch)
            elif action.kind is ActionKind.BACKWARD_INPUT:
                self.backward_input(action.microbatch, data, comm, split=True)
            elif action.kind is ActionKind.BACKWARD_WEIGHT:
                self.backward_weight(action.microbatch)
            if self.on_gradients is not None and action.kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_WEIGHT):
                self.backwards_done += 1
                params = self.params
                if self.backwards_done == len(data.inputs) and params:
                    self.on_gradients(params)
            if tracer is not None and self.stage.device.type == "cuda":  # count the device work inside the action
                (self.stream or torch.cuda.current_stream(self.stage.device)).synchronize()
        if tracer is not None:
            start = ready if begin is None else begin
            tracer.record(self.rank_of[self.index], action, start, ready, time.perf_counter())

    def forward(self, m: int, data: StepData, comm: RankComm) -> None:
        saved = _Saved([])
        args, own, write_back = self.stage_args(m, data, comm, saved.inputs, saved.user_inputs)
        grad_mode = torch.enable_grad() if data.training else torch.no_grad()
        module, device = self.stage.module, self.stage.device
        explicit = self._explicit(args, data.size_key) if data.training else None
        weights = self._weights() if data.training and self.split_backward and explicit is None else None
        saved.weights, saved.params = weights, self.params if data.training else []
        if weights is not None:
            module = weights.module
        seed = stream_seed(data.seed, self.index, data.microbatch_offset + m)

        first_run: list[tuple[Any, ...]] = []

        # a zero-bubble stage's I/W split runs as explicit compiled F/I/W graphs, or eager through the
        # weight graph's own autograd nodes (which a compiled graph would fuse into one; warned once)
        compiler, mb_size = (self.compiler if weights is None else None), data.size_key
        if compiler is not None and explicit is None and data.training and self.schedule_splits and not self.head:
            # checkpointed under a split schedule: I keeps the graph for W, which compiled code's backward
            # (run once, its buffers donated) refuses with a raw error (the fuzzer: zb_v + checkpoint)
            compiler.warn_eager_stage(self.index, "it is checkpointed under a schedule that splits its backward "
                                      "into I and W, and a compiled backward runs once")
            compiler = None
        if compiler is not None and explicit is None and compiler.blocked(module, self.index, self._live_outputs()):
            compiler = None

        def owned(xs: Sequence[Any]) -> tuple[Any, ...]:
            """The inputs the stage writes in place, cloned (inside what recomputes, which replays from the originals)."""
            xs = tuple(x.clone() if i in own else x for i, x in enumerate(xs))
            if not first_run:
                first_run.append(xs)
            return xs

        partly = bool(self.head) and data.training

        def run_stage(*xs: Any) -> Any:  # checkpointing replays it, masks and all, from the same seed
            if own and not partly:  # a recomputed head clones them itself (RecomputedHead)
                xs = owned(xs)
            with random_stream(seed, device):
                if explicit is not None:
                    assert self.explicit is not None
                    saved.deferred = self.explicit.deferred(explicit, xs, mb_size)
                    try:
                        return run_forward(saved.deferred, xs)
                    except RuntimeError as e:  # F's compiled code failed (the fuzzer: AOT autograd's raw view
                        # error, BatchNorm over a transposed input): this microbatch runs the whole stage eager
                        # (its W a second backward), and the stage's split eager from now on
                        self.explicit.failed(explicit, e)
                        if saved.deferred.finish is not None:
                            saved.deferred.finish()
                        saved.deferred = None
                        return self.stage.module(*xs)
                if compiler is not None:
                    try:
                        if partly:  # the head and the tail, each compiled
                            return self._recomputed(module)(
                                *xs, run=lambda piece, *a: compiler.run(piece, self.index, mb_size, *a),
                                own=sorted(own), prepare=owned)
                        return compiler.run(module, self.index, mb_size, *xs)
                    except RuntimeError as e:  # torch.compile's own failure (dynamo's errors are RuntimeErrors):
                        compiler.failed(module, self.index, e)  # this stage runs eager (it writes nothing in place:
                        # a rerun is safe). Not Exception: checkpoint's recompute stops by raising one of its own
                if partly:
                    return self._recomputed(module)(*xs, own=sorted(own), prepare=owned)
                return module(*xs)

        with grad_mode:
            if self.checkpointing and data.training:
                outs = checkpoint(run_stage, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                outs = run_stage(*args)
            outs = tuple(outs)
            if weights is not None:  # the weight consumers' outputs ride behind the stage's own
                outs, saved.inters = outs[:weights.num_outputs], list(outs[weights.num_outputs:])
            if self.is_last:
                flat = self.prog.assemble_outputs(outs)
                if data.training and data.loss_fn is not None:
                    out_tree = pytree.tree_unflatten(flat, self.prog.out_spec)
                    target = data.targets[m] if data.targets is not None else None
                    stop = output_nodes([*outs, *flat])  # before the loss: it may write an output in place
                    probe = data.target_probe if data.target_probe is not None and not data.target_probe.done else None
                    loss_fn = data.loss_fn
                    fn = loss_fn if probe is None else (lambda o, t: probe.loss(loss_fn, o, t))
                    loss = called_loss(fn, out_tree, target, m, self.index)
                    if data.loss_scale != 1.0:  # a multiply by 1 changes no bit; skipped, it cost a kernel each way
                        loss = loss * data.loss_scale
                    data.losses[m] = loss.detach()
                    saved.tensors, saved.grads = [loss], [None]
                    if loss.grad_fn is not None:
                        leaves = [*(x for _, _, x in saved.inputs), *(x for _, x in saved.user_inputs)]
                        saved.loss_leaves, direct = loss_leaves(loss, stop, saved.params, leaves)
                        if direct and self.split_backward:
                            raise PipesplitError(
                                f"loss_fn reads {len(direct)} of stage {self.index}'s parameters directly (shapes "
                                f"{', '.join(str(tuple(t.shape)) for t in direct[:4])}: a regulariser on the "
                                "model's weights?). This schedule splits the stage's backward into input- and "
                                "weight-gradient actions and would lose that term of their gradients. Use a "
                                "schedule without the split (gpipe, 1f1b, interleaved_1f1b), or add the term "
                                "to the gradients after pipe.step.")
                        if saved.loss_leaves and data.dp_size > 1:
                            shapes = ", ".join(str(tuple(t.shape)) for t in saved.loss_leaves[:4])
                            raise PipesplitError(
                                f"loss_fn trains {len(saved.loss_leaves)} tensor(s) the model does not hold "
                                f"(shapes {shapes}); on a mesh with {data.dp_size} data-parallel replicas "
                                "pipesplit sums only the model's gradients across them, so those would drift "
                                "apart. Make them parameters of the model (a module the forward uses), or "
                                "train them without a dp dimension.")
                else:
                    data.outputs[m] = [o.detach() if isinstance(o, torch.Tensor) else o for o in flat]
        if write_back:
            with torch.no_grad():
                for i, given in write_back:
                    given.copy_(first_run[0][i])
        event = self._event()
        for name, value in zip(self.stage.outputs, outs):
            for dst in self.consumers.get(name, ()) if not self.is_last else ():
                b = self.out_bounds[(name, dst)]
                if b.kind == "tensor":
                    comm.put(Message("F", name, self.index, dst, m), value.detach(), self.rank_of[dst], event)
        if data.training:
            # the last stage's backward starts from its loss, whose graph keeps what it needs: holding the outputs
            # too kept a head's logits per microbatch in flight (1 GiB each for a Llama-3 head at sequence 4096)
            saved.outputs = () if self.is_last and saved.tensors else outs
            self.saved[m] = saved

    def backward_input(self, m: int, data: StepData, comm: RankComm, split: bool = False) -> None:
        saved = self.saved[m]
        self.output_grads(m, saved.outputs, comm, saved.tensors, saved.grads)
        leaves = [x for _, _, x in saved.inputs] + [x for _, x in saved.user_inputs]
        grads: Sequence[torch.Tensor | None]
        if not saved.tensors:
            grads = [None] * len(leaves)
        elif split and saved.deferred is not None:  # the compiled I graph, under the stage's autograd node
            anchor = saved.deferred.anchor
            grads = input_grads(None, saved.tensors, saved.grads, [*leaves, anchor], [])[0][:len(leaves)]
            if saved.loss_leaves:
                torch.autograd.backward(saved.tensors, saved.grads, inputs=saved.loss_leaves, retain_graph=True)
        elif split and self.split_backward:  # also the gradients W starts from (see runtime/engine/weight_grads.py)
            weights = saved.weights if saved.inters else None
            grads, saved.inter_grads = input_grads(weights, saved.tensors, saved.grads, leaves, saved.inters)
            if saved.loss_leaves:  # the loss function's own: through its few ops only, the graph kept for W
                torch.autograd.backward(saved.tensors, saved.grads, inputs=saved.loss_leaves, retain_graph=True)
        else:  # a whole backward; under a split schedule too where the stage recomputes (all or its head):
            # an I keeping the recomputed graph for W held it until the step ended (a GPT's checkpointed stage
            # under zb_h1: 89 MiB measured against 62 with it let go), and W would recompute it again
            # every leaf this graph reaches is the stage's: its trainable parameters, its input leaves
            # (received values and the caller's inputs, detached here) and the loss function's own, so
            # no ``inputs=`` list: naming them made autograd mark the graph first (~0.2 ms a step on a
            # 12-block GPT), and a buffer the user made require grad gets its .grad as in plain PyTorch
            torch.autograd.backward(saved.tensors, saved.grads)
            grads = [x.grad for x in leaves]
            saved.tensors = []  # the weight gradients are done too
        for (where, _), g in zip(saved.user_inputs, grads[len(saved.inputs):]):
            if g is not None:
                data.input_grads.append((m, self.index, where, g.detach()))
        event = self._event()
        for (name, src, x), g in zip(saved.inputs, grads):
            g = torch.zeros_like(x) if g is None else g
            comm.put(Message("B", name, src, self.index, m), g.detach(), self.rank_of[src], event)
        if split and not saved.tensors and saved.deferred is None:  # nothing is left for W: let the microbatch's
            # input leaves and their gradients, its outputs (a last stage's logits) and their gradients go now, not
            # at W (zb_h1, a last stage recomputing its head: 9.0 -> 5.8 MB on a GPT with a 4096 vocabulary)
            self.saved[m] = _Saved(inputs=[])
            saved.release()

    def backward_weight(self, m: int) -> None:
        saved = self.saved.pop(m)
        try:
            self._weight_grads(saved)
        finally:
            saved.release()

    def _weight_grads(self, saved: _Saved) -> None:
        if saved.deferred is not None:  # the compiled W graph, from what I kept
            run_weights(saved.deferred)
            return
        if not (saved.tensors and saved.params):
            return
        weights = saved.weights if saved.inters else None
        if weights is None:  # a second backward from the stage outputs (no split forward was run)
            torch.autograd.backward(saved.tensors, saved.grads, inputs=saved.params)
            return
        weight_backward(weights, saved.inters, saved.inter_grads, saved.tensors, saved.grads)

    def _recomputed(self, module: Any) -> RecomputedHead:
        """The stage module with its head under activation checkpointing, made once per module."""
        if id(module) not in self._heads:  # as many of the plan's nodes now: a re-capture renames the stage's nodes
            self._heads[id(module)] = RecomputedHead(module, self.prog.plan.stages[self.index][:len(self.head)])
        return self._heads[id(module)]

    def _explicit(self, args: Sequence[Any], microbatch_size: Any) -> Parts | None:
        if self.explicit is None:
            return None
        return self.explicit.parts(self.stage.module, self._all_params(), args, microbatch_size,
                                   self.checkpointing, bool(self._written_inputs()))

    def _weights(self) -> WeightGraph | None:
        """This stage's weight graph (see runtime/engine/weight_grads.py), made once per module and set of
        trainable parameters."""
        module = self.stage.module
        key = (id(module), tuple(p.requires_grad for p in self._all_params()))
        if key not in self._weight_graphs:
            self._weight_graphs[key] = weight_graph(module)
        return self._weight_graphs[key]
