"""Attention is priced by the kernel the device runs, and a GPU probes its FLOP rate at the graph's sizes.

On an H100 the per-element softmax price (2.57e-9 s measured there) applied to the B·H·T×T
scores of sdpa gave 16.5 ms of backward per attention node, where the fused kernel takes
~0.4 ms: a fused kernel never materialises the score matrix. These tests run on CPU with a
GPU's rates written out (a DeviceRates for "cuda:0" with the figures issue 24 measured).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import pipesplit
from pipesplit.capture import capture
from pipesplit.passes.annotate.attention import attention_kernel, fused_work
from pipesplit.passes.annotate.costs import annotate_costs
from pipesplit.passes.annotate.rates import (
    MATMUL_SIZES, DeviceRates, heavy_elements, largest_matmul, priced, probe_points,
)
from pipesplit.meta import node_cost
from pipesplit.models import gpt

# the H100's measured figures (issue 24): per-op overhead, top of the FLOP curve, softmax per element
H100 = dict(forward_op_s=26e-6, backward_op_s=40e-6, flops_per_s=9.9e12, bytes_per_s=2e12,
            activation_s=(2.57e-9, 2.57e-9))


class Attention(nn.Module):
    def __init__(self, causal: bool = False, mask: bool = False):
        super().__init__()
        self.causal, self.mask = causal, mask

    def forward(self, q, k, v):
        if self.mask:
            m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _sdpa_node(batch=2, heads=12, seq=512, dim=64, dtype=torch.float32, causal=False, mask=False):
    qkv = [torch.randn(batch, heads, seq, dim, dtype=dtype, requires_grad=True) for _ in range(3)]
    gm = annotate_costs(capture(Attention(causal, mask), tuple(qkv), dynamic=False).gm, [True] * 3)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and attention_kernel(n, "cuda")]
    return node


def test_a_fused_kernel_on_cuda_is_priced_without_a_term_per_score():
    """GPT 12x768 at seq 512, a microbatch of 2: the per-element price gives >10 ms of backward per
    attention node, the fused kernel's price stays under a millisecond (~0.4 ms measured)."""
    node = _sdpa_node()
    cuda, cpu = DeviceRates("cuda:0", **H100), DeviceRates("cpu", **H100)
    assert attention_kernel(node, "cuda") == "efficient" and attention_kernel(node, "cpu") == "math"
    f_gpu, i_gpu, _ = priced(node, cuda)
    f_cpu, i_cpu, _ = priced(node, cpu)
    assert i_cpu > 10e-3 and f_cpu > 10e-3, "the math kernel: per element of the 2x12x512x512 scores"
    assert i_gpu < 1e-3 and f_gpu < 0.5e-3
    # no per-element term at all: the CUDA price ignores the softmax rate, the CPU price is mostly it
    no_softmax = DeviceRates("cuda:0", **{**H100, "activation_s": (0.0, 0.0)})
    assert priced(node, no_softmax) == (f_gpu, i_gpu, 0.0)
    c = node_cost(node)
    fwd, bwd = fused_work(node, c.fwd_flops, c.igrad_flops)
    qkv_out = sum(node_cost(a).out_bytes for a in node.all_input_nodes) + c.out_bytes
    # a GPU op costs the longer of the host's launch and the device's work (they overlap)
    assert f_gpu == pytest.approx(max(cuda.forward_op_s, cuda.flop_seconds(fwd) + qkv_out / cuda.bytes_per_s))
    assert i_gpu == pytest.approx(max(cuda.backward_op_s, cuda.flop_seconds(bwd) + 2 * qkv_out / cuda.bytes_per_s))
    assert bwd == pytest.approx(c.igrad_flops + c.fwd_flops / 2), "backward recomputes Q K^T"


def test_the_cuda_price_per_score_falls_with_the_length_while_the_math_price_per_score_stays():
    """Per element of the T x T scores, the fused price falls as T grows (fixed costs spread, FLOPs
    per score constant and cheap); the math price keeps paying the softmax for each."""
    per_score = {}
    for seq in (128, 1024):
        node = _sdpa_node(batch=1, heads=4, seq=seq)
        scores = 4 * seq * seq
        per_score[seq] = [sum(priced(node, DeviceRates(d, **H100))) / scores for d in ("cuda:0", "cpu")]
    (gpu_short, cpu_short), (gpu_long, cpu_long) = per_score[128], per_score[1024]
    assert gpu_long < gpu_short and gpu_long < 0.2 * cpu_long
    assert cpu_long > 2 * 2.57e-9 and cpu_long == pytest.approx(cpu_short, rel=0.5)


def test_the_kernel_follows_dtype_mask_and_the_backends_switched_on():
    assert attention_kernel(_sdpa_node(seq=16, dtype=torch.bfloat16), "cuda") == "flash"
    assert attention_kernel(_sdpa_node(seq=16, dtype=torch.float32), "cuda") == "efficient"
    assert attention_kernel(_sdpa_node(seq=16, dtype=torch.bfloat16, mask=True), "cuda") == "efficient"
    assert attention_kernel(_sdpa_node(seq=16, dtype=torch.float64), "cuda") == "math"
    assert attention_kernel(_sdpa_node(seq=16, dtype=torch.bfloat16), "cpu") == "math"
    node = _sdpa_node(seq=16, dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.MATH):  # the user switched the fused kernels off: math, per element
        assert attention_kernel(node, "cuda") == "math"
        assert priced(node, DeviceRates("cuda:0", **H100))[0] > heavy_elements(node)[0] * 2.57e-9
    assert heavy_elements(node) == (2 * 12 * 16 * 16, 0.0)


def test_a_causal_fused_kernel_skips_half_the_blocks():
    full, causal = _sdpa_node(seq=256), _sdpa_node(seq=256, causal=True)
    c = node_cost(full)
    assert node_cost(causal).fwd_flops == c.fwd_flops  # the FLOP count itself is unchanged
    assert fused_work(causal, c.fwd_flops, c.igrad_flops)[0] == pytest.approx(c.fwd_flops / 2)


def test_a_gpu_probes_its_flop_rate_at_the_graphs_largest_multiply_in_its_dtype():
    big = (4096, 768, 50257, "bfloat16")
    assert probe_points("cpu", big) == tuple((m, k, n, "float32") for m, k, n in MATMUL_SIZES)
    assert probe_points("cuda", None) == probe_points("cpu", None)
    gpu = probe_points("cuda", big)
    assert (4096, 768, 16384, "bfloat16") in gpu, "the graph's own multiply, its sides capped"
    assert {p[3] for p in gpu} == {"bfloat16"} and len(gpu) == len(MATMUL_SIZES) + 1
    assert [p[0] * p[1] * p[2] for p in gpu] == sorted(p[0] * p[1] * p[2] for p in gpu)


def test_the_largest_multiply_of_a_gpt_is_its_head_and_the_planner_probes_it(monkeypatch):
    model = gpt(layers=2, dim=32, vocab=300, seq=16, heads=2).to(torch.bfloat16)
    x = torch.randint(0, 300, (4, 16))
    gm = annotate_costs(capture(model, x, dynamic=False).gm)
    assert largest_matmul(gm.graph.nodes) == (4 * 16, 32, 300, "bfloat16")

    import pipesplit.passes.plan.planner as planner

    asked = []
    real = planner.device_rates
    monkeypatch.setattr(planner, "device_rates", lambda device, largest=None: asked.append((device, largest))
                        or real(device, largest))
    pipesplit.compile(model, x, num_stages=2, schedule="1f1b", num_microbatches=2, progress=False)
    assert asked == [("cpu", (4 * 16, 32, 300, "bfloat16"))]
