"""The transformers-generate (hf) rollout engine: the sequences it holds per device, its static cache, its prefill,
a decode step's sampler and the larger of the two transients."""
from __future__ import annotations

import math
from typing import Any, Optional

from qwen35rl.config import params as P
from qwen35rl.config.layout import Layout
from qwen35rl.config.memory.common import FP32, GDN_CHUNK, dtype_bytes, gdn_kernels, gib, sequence_length
from qwen35rl.config.memory.rollout import kv_cache_bytes_per_token


def hf_engine_sequences(cfg: Any, layout: Layout) -> int:
    """Sequences the transformers-generate engine holds at once on a device: its share of the step's responses
    (over the rollout devices: every device when colocated, the rollout pool with placement=split)."""
    return math.ceil(int(cfg["data"]["train_batch_size"]) * int(cfg["rollout"]["n"]) / max(layout.rollout_world, 1))


def hf_static_cache_gib(cfg: Any, layout: Layout) -> float:
    """transformers' StaticCache of the hf engine, per row: K and V of every full-attention layer for the prompt
    width plus max_new_tokens, and per GDN layer the fp32 recurrent state and `linear_conv_kernel_dim` conv
    columns in the model dtype."""
    m = cfg["model"]
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    conv = (2 * nk * dk + nv * dv) * int(m["linear_conv_kernel_dim"]) * dtype_bytes(m["dtype"])
    per_row = (sequence_length(cfg) * kv_cache_bytes_per_token(cfg, layout)
               + P.layer_kinds(m).count("linear") * (nv * dk * dv * FP32 + conv))
    return gib(hf_engine_sequences(cfg, layout) * per_row)


def hf_prefill_gib(cfg: Any, layout: Layout, kernels: Optional[str] = None) -> float:
    """The hf engine's prefill of all rows (no autograd, one layer at a time): a GDN layer's live tensors, which
    exceed an attention layer's, plus the [rows, 1, prompt, prompt + new] boolean mask. torch fallback (counted on
    the 0.8B modules, 106 KB per prompt token there): conv output, z and the residual stream in the model dtype;
    in fp32 3 value-sized and 6 key-sized tensors and three [64]-wide chunk matrices per head and token, and per
    row four recurrent states and two chunk temporaries. fla (not measured): the conv output and contiguous q/k/v,
    normed q and k, z, w, u, v_new, the kernel output, A, the per-chunk states and the residual stream in the model
    dtype, g in fp32, one fp32 final state per row."""
    m = cfg["model"]
    rows, width = hf_engine_sequences(cfg, layout), int(cfg["data"]["max_prompt_length"])
    h, cb = int(m["hidden_size"]), dtype_bytes(m["dtype"])
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    value_dim, conv_dim, state = nv * dv, 2 * nk * dk + nv * dv, nv * dk * dv
    if gdn_kernels(cfg, kernels) == "torch":
        per_token = cb * (conv_dim + value_dim + 2 * h) + FP32 * (3 * value_dim + 6 * nv * dk + 3 * nv * GDN_CHUNK)
        per_row = FP32 * (4 * state + 2 * nv * GDN_CHUNK * dv)
    else:
        per_token = (cb * (2 * conv_dim + 2 * nk * dk + 4 * value_dim + nv * dk + nv * GDN_CHUNK + state / GDN_CHUNK
                           + 2 * h) + FP32 * nv)
        per_row = FP32 * state
    mask = width * sequence_length(cfg)
    return gib(rows * (width * per_token + per_row + mask))


def hf_sampler_gib(cfg: Any, layout: Layout) -> float:
    """A decode step's sampling over the vocabulary for every row: the last position's logits in the model dtype,
    and in fp32 the scaled logits, log-softmax, probabilities, the exponential race draw and their ratio."""
    m = cfg["model"]
    return gib(hf_engine_sequences(cfg, layout) * int(m["vocab_size"]) * (dtype_bytes(m["dtype"]) + 5 * FP32))


def hf_rollout_activations_gib(cfg: Any, layout: Layout, kernels: Optional[str] = None) -> float:
    """The hf engine's transient: the prefill or a decode step's sampler, whichever is larger (they never
    overlap)."""
    return max(hf_prefill_gib(cfg, layout, kernels), hf_sampler_gib(cfg, layout))
