"""How the reference tools split a model's layer list, turned into pipesplit split points.

Every reference assigns whole layers (see ``planner_zoo.Layer``) to stages; a split is
returned as ``parts``, DeepSpeed's convention: stage ``s`` holds layers
``parts[s]:parts[s + 1]``. :func:`split_points` turns parts into the module paths that
``pipesplit.compile(..., split_points=...)`` takes, so that every method runs through
the same split, runtime and measurement.

- DeepSpeed (``deepspeed.runtime.pipe.PipelineModule._partition_layers``): ``uniform``
  calls ``partition_uniform(num_layers, num_stages)``; ``parameters`` calls
  ``partition_balanced`` on each layer's count of trainable parameters (a tied weight
  counts in every layer that holds it, as DeepSpeed's ``_count_layer_params`` counts
  it); ``type:<regex>`` calls ``partition_balanced`` on 0/1 weights, 1 where the
  layer's class name matches the regex (case-insensitive ``search``). The functions
  are DeepSpeed's own, imported from ``deepspeed.runtime.utils``.
- torchtitan (``generate_llm_fqn_per_model_part``): the blocks plus ``input_weight``
  (embedding) and ``output_weight`` (final norm + head) "effective layers" are dealt out
  evenly, the first ``remainder`` stages taking one more; stage 0's share includes the
  input weight and the last stage's the output weight. torchtitan's defaults
  (``pipeline_parallel_first_stage_less_layers = pipeline_parallel_last_stage_less_layers
  = 1``) are used. Re-implemented here from its description so torchtitan is not a
  run-time dependency; it applies to any model whose layers are inputs, blocks, outputs.
- PyTorch (``torch.distributed.pipelining`` with a ``split_spec``): equal numbers of
  blocks per stage, ``SplitPoint.BEGINNING`` at the first block of each stage; the
  embedding stays with the first stage and the head with the last. When the blocks do
  not divide evenly the first stages take one more (the tutorials' ``layers_per_rank =
  n_layers // world_size`` would pile the whole remainder on the last stage).
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Callable, Sequence

import torch
from torch import nn

from planner_zoo import Layer

Parts = list[int]


def _deepspeed_utils():  # type: ignore[no-untyped-def]
    """``deepspeed.runtime.utils``; on a machine without a GPU, with DeepSpeed's CPU accelerator."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # saves DeepSpeed's probing and its warning
    return importlib.import_module("deepspeed.runtime.utils")


def deepspeed_version() -> str:
    _deepspeed_utils()
    import deepspeed

    return str(deepspeed.__version__)


def layer_param_counts(model: nn.Module, layers: Sequence[Layer]) -> list[int]:
    """Trainable parameters per layer, each layer counted on its own (as DeepSpeed counts)."""
    counts = []
    for layer in layers:
        seen: dict[int, int] = {}
        for path in layer.paths:
            for p in model.get_submodule(path).parameters():
                if p.requires_grad:
                    seen[id(p)] = p.numel()
        counts.append(sum(seen.values()))
    return counts


def deepspeed_parts(method: str, model: nn.Module, layers: Sequence[Layer], num_stages: int) -> Parts:
    """The ``parts`` DeepSpeed's ``PipelineModule(partition_method=method)`` computes."""
    ds = _deepspeed_utils()
    method = method.lower()
    if method == "uniform":
        parts = ds.partition_uniform(num_items=len(layers), num_parts=num_stages)
    elif method == "parameters":
        parts = ds.partition_balanced(weights=layer_param_counts(model, layers), num_parts=num_stages)
    elif method.startswith("type:"):
        regex = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if regex.search(layer.typename) else 0 for layer in layers]
        if not any(weights):
            raise ValueError(f"partition method {method!r} matches no layer type")
        parts = ds.partition_balanced(weights=weights, num_parts=num_stages)
    else:
        raise ValueError(f"unknown DeepSpeed partition method {method!r}")
    return [int(p) for p in parts]


def torchtitan_parts(layers: Sequence[Layer], num_stages: int, input_weight: int = 1, output_weight: int = 1) -> Parts:
    """torchtitan's layer counting with weights for the embedding and the output modules."""
    n_in = sum(1 for x in layers if x.kind == "input")
    n_blocks = sum(1 for x in layers if x.kind == "block")
    effective = n_blocks + input_weight + output_weight
    per, extra = divmod(effective, num_stages)
    if per == 0 or input_weight > per or output_weight > per:
        raise ValueError(
            f"torchtitan cannot split {n_blocks} blocks (+{input_weight} input, +{output_weight} output) "
            f"into {num_stages} stages"
        )
    parts, block = [0], 0
    for s in range(num_stages - 1):
        share = per + (1 if s < extra else 0) - (input_weight if s == 0 else 0)
        block = min(n_blocks, block + share)
        parts.append(n_in + block)
    parts.append(len(layers))
    return parts


def even_block_parts(layers: Sequence[Layer], num_stages: int) -> Parts:
    """Equal numbers of blocks per stage (the first ``remainder`` stages one more)."""
    n_in = sum(1 for x in layers if x.kind == "input")
    n_blocks = sum(1 for x in layers if x.kind == "block")
    if n_blocks < num_stages:
        raise ValueError(f"{n_blocks} blocks cannot fill {num_stages} stages")
    per, extra = divmod(n_blocks, num_stages)
    parts, block = [0], 0
    for s in range(num_stages - 1):
        block += per + (1 if s < extra else 0)
        parts.append(n_in + block)
    parts.append(len(layers))
    return parts


def split_points(layers: Sequence[Layer], parts: Parts) -> list[str]:
    """Module paths where stages 1.. start, for ``pipesplit.compile(split_points=...)``."""
    if parts[0] != 0 or parts[-1] != len(layers) or any(b <= a for a, b in zip(parts, parts[1:])):
        raise ValueError(f"parts {parts} do not give every stage at least one of the {len(layers)} layers")
    return [layers[p].paths[0] for p in parts[1:-1]]


BaselineFn = Callable[[nn.Module, Sequence[Layer], int, str], Parts]

BASELINES: dict[str, BaselineFn] = {
    "DeepSpeed uniform": lambda model, layers, k, regex: deepspeed_parts("uniform", model, layers, k),
    "DeepSpeed parameters": lambda model, layers, k, regex: deepspeed_parts("parameters", model, layers, k),
    "DeepSpeed type:": lambda model, layers, k, regex: deepspeed_parts(f"type:{regex}", model, layers, k),
    "torchtitan": lambda model, layers, k, regex: torchtitan_parts(layers, k),
    "PyTorch even": lambda model, layers, k, regex: even_block_parts(layers, k),
}
