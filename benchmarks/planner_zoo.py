"""The models of the planner benchmark, each with the list of top-level layers a reference splits.

Five models with random weights (nothing is downloaded):

- ``gpt_vocab32k``: pipesplit's GPT, width 256, 12 blocks, a 32k-token vocabulary whose
  (tied) output head costs about ten blocks;
- ``llama``: ``transformers.LlamaForCausalLM`` from a small config;
- ``bert``: ``transformers.BertModel`` from a small config (embeddings, encoder, pooler);
- ``unet``: a U-Net whose encoder outputs are concatenated back in the decoder (long
  skips crossing every middle cut; the decoder levels cost about twice the encoder's);
- ``uneven_mix``: attention, MLP blocks of widths 384-4096, depthwise-free 1-D
  convolutions and a normalisation-only block, in one residual stack.

Each model comes with its ``layers``: what a DeepSpeed ``PipelineModule`` would list, in
the order they run, tagged ``input`` (embedding, stem), ``block`` (the repeated units a
``split_spec`` or torchtitan counts) or ``output`` (final norm, head). A layer may span
several modules (the GPT's token and position embeddings); a stage that starts with a
layer starts at the first of its module paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipesplit.models import gpt

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Layer:
    """One entry of the model's layer list."""

    paths: tuple[str, ...]  # module paths in the order they run; a stage starts at paths[0]
    kind: str  # "input", "block" or "output"
    typename: str  # the class name DeepSpeed's "type:" method matches


@dataclass(frozen=True)
class BenchModel:
    """A benchmark model: how to build it, an input of ``batch`` samples, and its layer list."""

    name: str
    description: str
    heterogeneous: bool  # layers of very different costs (the "heterogeneous models")
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Inputs]
    layers: Callable[[nn.Module], list[Layer]]
    type_regex: str  # DeepSpeed's partition_method="type:<regex>" a user would pick


def _layer(model: nn.Module, kind: str, *paths: str) -> Layer:
    return Layer(tuple(paths), kind, type(model.get_submodule(paths[0])).__name__)


# ------------------------------------------------------------------------------ GPT
GPT_VOCAB, GPT_SEQ = 32_000, 32


def _gpt_layers(model: nn.Module) -> list[Layer]:
    blocks = [_layer(model, "block", f"blocks.{i}") for i in range(len(model.blocks))]  # type: ignore[arg-type]
    return [_layer(model, "input", "tok", "pos"), *blocks, _layer(model, "output", "ln_f"),
            _layer(model, "output", "head")]


# ------------------------------------------------------------------------------ Llama
LLAMA_VOCAB, LLAMA_SEQ = 8_192, 32


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=LLAMA_VOCAB, max_position_embeddings=LLAMA_SEQ,
                      use_cache=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _llama_layers(model: nn.Module) -> list[Layer]:
    n = len(model.model.layers)  # type: ignore[union-attr,arg-type]
    return [_layer(model, "input", "model.embed_tokens"), _layer(model, "input", "model.rotary_emb"),
            *[_layer(model, "block", f"model.layers.{i}") for i in range(n)],
            _layer(model, "output", "model.norm"), _layer(model, "output", "lm_head")]


# ------------------------------------------------------------------------------ BERT
BERT_VOCAB, BERT_SEQ = 30_522, 64


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=BERT_VOCAB, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                     intermediate_size=1024, max_position_embeddings=BERT_SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertModel(cfg)


def _bert_inputs(batch: int) -> Inputs:
    ids = torch.randint(0, BERT_VOCAB, (batch, BERT_SEQ))
    mask = torch.ones(batch, BERT_SEQ, dtype=torch.long)
    mask[:, -8:] = 0  # padding at the end: the extended attention mask is a real tensor
    return (ids,), {"attention_mask": mask}


def _bert_layers(model: nn.Module) -> list[Layer]:
    n = len(model.encoder.layer)  # type: ignore[union-attr,arg-type]
    return [_layer(model, "input", "embeddings"),
            *[_layer(model, "block", f"encoder.layer.{i}") for i in range(n)],
            _layer(model, "output", "pooler")]


# ------------------------------------------------------------------------------ U-Net
class ConvBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and ReLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class DownBlock(nn.Module):
    """Halve the resolution (first block: keep it), then a ConvBlock."""

    def __init__(self, cin: int, cout: int, pool: bool):
        super().__init__()
        self.pool = pool
        self.conv = ConvBlock(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.max_pool2d(x, 2) if self.pool else x)


class UpBlock(nn.Module):
    """Double the resolution, concatenate the encoder's skip, then a ConvBlock."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = ConvBlock(2 * cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """A 4-level U-Net: every encoder level's output skips to its decoder level."""

    def __init__(self, base: int = 16, levels: int = 4, classes: int = 4):
        super().__init__()
        widths = [base * 2**i for i in range(levels + 1)]
        self.stem = nn.Sequential(nn.Conv2d(3, base, 3, padding=1), nn.ReLU())
        self.down = nn.ModuleList(
            DownBlock(widths[max(i - 1, 0)], widths[i], pool=i > 0) for i in range(levels)
        )
        self.mid = DownBlock(widths[levels - 1], widths[levels], pool=True)
        self.up = nn.ModuleList(UpBlock(widths[i + 1], widths[i]) for i in reversed(range(levels)))
        self.head = nn.Conv2d(base, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        x = self.mid(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)


UNET_RES = 64


def _unet_layers(model: nn.Module) -> list[Layer]:
    levels = len(model.down)  # type: ignore[arg-type]
    return [_layer(model, "input", "stem"),
            *[_layer(model, "block", f"down.{i}") for i in range(levels)],
            _layer(model, "block", "mid"),
            *[_layer(model, "block", f"up.{i}") for i in range(levels)],
            _layer(model, "output", "head")]


# ------------------------------------------------------------------------------ uneven mix
class AttnBlock(nn.Module):
    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(att.transpose(1, 2).reshape(b, t, d))


class MLPBlock(nn.Module):
    def __init__(self, d: int, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, width)
        self.out = nn.Linear(width, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.norm(x))))


class ConvMixBlock(nn.Module):
    """A 1-D convolution along the sequence (kernel 9): many FLOPs per parameter."""

    def __init__(self, d: int, kernel: int = 9):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.conv = nn.Conv1d(d, d, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(self.norm(x).transpose(1, 2)).transpose(1, 2)


class NormBlock(nn.Module):
    """Only normalisations and pointwise ops: no FLOP-heavy op, no weight to speak of."""

    def __init__(self, d: int, depth: int = 6):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            x = x + torch.tanh(norm(x)) * torch.sigmoid(x)
        return x


MIX_DIM, MIX_SEQ = 192, 64
MIX_PLAN = ["attn", 3072, "attn", "attn", 768, "conv", 4096, "attn", "norm", 384, 2048, "conv"]


class UnevenMix(nn.Module):
    """A residual stack whose blocks differ in kind and width (see ``MIX_PLAN``)."""

    def __init__(self, d: int = MIX_DIM, plan: list[Any] = MIX_PLAN, classes: int = 16):
        super().__init__()

        def make(spec: Any) -> nn.Module:
            if spec == "attn":
                return AttnBlock(d)
            if spec == "conv":
                return ConvMixBlock(d)
            if spec == "norm":
                return NormBlock(d)
            return MLPBlock(d, int(spec))

        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(make(s) for s in plan)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _mix_layers(model: nn.Module) -> list[Layer]:
    n = len(model.blocks)  # type: ignore[arg-type]
    return [_layer(model, "input", "inp"), *[_layer(model, "block", f"blocks.{i}") for i in range(n)],
            _layer(model, "output", "norm"), _layer(model, "output", "head")]


MODELS = [
    BenchModel(
        "gpt_vocab32k", "GPT, 12 blocks, width 256, vocab 32,000 (tied head), sequence 32", True,
        lambda: gpt(layers=12, dim=256, vocab=GPT_VOCAB, seq=GPT_SEQ, heads=4),
        lambda b: ((torch.randint(0, GPT_VOCAB, (b, GPT_SEQ)),), {}),
        _gpt_layers, "Block",
    ),
    BenchModel(
        "llama", "LlamaForCausalLM, 8 layers, width 256, vocab 8,192, sequence 32", False,
        _llama, lambda b: ((torch.randint(0, LLAMA_VOCAB, (b, LLAMA_SEQ)),), {}),
        _llama_layers, "DecoderLayer",
    ),
    BenchModel(
        "bert", "BertModel, 8 layers, width 256, vocab 30,522, sequence 64 with padding mask", False,
        _bert, _bert_inputs, _bert_layers, "BertLayer",
    ),
    BenchModel(
        "unet", "U-Net, 4 levels, 16-256 channels, 64x64 images, BatchNorm", True,
        UNet, lambda b: ((torch.randn(b, 3, UNET_RES, UNET_RES),), {}), _unet_layers, "Block",
    ),
    BenchModel(
        "uneven_mix", "12 mixed blocks (attention, MLP 384-4096 wide, conv, norm-only), width 192, sequence 64",
        True, UnevenMix, lambda b: ((torch.randn(b, MIX_SEQ, MIX_DIM),), {}), _mix_layers, "Block",
    ),
]
MODEL_BY_NAME = {m.name: m for m in MODELS}
