"""Which kernel runs a scaled-dot-product attention node on a device, and the work that kernel does.

The math kernel materialises the (..., T, S) score matrix and runs a softmax over it: its price
grows per element of that matrix. A fused kernel (flash, memory-efficient, cuDNN) streams
blocks of it through on-chip memory and never writes it out: it costs its matrix-multiply FLOPs
and the bytes of q, k, v and the output, nothing per score element. On CUDA torch runs a fused
kernel unless none applies (float64, or every fused backend switched off); elsewhere the
per-element price measured on that device stands.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from pipesplit.passes.annotate.flops import op_name, shape_of

FUSED = ("flash", "efficient", "cudnn")
# an attention op named by its kernel: that kernel, whatever the device
_NAMED = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_flash_attention_for_cpu": "math",  # priced as the CPU's measured softmax
}
ATTENTION = frozenset(_NAMED) | {"scaled_dot_product_attention"}


def attention_kernel(node: fx.Node, device_type: str) -> str | None:
    """``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``: the kernel ``node`` runs on a device of
    ``device_type``; None when ``node`` is no attention.

    The choice follows torch's for CUDA, to first order: flash for half precision with a head
    dimension up to 256 (a multiple of 8) and no explicit mask, memory-efficient otherwise (float32,
    a mask), math for float64 or when the fused backends are switched off
    (``torch.nn.attention.sdpa_kernel``). When unsure on CUDA: a fused kernel.
    """
    name = op_name(node.target) if node.op == "call_function" else ""
    if name not in ATTENTION:
        return None
    if name in _NAMED:
        return _NAMED[name]
    if device_type != "cuda":
        return "math"
    q = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    dtype = q.dtype if isinstance(q, torch.Tensor) else torch.float32
    head = (shape_of(node.args[0]) or (0,))[-1]
    backends = torch.backends.cuda
    flash, efficient, cudnn = backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(), backends.cudnn_sdp_enabled()
    if dtype == torch.float64 or not (flash or efficient or cudnn):
        return "math"
    if flash and dtype in (torch.float16, torch.bfloat16) and head <= 256 and head % 8 == 0 and _mask(node) is None:
        return "flash"
    return "efficient" if efficient or not cudnn else "cudnn"


def _mask(node: fx.Node) -> Any:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


# where each attention op takes is_causal among its positional arguments
_CAUSAL_AT = {"scaled_dot_product_attention": 5, "_scaled_dot_product_flash_attention": 4,
              "_scaled_dot_product_efficient_attention": 6, "_scaled_dot_product_cudnn_attention": 6}


def _causal(node: fx.Node) -> bool:
    at = _CAUSAL_AT.get(op_name(node.target), len(node.args))
    return bool(node.args[at] if len(node.args) > at else node.kwargs.get("is_causal", False))


def fused_work(node: fx.Node, fwd_flops: float, igrad_flops: float) -> tuple[float, float]:
    """(forward, backward) FLOPs a fused kernel spends on ``node``, whose formula counts
    ``fwd_flops`` (Q K^T and P V) and ``igrad_flops``: the backward recomputes Q K^T (the scores
    were never stored), and a causal mask skips the blocks above the diagonal (about half)."""
    q, k = shape_of(node.args[0]) or (), shape_of(node.args[1]) or ()
    share = 0.5 if _causal(node) and q and k and q[-2] == k[-2] else 1.0
    scores = fwd_flops * (q[-1] / (q[-1] + (shape_of(node.args[2]) or q)[-1])) if q else 0.0  # the Q K^T part
    return fwd_flops * share, (igrad_flops + scores) * share if igrad_flops else 0.0
