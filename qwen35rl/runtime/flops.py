"""FLOP count of a Qwen3.5 decoder for MFU: knows Gated DeltaNet layers, full-attention layers and MoE routing.

Pure arithmetic over the model config (`cfg.model`); no torch. Matmuls cost 2 FLOPs per multiply-add. A training
pass costs 3x the forward (backward = 2x forward); recomputation from gradient checkpointing is not counted, as is
usual for MFU. The vision tower is not counted (text tokens only).
"""
from __future__ import annotations

from typing import Any, Iterable, List

from qwen35rl.config.params import layer_kinds

TRAIN_FLOPS_PER_FORWARD = 3.0


def _full_attention_flags(m: Any) -> List[bool]:
    return [kind == "full" for kind in layer_kinds(m)]


def full_attention_matmul_params(m: Any) -> int:
    """Per full-attention layer: q (+ output gate), k, v, o projections."""
    h, nq, nkv, hd = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"]
    q_out = nq * hd * (2 if m["attn_output_gate"] else 1)
    return h * q_out + 2 * h * nkv * hd + nq * hd * h


def gdn_matmul_params(m: Any) -> int:
    """Per Gated DeltaNet layer: in_proj (q, k, v, z), beta/decay projections, depthwise conv, out_proj."""
    h = m["hidden_size"]
    nk, nv = m["linear_num_key_heads"], m["linear_num_value_heads"]
    dk, dv = m["linear_key_head_dim"], m["linear_value_head_dim"]
    qkvz = h * (2 * nk * dk + 2 * nv * dv)
    beta_decay = h * 2 * nv
    conv = m["linear_conv_kernel_dim"] * (2 * nk * dk + nv * dv)
    return qkvz + beta_decay + conv + nv * dv * h


def mlp_active_params(m: Any) -> int:
    """Per layer, the MLP weights one token touches: the dense MLP, or router + top-k experts + shared expert."""
    h = m["hidden_size"]
    if not m["moe"]:
        return 3 * h * m["intermediate_size"]
    router = h * m["num_experts"]
    experts = m["num_experts_per_tok"] * 3 * h * m["moe_intermediate_size"]
    shared = 3 * h * m["shared_expert_intermediate_size"] + h  # + its sigmoid gate
    return router + experts + shared


def active_matmul_params(m: Any) -> int:
    """Weights multiplied per token in the text decoder: every layer's projections and active MLP plus lm_head
    (the embedding lookup is free)."""
    full = _full_attention_flags(m)
    mixers = sum(full_attention_matmul_params(m) if f else gdn_matmul_params(m) for f in full)
    return mixers + m["num_hidden_layers"] * mlp_active_params(m) + m["hidden_size"] * m["vocab_size"]


def gdn_recurrence_flops_per_token(m: Any) -> float:
    """Delta-rule state update per token and value head on a [dk, dv] state: decay, S^T k, rank-1 update and the
    q readout, about 7 dk*dv FLOPs (the chunked kernels do the same work in blocks)."""
    return 7.0 * m["linear_num_value_heads"] * m["linear_key_head_dim"] * m["linear_value_head_dim"]


def forward_flops(m: Any, seq_lens: Iterable[int]) -> float:
    """Forward FLOPs of a batch of sequences of the given lengths (causal attention: about L^2/2 pairs each)."""
    full = _full_attention_flags(m)
    n_full, n_linear = sum(full), len(full) - sum(full)
    per_token = 2.0 * active_matmul_params(m) + n_linear * gdn_recurrence_flops_per_token(m)
    # QK^T and AV: 2 matmuls x 2 FLOPs x (L^2 / 2) pairs x heads x head_dim
    per_len_sq = n_full * 2.0 * m["num_attention_heads"] * m["head_dim"]
    total = 0.0
    for length in seq_lens:
        total += per_token * length + per_len_sq * length * length
    return total


def train_flops(m: Any, seq_lens: Iterable[int]) -> float:
    return TRAIN_FLOPS_PER_FORWARD * forward_flops(m, seq_lens)


def mfu(flops: float, seconds: float, devices: int, peak_tflops: float) -> float:
    """Achieved share of the devices' peak."""
    if seconds <= 0 or devices <= 0 or peak_tflops <= 0:
        return 0.0
    return flops / (seconds * devices * peak_tflops * 1e12)
