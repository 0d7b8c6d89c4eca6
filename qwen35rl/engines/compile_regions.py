"""torch.compile for the pointwise parts of Qwen3.5's decoder layers: RMS norms (plain and gated) and dense MLPs.

In eager mode each norm is half a dozen elementwise kernels over the activations in fp32 (upcast, square, mean,
rsqrt, scale, the 1 + weight offset, the gate's SiLU), and the MLP's SiLU-times-up another two; compiled, each is
one kernel. The projections stay cuBLAS matmuls and the GDN recurrence stays fla's kernels, so the regions compile
without graph breaks. Shapes are dynamic: packed micro batches change their token count every call.
"""
from __future__ import annotations

from typing import Iterable, List

import torch
from torch import nn

RECOMPILE_LIMIT = 64
"""Dynamo keeps one compiled graph per guard set of a code object; every norm class shares one forward across its
instances and sees inputs of two to four dims and two dtypes: more entries than the default limit of 8."""

NORMS = ("input_layernorm", "post_attention_layernorm")


def layer_parts(layer: nn.Module) -> List[nn.Module]:
    """The modules of one decoder layer worth compiling (a vision block has none of these names)."""
    parts = [getattr(layer, name) for name in NORMS if hasattr(layer, name)]
    mixer = getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)
    for name in ("norm", "q_norm", "k_norm"):
        if mixer is not None and isinstance(getattr(mixer, name, None), nn.Module):
            parts.append(getattr(mixer, name))
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and type(mlp).__name__.endswith("MLP"):  # a sparse MoE block routes: left eager
        parts.append(mlp)
    return parts


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep at least `limit` graphs per code object (the setting's name differs across torch versions);
    past the limit a new guard set runs eagerly."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


def compile_layer_parts(layers: Iterable[nn.Module]) -> int:
    """Compile every layer's parts in place (nn.Module.compile); returns how many modules were compiled."""
    raise_recompile_limit(RECOMPILE_LIMIT)
    n = 0
    for layer in layers:
        for part in layer_parts(layer):
            part.compile(dynamic=True)
            n += 1
    return n
