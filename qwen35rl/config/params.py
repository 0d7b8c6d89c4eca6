"""Parameter counts of a Qwen3.5 checkpoint from the architecture fields of `conf/model/*.yaml` alone.

The formula mirrors the transformers modules (`Qwen3_5[Moe]ForConditionalGeneration`) tensor by tensor, so the
total equals `sum(p.numel())` of the model built on the meta device. Per-layer counts are exposed too: the memory
estimate shards them by the training and rollout layouts. Pure Python: no torch, no transformers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List


def layer_kinds(m: Any) -> List[str]:
    """`linear` (Gated DeltaNet) or `full` (softmax attention) per decoder layer: every
    `full_attention_interval`-th layer is full attention, and so is the last one."""
    n, every = int(m["num_hidden_layers"]), int(m["full_attention_interval"])
    kinds = ["full" if (i + 1) % every == 0 else "linear" for i in range(n)]
    if kinds:
        kinds[-1] = "full"
    return kinds


# --------------------------------------------------------------------------------------------- text components
def full_attention_params(m: Any) -> int:
    """q_proj (query + output gate: 2*nq*hd), k/v_proj, o_proj, per-head q_norm/k_norm; no biases."""
    h, hd, nq, nkv = int(m["hidden_size"]), int(m["head_dim"]), int(m["num_attention_heads"]), int(m["num_key_value_heads"])
    gate = 2 if m["attn_output_gate"] else 1
    return h * nq * hd * gate + 2 * h * nkv * hd + nq * hd * h + 2 * hd


def gdn_params(m: Any) -> int:
    """Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_b/a, depthwise conv1d (no bias), dt_bias, A_log, gated
    output norm (per value head dim) and out_proj."""
    h = int(m["hidden_size"])
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    key_dim, value_dim = nk * int(m["linear_key_head_dim"]), nv * int(m["linear_value_head_dim"])
    conv_dim = 2 * key_dim + value_dim
    return (h * conv_dim + h * value_dim + 2 * h * nv + conv_dim * int(m["linear_conv_kernel_dim"]) + 2 * nv
            + int(m["linear_value_head_dim"]) + value_dim * h)


def mlp_params(m: Any, intermediate: int) -> int:
    """SwiGLU MLP: gate, up and down projections."""
    return 3 * int(m["hidden_size"]) * intermediate


def expert_params(m: Any) -> int:
    """All routed experts of one MoE layer (fused gate_up [E, 2I, H] and down [E, H, I])."""
    return int(m["num_experts"]) * mlp_params(m, int(m["moe_intermediate_size"]))


def moe_dense_params(m: Any) -> int:
    """The non-expert part of one MoE layer: router, shared expert and its sigmoid gate."""
    h = int(m["hidden_size"])
    return int(m["num_experts"]) * h + mlp_params(m, int(m["shared_expert_intermediate_size"])) + h


def ffn_dense_params(m: Any) -> int:
    """Parameters of one layer's feed-forward block that are not routed experts."""
    return moe_dense_params(m) if m["moe"] else mlp_params(m, int(m["intermediate_size"]))


def ffn_active_params(m: Any) -> int:
    """Feed-forward parameters one token touches: the dense part plus top-k experts."""
    if not m["moe"]:
        return mlp_params(m, int(m["intermediate_size"]))
    return moe_dense_params(m) + int(m["num_experts_per_tok"]) * mlp_params(m, int(m["moe_intermediate_size"]))


def layer_dense_params(m: Any, kind: str) -> int:
    """One decoder layer without its routed experts: mixer + two RMSNorms + dense FFN part."""
    mixer = full_attention_params(m) if kind == "full" else gdn_params(m)
    return mixer + 2 * int(m["hidden_size"]) + ffn_dense_params(m)


def layer_expert_params(m: Any) -> int:
    return expert_params(m) if m["moe"] else 0


def embedding_params(m: Any) -> int:
    return int(m["vocab_size"]) * int(m["hidden_size"])


def lm_head_params(m: Any) -> int:
    """0 when tied to the embedding."""
    return 0 if m["tie_word_embeddings"] else embedding_params(m)


def mtp_params(m: Any) -> int:
    """One MTP layer = a full-attention decoder layer (MLP or MoE) + 2 input norms + fc (2h -> h) + final norm;
    it shares the embedding and lm_head."""
    h = int(m["hidden_size"])
    one = layer_dense_params(m, "full") + layer_expert_params(m) + 2 * h + 2 * h * h + h
    return int(m["mtp_num_hidden_layers"]) * one


# ------------------------------------------------------------------------------------------------------ vision
def vision_block_params(v: Any) -> int:
    """One ViT block: two LayerNorms with bias, fused qkv, proj and the MLP (fc1, fc2), all with bias."""
    d, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    return 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * inter + inter) + (inter * d + d)


def vision_params(v: Any) -> int:
    """ViT: Conv3d patch embed (bias), learned position table, blocks (`vision_block_params`) and the patch merger
    (LayerNorm, fc1 on merged patches, fc2 to the text hidden size)."""
    if v is None:
        return 0
    d = int(v["hidden_size"])
    patch = int(v["in_channels"]) * int(v["temporal_patch_size"]) * int(v["patch_size"]) ** 2 * d + d
    merged = d * int(v["spatial_merge_size"]) ** 2
    merger = 2 * d + (merged * merged + merged) + (merged * int(v["out_hidden_size"]) + int(v["out_hidden_size"]))
    return patch + int(v["num_position_embeddings"]) * d + int(v["depth"]) * vision_block_params(v) + merger


# ------------------------------------------------------------------------------------------------------- totals
@dataclass(frozen=True)
class ParamCount:
    total: int
    """Text + vision, without MTP (the number in the official size names, e.g. 397B)."""
    active: int
    """Text-only parameters one token touches, embedding and lm_head included (the "A17B")."""
    text: int
    text_active: int
    vision: int
    mtp: int
    embedding: int
    """Input embedding plus the untied lm_head."""

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)


def count_params(model_cfg: Any) -> ParamCount:
    m = model_cfg
    kinds = layer_kinds(m)
    embed = embedding_params(m) + lm_head_params(m)
    final_norm = int(m["hidden_size"])
    mixers = sum(kinds.count(k) * (layer_dense_params(m, k) - ffn_dense_params(m)) for k in ("linear", "full"))
    text = embed + final_norm + mixers + len(kinds) * (ffn_dense_params(m) + layer_expert_params(m))
    text_active = embed + final_norm + mixers + len(kinds) * ffn_active_params(m)
    vision = vision_params(m["vision"])
    return ParamCount(total=text + vision, active=text_active, text=text, text_active=text_active, vision=vision,
                      mtp=mtp_params(m), embedding=embed)


def layers_params(m: Any, kinds: List[str], active: bool = False) -> int:
    """Parameters of these decoder layers (active: only what one token touches)."""
    ffn = ffn_active_params(m) if active else ffn_dense_params(m) + layer_expert_params(m)
    return sum(kinds.count(k) * (layer_dense_params(m, k) - ffn_dense_params(m) + ffn) for k in ("linear", "full"))
