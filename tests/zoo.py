"""The model zoo the tests split: each entry builds a model and its example inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipesplit.models import gpt


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]  # batch -> (args, kwargs)
    max_stages: int = 8


class MLP(nn.Module):
    def __init__(self, d: int = 16, depth: int = 8):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(depth)])
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        return self.out(self.layers(x))


class LongSkip(nn.Module):
    """Residual net whose input skip connection is added back only at the very end."""

    def __init__(self, d: int = 16, depth: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.body = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        skip = self.inp(x)
        h = skip
        for layer in self.body:
            h = h + torch.tanh(layer(h))
        return self.head(h + skip)


class ConvBN(nn.Module):
    """A CNN with BatchNorm (train mode: running stats must update exactly) and a skip."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()) for _ in range(4)
        )
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        first = x
        for b in self.blocks:
            x = b(x)
        x = x + first
        return self.fc(x.mean(dim=(2, 3)))


class LateKwarg(nn.Module):
    """A keyword argument (``bias``) first used by the last layer."""

    def __init__(self, d: int = 16, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x, *, bias=None, scale: float = 1.0):
        for layer in self.layers:
            x = F.relu(layer(x))
        if bias is not None:
            x = x + bias
        return x * scale


class InputViewWrite(nn.Module):
    """The caller's input written in place through a view (``x.t().mul_``) at the front, and ``x`` itself
    read again by the last layer (the torchrun fuzz leg's draw: the last stage read the input unwritten)."""

    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        h = x.t().mul_(2.0).t()
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h + x


class DictTupleOut(nn.Module):
    """Returns a dict holding a tuple, a tensor from an early layer and a non-tensor constant."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)
        self.extra = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.d = nn.Linear(d, 2)

    def forward(self, x):
        h1 = torch.relu(self.a(x))
        h2 = torch.relu(self.b(h1))
        h3 = self.extra(torch.relu(self.c(h2)))
        return {"pair": (self.d(h3), h1), "hidden": h2, "n": None}


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=128, n_positions=32, use_cache=False,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, use_cache=False, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _x(d: int = 16) -> Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda b: ((torch.randn(b, d),), {})


def _ids(vocab: int, t: int) -> Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda b: ((torch.randint(0, vocab, (b, t)),), {})


CASES = [
    Case("mlp", MLP, _x()),
    Case("long_skip", LongSkip, _x()),
    Case("gpt_tied", lambda: gpt(layers=4, dim=32, vocab=64, seq=16, heads=2), _ids(64, 16)),
    Case("conv_bn", ConvBN, lambda b: ((torch.randn(b, 3, 8, 8),), {})),
    Case("late_kwarg", LateKwarg, lambda b: ((torch.randn(b, 16),), {"bias": torch.randn(b, 16), "scale": 0.5})),
    Case("dict_tuple_out", DictTupleOut, _x()),
    Case("hf_gpt2", hf_gpt2, _ids(128, 16)),
    Case("hf_llama", hf_llama, _ids(128, 16)),
]
# by name only (tests/dist_check.py): a model that writes its input would need the CASES tests to copy it
CASE_BY_NAME = {c.name: c for c in [*CASES, Case("input_view_write", InputViewWrite, _x())]}


def weighted_loss(out: Any, seed: int = 0) -> torch.Tensor:
    """A scalar that depends on every float output element with a fixed random weight."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return sum((x * torch.randn(x.shape, generator=gen).to(x.device)).sum() for x in leaves)  # type: ignore[return-value]


def tiny_llama() -> nn.Module:
    """A two-layer Hugging Face Llama (random weights) that takes any sequence length up to 2048."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, use_cache=False, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    return LlamaForCausalLM(cfg)


def logits_of(out: Any) -> Any:
    """A model's logits: the tensor itself, or a Hugging Face output's ``.logits``."""
    return out if isinstance(out, torch.Tensor) else out.logits
