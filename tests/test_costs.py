"""The cost model: FLOP formulas against FlopCounterMode, the backward split, bytes, cost specs.

FlopCounterMode runs under FakeTensorMode here, so no real arithmetic is done; it
counts the matmul family (mm, addmm, bmm, baddbmm, convolution, the fused attention
kernels) with a multiply-add as 2 FLOPs, the convention of our formulas too. It does
not count the bias add of ``addmm`` (our ``linear`` does, one FLOP per output element),
so the comparisons use bias-free Linear layers and check the bias term separately.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import pipesplit
from pipesplit.capture import capture
from pipesplit.compat import TORCH_VERSION
from pipesplit.meta import NodeCost, node_cost
from pipesplit.passes.annotate.costs import annotate_costs, unknown_ops
from tests.close import assert_close
from tests.zoo import CASE_BY_NAME

COMPUTE = ("call_function", "call_module", "call_method")
ATEN = torch.ops.aten


# ----------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, widths=(12, 24, 16, 8), bias=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, bias=False)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.c1d = nn.Conv1d(4, 6, 5)
        self.fc = nn.Linear(6 * 60, 10, bias=False)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        x = self.up(x)  # (B, 4, 8, 8)
        x = self.c1d(x.flatten(2))  # (B, 6, 60)
        return self.fc(x.flatten(1))


class Attention(nn.Module):
    """bmm, matmul and einsum written out, beside a fused scaled_dot_product_attention."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.w_qkv = nn.Parameter(torch.randn(d, 3 * d) / d**0.5)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = torch.matmul(x, self.w_qkv).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / (d // h) ** 0.5
        probs = scores.softmax(-1)
        manual = torch.bmm(probs.reshape(b * h, t, t), v.reshape(b * h, t, d // h)).reshape(b, h, t, d // h)
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mixed = torch.einsum("...qd,...qe->...de", manual, fused).sum(-1)  # (b, h, d // h)
        out = (manual + fused).transpose(1, 2).reshape(b, t, d) + mixed.reshape(b, 1, d)
        return self.proj(out)


class Einsums(nn.Module):
    """Einsums that do not map to one matmul: a chain of three, and a summed-out index."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(30, 40))
        self.b = nn.Parameter(torch.randn(40, 3))
        self.c = nn.Parameter(torch.randn(7, 20))

    def forward(self, x):  # x: (B, 30)
        chain = torch.einsum("ij,jk,kl->il", x, self.a, self.b)  # (B, 3)
        summed = torch.einsum("ij,kj->k", x[:, :20], self.c)  # i is summed before contracting
        return chain.sum() + summed.sum()


# ---------------------------------------------------------------------------- helpers
def annotated(model, *args, requires_grad=False):
    cap = capture(model, args)
    flags = [isinstance(a, torch.Tensor) and requires_grad for a in cap.example_flat]
    return cap, annotate_costs(cap.gm, flags)


def compute_nodes(gm):
    return [n for n in gm.graph.nodes if n.op in COMPUTE]


def _concrete(d):
    return d if isinstance(d, int) else int(d.node.hint)


def counted_node_flops(node: fx.Node) -> int:
    """FlopCounterMode's forward count for re-running ``node`` on fake tensors of its shapes."""

    def fake(a):
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty([_concrete(d) for d in val.shape], dtype=val.dtype)
        if isinstance(val, torch.SymInt):
            return _concrete(val)
        return val

    with FakeTensorMode():
        args = fx.node.map_arg(node.args, fake)
        kwargs = fx.node.map_arg(node.kwargs, fake)
        counter = FlopCounterMode(display=False)
        with counter:
            node.target(*args, **kwargs)
    return counter.get_total_flops()


def counted_model_flops(model, x, *, backward=False, input_grad=False, math_sdpa=False):
    """(forward, backward) FLOPs FlopCounterMode counts for ``model(x)`` under FakeTensorMode."""
    with FakeTensorMode() as mode:
        params = {k: mode.from_tensor(v) for k, v in model.named_parameters()}
        buffers = {k: mode.from_tensor(v) for k, v in model.named_buffers()}
        fx_ = mode.from_tensor(x).requires_grad_(input_grad)
        fwd = FlopCounterMode(display=False)
        with fwd, (sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext()):
            out = functional_call(model, {**params, **buffers}, (fx_,))
        bwd_total = 0
        if backward:
            wrt = [p for p in params.values() if p.requires_grad] + ([fx_] if input_grad else [])
            bwd = FlopCounterMode(display=False)
            with bwd:
                torch.autograd.grad(out.float().sum(), wrt, allow_unused=True)
            bwd_total = bwd.get_total_flops()
    return fwd.get_total_flops(), bwd_total


def is_op(node, *packets):
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in packets


MATMUL_FAMILY = (ATEN.linear, ATEN.mm, ATEN.bmm, ATEN.matmul, ATEN.einsum, ATEN.conv1d, ATEN.conv2d,
                 ATEN.conv_transpose2d, ATEN.convolution, ATEN.scaled_dot_product_attention)


# ---------------------------------------------------------------- forward FLOPs per node
@pytest.mark.parametrize(
    "build, shape",
    [(MLP, (5, 12)), (ConvNet, (2, 3, 8, 8)), (Attention, (2, 6, 16)), (Einsums, (4, 30))],
    ids=["mlp", "conv", "attention", "einsum"],
)
def test_forward_flops_per_node_match_flop_counter(build, shape):
    torch.manual_seed(0)
    _, gm = annotated(build(), torch.randn(shape))
    checked = 0
    for node in compute_nodes(gm):
        if is_op(node, ATEN.scaled_dot_product_attention):
            continue  # on CPU it counts 0: see test_sdpa_flops_match_the_registered_formulas
        counted = counted_node_flops(node)
        ours = node_cost(node).fwd_flops
        if counted:
            assert ours == counted, f"{node.name} ({node.target}): ours {ours}, FlopCounterMode {counted}"
            checked += 1
        else:  # FlopCounterMode sees no matmul work in it: neither should a matmul formula
            assert not is_op(node, *MATMUL_FAMILY), f"{node.name}: FlopCounterMode counts 0, we count {ours}"
    assert checked >= 2


@pytest.mark.parametrize(
    "build, shape, math_sdpa",
    [(MLP, (5, 12), False), (ConvNet, (2, 3, 8, 8), False), (Attention, (2, 6, 16), True), (Einsums, (4, 30), False)],
    ids=["mlp", "conv", "attention", "einsum"],
)
def test_forward_matmul_totals_match_flop_counter(build, shape, math_sdpa):
    # math_sdpa: on CPU FlopCounterMode counts sdpa only when it runs the math path (as bmm).
    torch.manual_seed(0)
    model = build()
    x = torch.randn(shape)
    _, gm = annotated(model, x)
    ours = sum(node_cost(n).fwd_flops for n in compute_nodes(gm) if is_op(n, *MATMUL_FAMILY))
    counted, _ = counted_model_flops(model, x, math_sdpa=math_sdpa)
    assert counted > 0 and ours == counted


@pytest.mark.parametrize("ev", [8, 4])
def test_sdpa_flops_match_the_registered_formulas(ev):
    """Before torch 2.15, FlopCounterMode counts 0 for sdpa on CPU: it dispatches to
    ``_scaled_dot_product_flash_attention_for_cpu``, which had no formula (2.15 counts it, and
    the count is compared with ours). Its formula for
    the CUDA flash kernel runs fine on fake CPU tensors (the kernel needs equal q/k/v head
    dims), and the math path decomposes to bmm; both are compared. The causal mask is
    ignored by all of them (full QK^T). Backward: the math path does 4 bmm (2x forward),
    like our formula; the registered flash-backward formula counts 5 (2.5x), because the
    kernel recomputes QK^T, so only the math path is compared there.
    """
    torch.manual_seed(0)
    b, h, t, s, e = 2, 3, 10, 7, 8
    q, k, v = torch.randn(b, h, t, e), torch.randn(b, h, s, e), torch.randn(b, h, s, ev)

    class Sdpa(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = nn.Parameter(k)
            self.v = nn.Parameter(v)

        def forward(self, x):
            return F.scaled_dot_product_attention(x * 2, self.k, self.v)

    _, gm = annotated(Sdpa(), q, requires_grad=True)
    (node,) = [n for n in compute_nodes(gm) if is_op(n, ATEN.scaled_dot_product_attention)]
    c = node_cost(node)
    counted = counted_node_flops(node)
    if ev == e and counted == 0:  # the fused CPU kernel runs, and torch < 2.15 has no formula for it
        assert TORCH_VERSION < (2, 15), "torch 2.15 counts the fused CPU sdpa kernel: it should not count 0"
    else:  # torch's count: the fused kernel's (2.15) or, for unequal head dims, the math path's bmm
        assert counted == c.fwd_flops

    with FakeTensorMode():
        fq, fk, fv = (torch.empty(z.shape, requires_grad=True) for z in (q, k, v))
        math_fwd = FlopCounterMode(display=False)
        with math_fwd:
            out = ATEN._scaled_dot_product_attention_math(fq, fk, fv)[0]
        math_bwd = FlopCounterMode(display=False)
        with math_bwd:
            torch.autograd.grad(out.sum(), [fq, fk, fv])
        flash = FlopCounterMode(display=False)
        if ev == e:
            with flash:
                ATEN._scaled_dot_product_flash_attention(fq, fk, fv)
    assert c.fwd_flops == math_fwd.get_total_flops() == 2 * b * h * t * s * (e + ev)
    if ev == e:
        assert c.fwd_flops == flash.get_total_flops()
    assert c.igrad_flops + c.wgrad_flops == math_bwd.get_total_flops() == 2 * c.fwd_flops
    # q derives from the input, k and v are parameters: q's gradient is input-gradient work
    assert c.igrad_flops > 0 and c.wgrad_flops > 0


@pytest.fixture(scope="module")
def small_gpt():
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 16))
    _, gm = annotated(pipesplit.models.gpt(layers=1, dim=32, vocab=64, seq=16, heads=2), idx)
    return gm, idx


def test_sdpa_backward_is_twice_forward_and_no_weight_grad(small_gpt):
    gm, _ = small_gpt
    (node,) = [n for n in compute_nodes(gm) if is_op(n, ATEN.scaled_dot_product_attention)]
    c = node_cost(node)
    assert c.fwd_flops == 2 * 2 * 2 * 16 * 16 * (16 + 16)  # B, heads, T, T, head dim (q·k and p·v)
    assert c.igrad_flops == 2 * c.fwd_flops
    assert c.wgrad_flops == 0


# ------------------------------------------------------------------------ backward split
def _linears(gm):
    return [n for n in compute_nodes(gm) if is_op(n, ATEN.linear)]


def test_linear_backward_split_first_inner_frozen():
    torch.manual_seed(0)
    model = MLP(widths=(12, 24, 16, 16, 8))
    for p in model.layers[2].parameters():
        p.requires_grad_(False)
    _, gm = annotated(model, torch.randn(5, 12))
    first, inner, frozen, last = (node_cost(n) for n in _linears(gm))
    assert first.fwd_flops == 2 * 5 * 12 * 24
    assert first.igrad_flops == 0 and first.wgrad_flops == first.fwd_flops  # its input needs no grad
    assert inner.igrad_flops == inner.fwd_flops == inner.wgrad_flops
    assert frozen.wgrad_flops == 0 and frozen.igrad_flops == frozen.fwd_flops  # still passes the grad on
    assert last.igrad_flops == last.fwd_flops == last.wgrad_flops


def test_input_requiring_grad_makes_first_layer_igrad():
    torch.manual_seed(0)
    _, gm = annotated(MLP(), torch.randn(5, 12), requires_grad=True)
    first = node_cost(_linears(gm)[0])
    assert first.igrad_flops == first.fwd_flops == first.wgrad_flops


def test_frozen_prefix_has_no_backward_at_all():
    torch.manual_seed(0)
    model = MLP(widths=(12, 24, 16, 8))
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    _, gm = annotated(model, torch.randn(5, 12))
    nodes = compute_nodes(gm)
    first_linear, second_linear = _linears(gm)[:2]
    before = nodes[: nodes.index(second_linear)]
    assert all(node_cost(n).bwd_flops == 0 for n in before), "nothing before the first trainable layer needs grad"
    assert node_cost(first_linear).fwd_flops > 0
    second = node_cost(second_linear)
    assert second.igrad_flops == 0 and second.wgrad_flops == second.fwd_flops


def test_linear_bias_is_one_flop_per_output_element():
    torch.manual_seed(0)
    _, gm = annotated(MLP(bias=True), torch.randn(5, 12))
    for node, (a, b) in zip(_linears(gm), [(12, 24), (24, 16), (16, 8)]):
        c = node_cost(node)
        assert counted_node_flops(node) == 2 * 5 * a * b
        assert c.fwd_flops == 2 * 5 * a * b + 5 * b
        assert c.wgrad_flops == c.fwd_flops  # dW (a matmul) plus db (a reduction over the rows)


@pytest.mark.parametrize("input_grad", [False, True])
def test_backward_totals_match_flop_counter(input_grad):
    torch.manual_seed(0)
    model = MLP(widths=(12, 24, 16, 16, 8))
    for p in model.layers[2].parameters():
        p.requires_grad_(False)
    x = torch.randn(5, 12)
    _, gm = annotated(model, x, requires_grad=input_grad)
    ours = sum(node_cost(n).bwd_flops for n in _linears(gm))
    _, counted = counted_model_flops(model, x, backward=True, input_grad=input_grad)
    assert counted > 0 and ours == counted


class StopGrad(nn.Module):
    """Branches whose values carry no gradient: a detach and a no_grad block."""

    def __init__(self, d=16):
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=False)
        self.c = nn.Linear(d, d, bias=False)
        self.e = nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            frozen = self.b(h)
        return self.e(self.c(h.detach()) * frozen)


def test_no_grad_and_detach_cut_the_backward():
    torch.manual_seed(0)
    model = StopGrad()
    x = torch.randn(5, 16)
    _, gm = annotated(model, x)
    nodes = compute_nodes(gm)
    (block,) = [n for n in nodes if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled]
    fwd = node_cost(block).fwd_flops + sum(node_cost(n).fwd_flops for n in _linears(gm))
    bwd = sum(node_cost(n).bwd_flops for n in nodes if is_op(n, ATEN.linear))
    counted_fwd, counted_bwd = counted_model_flops(model, x, backward=True)
    assert fwd == counted_fwd, "the no_grad block's body must be costed"
    assert bwd == counted_bwd, "values computed under no_grad or detached need no gradient"
    for n in nodes:
        if is_op(n, ATEN.linear) and n.args[1].target == "a.weight":
            # a's output reaches the loss only through the detach and the no_grad block
            assert node_cost(n).bwd_flops == 0
            assert not node_cost(n).requires_grad


# ------------------------------------------------------------------------------ bytes
class Buffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("scale", torch.full((3,), 2.0, dtype=torch.float64))
        self.register_buffer("index", torch.arange(3))
        self.table = nn.Parameter(torch.randn(4, 3).half(), requires_grad=False)

    def forward(self, x):
        y = self.lin(x).double() * self.scale
        y = y[:, self.index].float()
        top, where = y.topk(2, dim=-1)
        return y @ self.table.float().t(), top, where


def test_param_bytes_of_get_attr_nodes():
    torch.manual_seed(0)
    model = Buffers()
    cap, gm = annotated(model, torch.randn(4, 6))
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    seen = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        entry = cap.state[cap.target_to_entry[str(node.target)]]
        (name,) = [a for a in entry.aliases if a in state] or [None]
        want = state[name]
        c = node_cost(node)
        assert c.param_bytes == want.numel() * want.element_size(), node.name
        assert c.trainable == (isinstance(want, nn.Parameter) and want.requires_grad), node.name
        seen.add(name)
    assert seen == set(state)


def _measured_bytes(value):
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("name", ["mlp", "conv_bn", "buffers", "gpt"])
def test_out_bytes_equal_the_values_a_run_produces(name, small_gpt):
    torch.manual_seed(0)
    if name == "gpt":
        gm, inp = small_gpt
    elif name == "buffers":
        inp = torch.randn(4, 6)
        _, gm = annotated(Buffers(), inp)
    else:
        case = CASE_BY_NAME[name]
        (inp,), _ = case.inputs(3)
        _, gm = annotated(case.build(), inp)
    produced = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            produced[n] = super().run_node(n)
            return produced[n]

    with torch.no_grad():
        Recorder(gm).run(inp)  # the captured copy of the state: BatchNorm stats may move
    for node in compute_nodes(gm):
        assert node_cost(node).out_bytes == _measured_bytes(produced[node]), node.name
        assert node_cost(node).sendable == (not isinstance(produced[node], (tuple, list))), node.name


# ------------------------------------------------------------------------ unknown ops
@torch.library.custom_op("pipesplit_tests::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


class Mysterious(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(mystery(mystery(self.a(x))))


def test_unknown_ops_are_reported_by_name_and_count():
    torch.manual_seed(0)
    _, gm = annotated(Mysterious(), torch.randn(3, 8))
    unknown = unknown_ops(gm)
    assert list(unknown.values()) == [2], unknown
    (name,) = unknown
    assert "mystery" in name
    flagged = [n for n in compute_nodes(gm) if not node_cost(n).known]
    assert len(flagged) == 2 and all("mystery" in str(n.target) for n in flagged)
    assert all(node_cost(n).fwd_flops > 0 for n in flagged), "unknown ops still get a size-based cost"

    prog = pipesplit.compile(Mysterious(), torch.randn(3, 8), num_stages=2, progress=False)
    assert prog.plan.unknown_ops == unknown
    lines = [line for line in prog.report().splitlines() if "mystery" in line]
    assert lines and "2" in lines[0].split("mystery", 1)[1], prog.report()


def test_known_ops_are_not_reported(small_gpt):
    gm, _ = small_gpt
    assert unknown_ops(gm) == {}


# ------------------------------------------------------------------------- profiling
def test_profile_times_every_node_and_keeps_batchnorm_stats():
    torch.manual_seed(0)
    case = CASE_BY_NAME["conv_bn"]
    model = case.build()
    (x,), _ = case.inputs(4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prog = pipesplit.compile(model, (x,), num_stages=2, cost="profile", progress=False)
    assert prog.plan.cost_name == "profile"
    timed = 0
    for stage in prog.stages:
        for node in stage.module.graph.nodes:
            if node.op in COMPUTE:
                t = node_cost(node).time_s
                assert t is not None and t > 0, f"{node.name} was not profiled"
                timed += 1
    assert timed == sum(len(s.nodes) for s in prog.stages)
    assert all(c > 0 for c in prog.plan.stage_costs)
    # profiling ran BatchNorm in train mode 7 times per node: none of it may stick
    state = prog.state_dict()
    assert state.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(state[key], value), f"profiling changed the program's {key}"
        assert torch.equal(model.state_dict()[key], value), f"profiling changed the model's {key}"
    # and the program still updates the stats like the model does
    ref = copy.deepcopy(model)
    batch = torch.randn(5, 3, 8, 8)
    assert_close(prog(batch), ref(batch), name="output")
    state = prog.state_dict()
    for key, value in ref.state_dict().items():
        assert_close(state[key], value, name=key)


@pytest.mark.parametrize("how", [dict(cost="profile"), dict(cost="hybrid"), dict(cost="profile", refine=1)],
                         ids=["profile", "hybrid", "refine"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_profiling_leaves_the_random_number_generators_alone(how, device):
    """Profiling runs the graph's dropout many times; the user's RNG streams must not move."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).to(device)
    x = torch.randn(4, 8, device=device)
    torch.manual_seed(0)
    cuda_before = torch.cuda.get_rng_state() if device == "cuda" else None
    pipesplit.compile(model, x, num_stages=2, progress=False, **how)
    if device == "cuda":
        assert torch.equal(torch.cuda.get_rng_state(), cuda_before), "compiling with a profile advanced the CUDA RNG"
    a = torch.rand(3)
    torch.manual_seed(0)
    b = torch.rand(3)
    assert torch.equal(a, b), "compiling with a profile advanced the CPU generator"


class _WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2.0)
        return self.b(torch.tanh(self.a(x)))


def test_profiling_leaves_the_example_input_alone():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    before = x.clone()
    pipesplit.compile(_WritesItsInput(), x, num_stages=2, cost="profile", progress=False)
    assert torch.equal(x, before), "profiling wrote the example input in place"


# ------------------------------------------------------------------------- cost specs
@pytest.fixture(scope="module")
def mlp_case():
    torch.manual_seed(0)
    case = CASE_BY_NAME["mlp"]
    (x,), _ = case.inputs(4)
    return case.build(), x


def _stage_nodes(prog):
    return [[n for n in s.module.graph.nodes if n.op in COMPUTE] for s in prog.stages]


def test_cost_params(mlp_case):
    model, x = mlp_case
    prog = pipesplit.compile(model, x, num_stages=3, cost="params", progress=False)
    assert prog.plan.cost_name == "params"
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(prog.plan.stage_costs) == total
    for cost, stage in zip(prog.plan.stage_costs, prog.stages):
        assert cost == sum(p.numel() * p.element_size() for p in stage.module.parameters())


def test_cost_uniform(mlp_case):
    model, x = mlp_case
    prog = pipesplit.compile(model, x, num_stages=3, cost="uniform", slack=0, progress=False)
    assert prog.plan.cost_name == "uniform"
    sizes = [len(s.nodes) for s in prog.stages]
    assert prog.plan.stage_costs == [float(n) for n in sizes]
    assert max(sizes) == -(-sum(sizes) // 3)  # exactly balanced (no tuples to keep together)


def test_cost_callable(mlp_case):
    model, x = mlp_case

    def linears(node):
        return 1.0 if node.target is ATEN.linear.default else 0.0

    prog = pipesplit.compile(model, x, num_stages=3, cost=linears, slack=0, progress=False)
    assert prog.plan.cost_name == "linears"
    per_stage = [sum(n.target is ATEN.linear.default for n in nodes) for nodes in _stage_nodes(prog)]
    assert prog.plan.stage_costs == [float(c) for c in per_stage]
    assert sorted(per_stage) == [3, 3, 3]  # 9 Linear layers, balanced exactly


def test_cost_object(mlp_case):
    model, x = mlp_case

    class ForwardOnly:
        def __init__(self):
            self.calls = []

        def node_cost(self, node, costs):
            self.calls.append((node.name, costs))
            return costs.fwd_flops

    obj = ForwardOnly()
    prog = pipesplit.compile(model, x, num_stages=2, cost=obj, progress=False)
    assert prog.plan.cost_name == "ForwardOnly"
    assert all(isinstance(c, NodeCost) for _, c in obj.calls)
    names = {name for name, _ in obj.calls}
    assert names == {n for s in prog.stages for n in s.nodes}
    for cost, nodes in zip(prog.plan.stage_costs, _stage_nodes(prog)):
        assert cost == sum(node_cost(n).fwd_flops for n in nodes)
    flops = pipesplit.compile(model, x, num_stages=2, progress=False)
    assert sum(prog.plan.stage_costs) < sum(flops.plan.stage_costs)  # forward only vs forward + backward


def test_unknown_cost_name_lists_the_choices(mlp_case):
    model, x = mlp_case
    with pytest.raises(pipesplit.CostError) as err:
        pipesplit.compile(model, x, num_stages=2, cost="flop", progress=False)
    msg = str(err.value)
    assert "'flop'" in msg
    for choice in ("flops", "params", "profile", "uniform"):
        assert choice in msg
    with pytest.raises(pipesplit.CostError):
        pipesplit.compile(model, x, num_stages=2, cost=42, progress=False)


# ------------------------------------------------------------------ the default cost: measured device rates
def test_default_cost_prices_each_op_as_overhead_flops_and_bytes():
    from pipesplit.passes.annotate.rates import DeviceRates, moved_bytes, priced

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    cap = capture(model, torch.randn(4, 16))
    gm = annotate_costs(cap.gm)
    rates = DeviceRates("cpu", forward_op_s=1e-5, backward_op_s=2e-5, flops_per_s=1e9, bytes_per_s=1e8)
    linear = next(n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    c = node_cost(linear)
    f, i, w = priced(linear, rates)
    assert f == pytest.approx(1e-5 + c.fwd_flops / 1e9 + moved_bytes(linear) / 1e8)
    assert i == pytest.approx(2e-5 + c.igrad_flops / 1e9 + moved_bytes(linear) / 1e8)
    weights = sum(node_cost(a).param_bytes for a in linear.all_input_nodes if a.op == "get_attr")
    assert weights == (16 * 32 + 32) * 4
    assert w == pytest.approx(c.wgrad_flops / 1e9 + 2 * weights / 1e8)
    relu = next(n for n in gm.graph.nodes if n.op == "call_function" and "relu" in str(n.target))
    assert priced(relu, rates)[2] == 0.0  # no weights, no weight gradient
    assert priced(relu, rates)[0] >= 1e-5  # a FLOP-free op still costs its overhead


def test_device_rates_are_measured_once_and_leave_the_rng_alone():
    from pipesplit.passes.annotate import rates

    rates._measure.cache_clear()
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    first = rates.device_rates("cpu")
    assert torch.equal(torch.rand(3), want)
    assert rates.device_rates("cpu") is first and rates._measure.cache_info().misses == 1
    assert first.flops_per_s > 1e8 and first.bytes_per_s > 1e8 and 0 < first.forward_op_s < 1e-3


def test_small_ops_are_no_longer_priced_near_zero():
    """A stage of tiny layers: FLOPs at a nominal rate priced it ~50x below its real time; the
    default now charges at least every op's measured overhead."""
    from pipesplit.bench.predict import stage_seconds
    from pipesplit.passes.plan.chain import compute_nodes
    from pipesplit.passes.annotate.rates import device_rates

    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU()) for _ in range(6)])
    prog = pipesplit.compile(model, torch.randn(4, 8), num_stages=2, progress=False)
    rates = device_rates("cpu")
    for stage, cost in zip(prog.stages, stage_seconds(prog, "flops", 1.0)):
        ops = len(compute_nodes(stage.module))
        assert cost.forward >= ops * rates.forward_op_s
        flops_only = sum(node_cost(n).fwd_flops for n in compute_nodes(stage.module)) / 5e10
        assert cost.forward > 10 * flops_only


def test_activations_norms_and_attention_are_priced_per_element():
    """GELU, layer norm and attention's softmax do work a FLOP count misses: priced per element."""
    from pipesplit.passes.annotate.rates import DeviceRates, heavy_elements, priced

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)

        def forward(self, x):
            q = self.ln(torch.nn.functional.gelu(self.lin(x))).view(x.shape[0], 2, 8, 8)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    cap = capture(Block(), torch.randn(4, 8, 16), dynamic=False)
    gm = annotate_costs(cap.gm)
    by = {str(n.target).split(".")[1] if "." in str(n.target) else str(n.target): n
          for n in gm.graph.nodes if n.op == "call_function"}
    assert heavy_elements(by["gelu"]) == (4 * 8 * 16, 0.0)
    assert heavy_elements(by["layer_norm"]) == (0.0, 4 * 8 * 16)
    assert heavy_elements(by["scaled_dot_product_attention"]) == (4 * 2 * 8 * 8, 0.0)  # the (T x S) scores
    assert heavy_elements(by["linear"]) == (0.0, 0.0)
    dynamic = annotate_costs(capture(Block(), torch.randn(4, 8, 16)).gm)  # a dynamic batch: priced at the example's
    gelu = next(n for n in dynamic.graph.nodes if n.op == "call_function" and "gelu" in str(n.target))
    assert not isinstance(gelu.meta["val"].shape[0], int), "the test needs a symbolic batch"
    assert heavy_elements(gelu) == (4 * 8 * 16, 0.0)
    plain = DeviceRates("cpu", forward_op_s=1e-6, backward_op_s=1e-6, flops_per_s=1e12, bytes_per_s=1e12)
    slow = DeviceRates("cpu", forward_op_s=1e-6, backward_op_s=1e-6, flops_per_s=1e12, bytes_per_s=1e12,
                       activation_s=(1e-6, 2e-6), norm_s=(3e-6, 4e-6))
    assert priced(by["gelu"], slow)[0] == pytest.approx(1e-6 + 512 * 1e-6)
    assert priced(by["gelu"], slow)[1] == pytest.approx(1e-6 + 512 * 2e-6)
    assert priced(by["layer_norm"], slow)[0] == pytest.approx(1e-6 + 512 * 3e-6, rel=1e-3)
    assert priced(by["linear"], slow) == priced(by["linear"], plain)


def test_the_flop_rate_follows_the_size_of_the_op():
    from pipesplit.passes.annotate.rates import DeviceRates

    r = DeviceRates("cpu", 1e-6, 1e-6, flops_per_s=4e10, bytes_per_s=1e10,
                    flop_curve=((1e6, 1e10), (1e8, 4e10)))
    assert r.rate_at(1e5) == 1e10 and r.rate_at(1e9) == 4e10  # held flat past the ends
    assert r.rate_at(1e7) == pytest.approx(2e10)  # halfway in log FLOPs: the geometric mean
    assert r.flop_seconds(1e6) == pytest.approx(1e-4) and r.flop_seconds(0) == 0.0
    assert DeviceRates("cpu", 1e-6, 1e-6, 4e10, 1e10).rate_at(1e3) == 4e10  # no curve: the one rate


def test_ranks_sharing_the_cpu_are_predicted_slower_while_they_compute_together(monkeypatch):
    import importlib

    from pipesplit.passes.annotate import rates

    predict_mod = importlib.import_module("pipesplit.bench.predict")
    from pipesplit.schedules import get_schedule

    assert rates.concurrent_slowdown(1) == 1.0
    assert rates.concurrent_slowdown(2) >= 1.0
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    prog = pipesplit.compile(model, torch.randn(8, 16), num_stages=2, progress=False)
    sched = get_schedule("1f1b", num_stages=2, num_ranks=2, num_microbatches=4)
    monkeypatch.setattr(predict_mod, "concurrent_slowdown", lambda k: 1.5 if k == 2 else 1.0)
    alone = predict_mod.predict(prog, sched, "flops", 8, local=False)
    shared = predict_mod.predict(prog, sched, "flops", 8)
    assert shared.costs == alone.costs  # the stages' times alone; the sharing is in the simulated step
    from pipesplit.schedules.shared import simulate_shared

    expect = simulate_shared(sched, alone.costs, alone.comm or 0.0, slowdown=lambda k: 1.5 if k == 2 else 1.0)
    assert shared.timeline.step_time == pytest.approx(expect.step_time)
    # the fill and the drain run one rank alone: slower than alone, faster than both ranks busy throughout
    assert alone.timeline.step_time < shared.timeline.step_time < 1.5 * alone.timeline.step_time
    pairs = list(zip(alone.timeline.stage_costs(), shared.timeline.stage_costs()))
    assert all(a.backward * (1 - 1e-9) <= s.backward <= 1.5 * a.backward * (1 + 1e-9) for a, s in pairs)
    assert any(s.forward + s.backward < 1.5 * (a.forward + a.backward) * (1 - 1e-9) for a, s in pairs)


def test_profiling_shows_no_progress_bar_unless_asked_or_on_a_terminal(capsys):
    """cost="hybrid" drew its bar by default, into pipes and log files too: now only progress=True or a terminal."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    pipesplit.compile(model, torch.randn(4, 8), num_stages=2, cost="hybrid")  # stderr is captured: no terminal
    assert "profiling nodes" not in capsys.readouterr().err
    pipesplit.compile(model, torch.randn(4, 8), num_stages=2, cost="hybrid", progress=True)
    assert "profiling nodes" in capsys.readouterr().err
