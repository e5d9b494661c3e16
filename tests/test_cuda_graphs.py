"""CUDA graphs for compiled stages (``compile={"mode": "reduce-overhead"}``), tested on CPU.

A GPU is not needed for what can go wrong in pipesplit's part: which slot a microbatch replays in,
what is copied in and out, when a slot is given back, when graphs are captured anew, and what
falls back. :class:`~pipesplit.runtime.graphs.cuda_graphs.EmulatedCapture` stands in for
``torch.cuda.CUDAGraph``: a replay writes each output into the tensor the capture returned, as a
CUDA graph does, so a slot handed to a second microbatch while the first still reads it gives a
wrong gradient here (the first test below shows that it would). The capture itself and the speed
need a GPU: ``benchmarks/bench_gpu.py`` runs them (part ``cuda_graphs``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import pipesplit
from pipesplit.runtime.graphs import cuda_graphs
from pipesplit.runtime.graphs.cuda_graphs import EmulatedCapture, capture_blocker, without_inductor_graphs
from tests.test_compiled_stages import dropout_gpt_program
from tests.training import check_training, dot_loss
from tests.zoo import CASE_BY_NAME

GRAPHS = {"backend": "aot_eager", "mode": "reduce-overhead"}
RTOL = 1e-3  # as tests/test_compiled_stages.py: AOT autograd's decompositions sum in another order


@pytest.fixture
def emulated(monkeypatch):
    """Stages on CPU capture and replay as CUDA graphs would."""
    monkeypatch.setattr(cuda_graphs, "backend_for", lambda device: EmulatedCapture())


def _pipe(schedule, stages, m=4, case="gpt_tied", compile=GRAPHS):  # noqa: A002
    c = CASE_BY_NAME[case]
    torch.manual_seed(0)
    model = c.build()
    prog = pipesplit.compile(model, *c.inputs(2)[:1], num_stages=stages, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=m, loss_fn=dot_loss, loss_reduction="sum",
                              compile=compile)
    return c, model, pipe


def _slots(pipe):
    """Per stage: (slots, captures, replays) of the F/I/W graphs it ran."""
    return {w.index: [(len(s.slots), s.captures, s.replays) for s in w.explicit.slots.values() if s is not None]
            for w in pipe.workers.values() if w.explicit is not None}


@pytest.mark.parametrize("schedule,stages", [("gpipe", 2), ("1f1b", 2), ("zb_h1", 2), ("interleaved_1f1b", 4),
                                             ("zb_v", 2), ("dualpipe_v", 2)])
def test_cuda_graph_slots_train_like_gradient_accumulation(emulated, schedule, stages):
    """Every schedule, every stage replayed from captured F/I/W graphs: two optimizer steps equal
    gradient accumulation; a stage keeps one slot per microbatch it holds in flight (gpipe: all of
    them) and replays them across microbatches and steps."""
    c, model, pipe = _pipe(schedule, stages)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="pipesplit")  # nothing falls back
        check_training(model, pipe, [c.inputs(8), c.inputs(8)], m=4, steps=2, rtol=RTOL)
    slots = _slots(pipe)
    assert set(slots) == set(range(stages)), slots
    for stage, [(n, captures, replays)] in slots.items():
        assert 1 <= n <= 4 and captures <= 2 * n, (stage, slots)  # F and I (W runs without a graph)
        assert replays >= 2 * 4, (stage, slots)  # at least F, for 4 microbatches, over 2 steps
    if schedule == "gpipe":  # every forward before any backward: each stage holds all 4
        assert all(n == 4 for [(n, _, _)] in slots.values()), slots
    assert pipe.compiler.eager == [] and pipe.compiler.ungraphed == []


def test_a_slot_reused_while_its_microbatch_is_in_flight_gives_a_wrong_gradient(emulated, monkeypatch):
    """The emulation is strict enough to catch the slot bookkeeping: handing every microbatch the
    first slot (its saved values overwritten by the next forward) fails the exactness check."""
    real = cuda_graphs.Slots.acquire

    def one_slot(self, xs):
        runner = real(self, xs)
        if runner is not None and self.slots[0] is not runner.slot:
            self.slots.remove(runner.slot)
            runner.slot = self.slots[0]
        return runner

    monkeypatch.setattr(cuda_graphs.Slots, "acquire", one_slot)
    c, model, pipe = _pipe("gpipe", 2)
    with pytest.raises(AssertionError, match="relative error"):
        check_training(model, pipe, [c.inputs(8)], m=4, steps=1, rtol=RTOL)


def test_a_parameter_that_moves_retires_the_slots_and_they_are_captured_anew(emulated):
    c, model, pipe = _pipe("1f1b", 2)
    check_training(model, pipe, [c.inputs(8)], m=4, steps=1, rtol=RTOL)
    before = _slots(pipe)
    with torch.no_grad():
        for p in pipe.parameters():  # new storage, same values: what .to() or a reload can do
            p.data = p.data.clone()
    model.load_state_dict(pipe.prog.state_dict())
    check_training(model, pipe, [c.inputs(8)], m=4, steps=1, rtol=RTOL)
    after = _slots(pipe)
    for stage in before:
        assert after[stage][0][1] == 2 * before[stage][0][1], (before, after)  # every graph captured again


def test_a_capture_that_fails_runs_the_stage_compiled_without_graphs(emulated, monkeypatch):
    real = cuda_graphs.Slots.replay

    def refuse_i(self, slot, label, part, inputs):
        if self.index == 1 and label == "I" and "I" not in slot.graphs:  # what torch raises mid-capture
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(self, slot, label, part, inputs)

    monkeypatch.setattr(cuda_graphs.Slots, "replay", refuse_i)
    c, model, pipe = _pipe("zb_h1", 2)
    with pytest.warns(UserWarning, match=r"stage 1 runs compiled without CUDA graphs: capturing its I graph "
                                         r"failed \(RuntimeError: operation not permitted"):
        check_training(model, pipe, [c.inputs(8)], m=4, steps=2, rtol=RTOL)
    assert pipe.compiler.ungraphed == [1] and pipe.compiler.eager == []
    assert _slots(pipe)[0][0][2] > 0  # stage 0 still replays


def test_batchnorm_statistics_are_updated_once_per_microbatch_under_graphs(emulated):
    """A capture runs the graph (CUDA's warm-up, the emulation's capture) besides the replay: the
    running statistics it writes (aten.native_batch_norm writes them without declaring it) are put
    back, so each microbatch updates them once. Stage 0 holds the stem's BatchNorm and replays it;
    stage 1 writes a residual in place and runs without graphs."""
    c, model, pipe = _pipe("gpipe", 2, m=2, case="conv_bn")
    with pytest.warns(UserWarning, match=r"stage 1 runs compiled without CUDA graphs: it writes in place"):
        check_training(model, pipe, [c.inputs(4)], m=2, steps=2, rtol=RTOL)  # running_mean, running_var too
    assert _slots(pipe)[0][0][2] > 0 and pipe.compiler.ungraphed == [1]


class _StatsRead(torch.nn.Module):
    """A BatchNorm on a transposed view (its stage runs eager) whose running variance a later stage
    reads after the BatchNorm wrote it: the fuzzer's seed 8080, case 173."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.bn = torch.nn.BatchNorm1d(8, affine=False)

    def forward(self, x):
        h = self.bn(self.emb(x).transpose(1, 2)).transpose(1, 2) * self.bn.running_var
        return torch.nn.functional.linear(h, self.emb.weight)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "looped_bfs"])
def test_a_capture_leaves_a_buffer_it_only_reads_untouched(emulated, schedule):
    """A capture puts back what the graph it runs may write, but a buffer F only reads was copied
    back too, which bumped its version: the eager BatchNorm's backward, which saved the running
    variance, then raised autograd's "modified by an inplace operation". Only what changed is put back."""
    torch.manual_seed(0)
    model = _StatsRead()
    x = torch.randint(0, 16, (3, 4))
    prog = pipesplit.compile(model, x, num_stages=4, progress=False)
    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=1, loss_fn=dot_loss, loss_reduction="sum",
                              compile=GRAPHS)  # one microbatch: a buffer two stages use allows no more
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pipesplit")  # the BatchNorm's stage runs without graphs
        check_training(model, pipe, [((x,), {})], m=1, steps=2, rtol=RTOL)  # running_var and the counter too
    assert any(replays for stage in _slots(pipe).values() for (_, _, replays) in stage)


def test_a_stage_with_random_ops_runs_compiled_without_graphs_and_says_why(emulated):
    """Dropout draws from pipesplit's per-microbatch streams, which a replay would repeat: under a
    schedule that does not split the backward the stage runs as whole-stage compiled code (not
    eager), warned."""
    prog = dropout_gpt_program()
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum", compile=GRAPHS)
    with pytest.warns(UserWarning, match=r"runs compiled without CUDA graphs: it has random ops"):
        pipe.step(torch.randint(0, 32, (4, 8)), target=torch.randn(4, 8, 32))
    assert pipe.compiler.eager == [] and sorted(pipe.compiler.ungraphed) == [0, 1]
    assert {s for s, _ in pipe.compiler.seconds} == {0, 1}  # both compiled, whole


def test_more_microbatches_in_flight_than_slots_run_without_graphs(emulated, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_SLOTS", 2)
    c, model, pipe = _pipe("gpipe", 2)
    with pytest.warns(UserWarning, match="more than 2 microbatches in flight"):
        check_training(model, pipe, [c.inputs(8)], m=4, steps=1, rtol=RTOL)
    assert all(n == 2 for [(n, _, _)] in _slots(pipe).values())


def test_on_cpu_reduce_overhead_compiles_as_the_default_mode_without_a_word():
    """Without a device that captures, the mode asks for nothing pipesplit can do: the stages
    compile as under compile=True (no explicit graphs for a schedule that does not split)."""
    c, model, pipe = _pipe("1f1b", 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="pipesplit")
        check_training(model, pipe, [c.inputs(8)], m=4, steps=1, rtol=RTOL)
    assert all(w.explicit is None for w in pipe.workers.values())
    assert pipe.compiler.graphs and "mode" not in pipe.compiler.options


def test_inductor_cuda_graphs_are_taken_out_of_the_options():
    assert without_inductor_graphs({"mode": "reduce-overhead"}) == ({}, True)
    assert without_inductor_graphs({"mode": "max-autotune", "fullgraph": True}) == (
        {"mode": "max-autotune-no-cudagraphs", "fullgraph": True}, True)
    assert without_inductor_graphs({"options": {"triton.cudagraphs": True, "epilogue_fusion": False}}) == (
        {"options": {"triton.cudagraphs": False, "epilogue_fusion": False}}, True)
    assert without_inductor_graphs({"mode": "max-autotune-no-cudagraphs"}) == (
        {"mode": "max-autotune-no-cudagraphs"}, False)
    assert without_inductor_graphs({"backend": "aot_eager"}) == ({"backend": "aot_eager"}, False)


def test_the_capture_decision_names_the_tensor_off_the_device():
    cuda = torch.device("cuda", 0)  # a device object needs no GPU
    assert capture_blocker(torch.device("cpu"), [torch.zeros(2)]) is None
    why = capture_blocker(cuda, [torch.zeros(3, 4)])
    assert why == "it reads a tensor of shape (3, 4) on cpu, not on the stage's cuda:0", why


def test_a_capture_that_fails_after_its_warm_up_updates_batchnorm_once(emulated, monkeypatch):
    """CUDA's capture runs the graph once (the warm-up) before the capture proper, which is what
    fails: the statistics the warm-up wrote are put back before the fallback runs (the review)."""
    def warm_then_fail(self, fn, inputs, pool):
        fn(*inputs)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(EmulatedCapture, "capture", warm_then_fail)
    c, model, pipe = _pipe("gpipe", 2, m=2, case="conv_bn")
    with pytest.warns(UserWarning, match=r"stage 0 runs compiled without CUDA graphs: capturing its F graph failed"):
        check_training(model, pipe, [c.inputs(4)], m=2, steps=2, rtol=RTOL)  # running_mean, running_var too


def test_input_gradients_on_autograds_thread_never_wait_on_the_compile_gate():
    """On a GPU autograd runs a stage's I graph on its device thread, which a stage tracing its joint
    graph under the gate may be waiting for: there a compiled call must not wait. While another
    thread holds the gate, a non-blocking call runs the graph uncompiled at once."""
    import threading

    from pipesplit.runtime.graphs.compiled import StageCompiler

    compiler = StageCompiler({"backend": "aot_eager"})
    module = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    with torch.no_grad():
        compiler.run(module, 0, 2, x)  # compiled once
        held, release, done = threading.Event(), threading.Event(), []

        def hold():
            with compiler.exclusive():
                held.set()
                release.wait(10)

        t = threading.Thread(target=hold)
        t.start()
        held.wait(10)
        try:
            out = compiler.run(module, 0, 2, x, blocking=False)
            done.append(out)
            assert torch.allclose(out, module(x))
            assert compiler.run(module, 0, 3, torch.randn(3, 3), blocking=False).shape == (3, 3)  # never compiled
        finally:
            release.set()
            t.join(10)
    assert done and (0, 3) not in compiler.seconds


class _SharedGradient(torch.nn.Module):
    """``h * (w1 + w2)``: autograd hands one gradient tensor to both weights."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.l2(self.l1(x) * (self.w1 + self.w2))


class _Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.ln, self.l2, self.ln2 = (torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8),
                                              torch.nn.LayerNorm(8))

    def forward(self, x):
        return self.ln2(self.l2(self.ln(self.l1(x))))


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_one_gradient_for_two_weights_and_hooks_that_keep_theirs(emulated, graphs, schedule):
    """W's outputs become .grad as AccumulateGrad's do (the second review): one gradient tensor
    for two weights gave both the same .grad, which each later microbatch added into twice (81%
    off); a hook that keeps the gradient it saw kept the slot's memory or the .grad itself, both
    written later. Compiled F/I/W graphs with and without CUDA graph slots."""
    compile_ = GRAPHS if graphs else {"backend": "aot_eager"}
    for build in (_SharedGradient, _Norms):
        torch.manual_seed(0)
        model = build()
        x = torch.randn(8, 8)
        prog = pipesplit.compile(model, x[:2], num_stages=2, progress=False)
        pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=dot_loss, loss_reduction="sum",
                                  compile=compile_)
        check_training(model, pipe, [((x,), {})], m=4, steps=2, rtol=RTOL)
        model.load_state_dict(pipe.prog.state_dict())  # where the pipeline's training took it
        ref = copy.deepcopy(model)
        seen: dict[str, list] = {}
        for side, named in (("pipe", pipe.named_parameters()), ("ref", ref.named_parameters())):
            for name, p in named:
                if p.dim() == 1:
                    p.register_hook(lambda g, key=(side, name): seen.setdefault(key, []).append(g))
        target = torch.randn(8, 8)
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, target=target)
        for xs, ts in zip(x.chunk(4), target.chunk(4)):
            dot_loss(ref(xs), ts).backward()
        names = {name for side, name in seen if side == "ref"}
        assert names and all(len(seen[("pipe", n)]) == len(seen[("ref", n)]) == 4 for n in names), seen.keys()
        for n in names:
            for got, want in zip(seen[("pipe", n)], seen[("ref", n)]):
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (build.__name__, n)


def test_slots_are_kept_for_the_most_recent_shapes_only(emulated, monkeypatch):
    """Each input shape has its own slots, whose graphs hold memory: a stage keeps those of the
    MAX_SHAPES most recent shapes (variable sequence lengths would otherwise grow memory without bound)."""
    monkeypatch.setattr(cuda_graphs, "MAX_SHAPES", 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    prog = pipesplit.compile(model, torch.randn(2, 8), num_stages=2, dynamic_batch=True, progress=False)
    pipe = pipesplit.Pipeline(prog, "1f1b", num_microbatches=2, loss_fn=dot_loss, loss_reduction="sum", compile=GRAPHS)
    batches = [((torch.randn(b, 8),), {}) for b in (4, 6, 8, 4)]  # microbatches of 2, 3, 4, then 2 again
    check_training(model, pipe, batches, m=2, steps=4, rtol=RTOL)
    for w in pipe.workers.values():
        assert len(w.explicit.slots) == 2, w.explicit.slots  # sizes 4 and 2 (again, captured anew)


# ---------------------------------------------------------------------------- on a GPU (bench_gpu.py's tests part)
@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_cuda_graph_slots_capture_and_replay_on_a_gpu(schedule):
    """torch.cuda.CUDAGraph itself: every stage captured and replayed on its stream; a step of 4
    microbatches equals accumulation on the model within float32 (TF32 off), twice (the second step
    replays the first step's slots)."""
    import copy

    import torch.nn.functional as F

    from tests.close import assert_close, assert_grads_close

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = CASE_BY_NAME["gpt_tied"].build().cuda()
    prog = pipesplit.compile(model, torch.randint(0, 64, (2, 16), device="cuda"), num_stages=2, progress=False)

    def ce(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")

    pipe = pipesplit.Pipeline(prog, schedule, num_microbatches=4, loss_fn=ce, loss_reduction="sum", compile=GRAPHS)
    ref = copy.deepcopy(model)
    for step in range(2):
        x, y = torch.randint(0, 64, (8, 16), device="cuda"), torch.randint(0, 64, (8, 16), device="cuda")
        pipe.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = pipe.step(x, target=y)
        want = sum(ce(ref(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4)))
        want.backward()
        assert_close(loss, want.detach(), name=f"loss at step {step}", rtol=RTOL)
        assert_grads_close(pipe.named_parameters(), ref, rtol=RTOL)
    assert pipe.compiler.ungraphed == [] and pipe.compiler.eager == []
    slots = _slots(pipe)
    assert set(slots) == {0, 1} and all(r > c > 0 for [(n, c, r)] in slots.values()), slots


def test_an_emulated_replay_writes_what_a_cuda_graph_writes_and_nothing_else():
    """A replay overwrites the outputs the capture returned (the next microbatch's values appear in
    the tensors the last one was handed), and leaves alone an output that is a view of an input (a
    saved parameter): writing it would bump the parameter's version, which a real replay does not,
    and an eager stage holding that parameter for its backward would then refuse it (the fuzzer)."""
    weight = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3)

    def f(w, inp):
        return [inp @ w.t(), w.detach()]

    graph, (y, saved) = EmulatedCapture().capture(f, [weight, x], None)
    assert saved.data_ptr() == weight.data_ptr()
    first = y.clone()
    x.copy_(torch.randn(2, 3))
    version = weight._version
    EmulatedCapture().replay(graph)
    assert not torch.equal(y, first) and torch.allclose(y, x @ weight.detach().t())  # overwritten in place
    assert weight._version == version
