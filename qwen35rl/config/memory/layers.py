"""Bytes a decoder layer keeps per token: what transformers' layers save for backward (FSDP trainer), what
megatron-core's layers save (Megatron trainer, per GDN kernels), vLLM's profiled forward in elements per token, and
the final norm."""
from __future__ import annotations

from typing import Any, Optional

from qwen35rl.config.memory.common import BF16, FP32, FP64, GDN_CHUNK, gdn_kernels


def layer_activation_elems_per_token(m: Any, kind: str) -> float:
    """vLLM's profiled forward (not measured; it was the Megatron estimate until megatron's layers were measured,
    `megatron_layer_bytes_per_token`): tensors one decoder layer keeps, in elements per token (bf16): residual +
    norm outputs,
    attention q/gate/k/v/output or GDN qkv (before and after the conv), z, b/a, core and normed outputs, and the
    MLP gate/up/act (MoE: router logits in fp32, permuted tokens and top-k expert intermediates, shared expert)."""
    h = int(m["hidden_size"])
    if kind == "full":
        nq, nkv, hd = int(m["num_attention_heads"]), int(m["num_key_value_heads"]), int(m["head_dim"])
        mixer = 2 * h + 5 * nq * hd + 3 * nkv * hd
    else:
        nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
        value_dim = nv * int(m["linear_value_head_dim"])
        conv_dim = 2 * nk * int(m["linear_key_head_dim"]) + value_dim
        mixer = 2 * h + 2 * conv_dim + 3 * value_dim + 2 * nv
    if m["moe"]:
        k, e = int(m["num_experts_per_tok"]), int(m["num_experts"])
        ffn = (2 * h + 2 * e + 2 * k * h + 3 * k * int(m["moe_intermediate_size"])
               + 3 * int(m["shared_expert_intermediate_size"]))
    else:
        ffn = 2 * h + 3 * int(m["intermediate_size"])
    return float(mixer + ffn)


def megatron_gdn_kernels(cfg: Any, override: Optional[str] = None) -> str:
    """Which GDN recurrence the Megatron engine trains with: 'torch' (megatron-core's `torch_chunk_gated_delta_rule`)
    when `backend.transformer_overrides.deterministic_mode` is set true, or on CPU (the engine sets it there), else
    'fla' (flash-linear-attention's chunk kernels). An assumption: the plan cannot see the nodes' Triton / TileLang,
    under which the engine itself falls back to the torch recurrence (`_gdn_fallback`; the preflight checks the
    nodes). `override` as for `gdn_kernels`."""
    if override is not None:
        return gdn_kernels(cfg, override)
    overrides = cfg["backend"].get("transformer_overrides") or {}
    if "deterministic_mode" in overrides:
        return "torch" if bool(overrides["deterministic_mode"]) else "fla"
    return "torch" if str(cfg["hw"].get("device", "cuda")) == "cpu" else "fla"


def megatron_norm_mlp_bytes_per_token(m: Any) -> float:
    """What a Megatron decoder layer (the engine's local spec, bf16) saves around its mixer, per token: the two
    zero-centred RMSNorms' fp32 input copy, normalised tensor and rstd, and their bf16 outputs (the linears'
    inputs); the dense MLP's fc1 output (2I), silu(gate), the `x_linear + glu_linear_offset` copy and the product
    (5 x I). MoE (SequentialMLP, alltoall dispatcher, no permute fusion): one more bf16 hidden state, the permuted
    tokens (k x h), 6 x I per routed token in the experts, the shared expert as a dense MLP and its sigmoid gate,
    the router's bf16 logits and bool routing map (E each), and per routed token its int64 top-k and sort indices,
    fp32 and permuted bf16 probability. Measured with saved_tensors_hooks on megatron-core 0.16.1 on CPU
    (2026-12-02, tests/config/test_megatron_activations.py): exact on the 0.8B and tiny MoE shapes."""
    h = int(m["hidden_size"])
    around = 2 * (2 * FP32 * h + FP32 + BF16 * h)
    if m["moe"]:
        k, e = int(m["num_experts_per_tok"]), int(m["num_experts"])
        shared = int(m["shared_expert_intermediate_size"])
        ffn = (BF16 * (h + k * h + 6 * k * int(m["moe_intermediate_size"]) + 5 * shared + (1 if shared else 0) + e)
               + e + k * (FP64 + FP64 + FP32 + BF16))
    else:
        ffn = BF16 * 5 * int(m["intermediate_size"])
    return float(around + ffn)


def megatron_attention_bytes_per_token(m: Any) -> float:
    """Megatron's gated full attention over the engine's SDPA core, per token: in bf16 what SDPA saves (rotated q,
    k and v repeated to the query heads, its output), the output projection's input (gated) and the rotary cos /
    sin of q and k (4 x the rotary dims); in fp32 the q and k norms' input copies and outputs, the sigmoid of the
    output gate, the norms' rstd per head and the log-sum-exp per query head. Measured like
    `megatron_norm_mlp_bytes_per_token`."""
    nq, nkv, hd = int(m["num_attention_heads"]), int(m["num_key_value_heads"]), int(m["head_dim"])
    gated = 1 if m["attn_output_gate"] else 0
    rot = hd * float(m.get("partial_rotary_factor", 1.0))
    return float(BF16 * ((4 + gated) * nq * hd + 4 * rot)
                 + FP32 * (2 * nq * hd + 2 * nkv * hd + gated * nq * hd + 2 * nq + nkv))


def megatron_gdn_bytes_per_token(m: Any, kernels: str) -> float:
    """megatron-core's GatedDeltaNet per token.
    torch (`torch_chunk_gated_delta_rule`, `deterministic_mode`: q and k repeated to the value heads nv). Around
    the recurrence: the torch conv1d's input and pre-silu output (conv dim each), the l2norm inputs of q and k and
    their rstd, sigmoid(beta), the output norm's weighted and gated tensors and the output projection's input in
    bf16; softplus input and output (value heads), the output norm's fp32 input copy, fp32 gate and silu(gate), and
    its rstd per head in fp32. The recurrence, per value head in fp32: 7 x dk (padded key, k_beta, k_beta*exp(g),
    k_cumdecay, scaled q, q*exp(g), the decayed key of the state update), 3 x dv (padded value, v_beta, v_new),
    6 x chunk (decay exp and mask, k k^T, the solved matrix, per chunk q k^T and its mask), 4 gates, the row-by-row
    triangular solve's clones ((chunk^2 - 1) / 3: row i keeps an i x i and an i-wide copy) and one dk x dv
    recurrent state per chunk. Measured with saved_tensors_hooks on megatron-core 0.16.1 on CPU (2026-12-02,
    tests/config/test_megatron_activations.py): exact on the 0.8B heads (336.7 KB a layer with its MLP, 5.1x what
    the fused-module formula `layer_activation_elems_per_token` gave) and with 32 value heads.
    fla (fla's causal_conv1d with its silu, fla's l2norm, chunk kernels; megatron-core 0.19.2), in bf16: the
    in_proj output (conv dim + z + beta and alpha: fla's convolution keeps its input, a view of it), the
    normalised q and k (key heads), the contiguous q and k (repeated to the value heads), v and z the recurrence
    and the output norm take, fla's [chunk]-wide A per value head, the recurrence's output and the gated norm's
    output (the output projection's input); in fp32 the l2norm's rstd (key heads), g, beta and the output norm's
    rstd (value heads). Read off an H200 allocator history at the update's peak (2026-12-04,
    bench/results/h200.md): the 0.8B layer's 51.4 KB a token."""
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    qk, value_dim = nk * dk, nv * dv
    conv_dim, c = 2 * qk + value_dim, GDN_CHUNK
    if kernels == "torch":
        around = BF16 * (2 * conv_dim + 2 * qk + 2 * nk + nv + 3 * value_dim) + FP32 * (3 * nv + 3 * value_dim)
        return float(around + FP32 * nv * (7 * dk + 3 * dv + 6 * c + 4 + (c * c - 1) / 3 + dk * dv / c))
    kept = (conv_dim + value_dim + 2 * nv) + 2 * qk + 2 * nv * dk + 2 * value_dim + nv * c + 2 * value_dim
    return float(BF16 * kept + FP32 * (2 * nk + 3 * nv))


def megatron_layer_bytes_per_token(m: Any, kind: str, kernels: str) -> float:
    """Bytes one Megatron decoder layer saves for backward per token (bf16): its mixer plus the norms and MLP
    around it. Its input is not among them (the previous layer's norm keeps an fp32 copy of it)."""
    mixer = megatron_attention_bytes_per_token(m) if kind == "full" else megatron_gdn_bytes_per_token(m, kernels)
    return mixer + megatron_norm_mlp_bytes_per_token(m)


def norm_mlp_bytes_per_token(m: Any, cb: int, compiled: bool = False) -> float:
    """What a transformers decoder layer keeps around its mixer: two RMSNorms that compute in fp32 (input copy,
    normalised tensor, output in the compute dtype: 2 * (4 + 4 + cb) * h), the layer output, and the SwiGLU MLP's
    gate, up, silu(gate) and product (4 * I; MoE: router logits and probabilities in fp32, the routed copies of
    the token and their outputs, 4 * I per routed expert and for the shared expert). Counted on the 0.8B modules.
    `compiled` (backend.compile_layers): each norm keeps its input in the compute dtype instead of the fp32 copies
    (the first norm's input is the layer's input, counted by the layer before), and the dense MLP recomputes
    silu(gate) (3 * I); MoE blocks stay eager."""
    h = int(m["hidden_size"])
    around = (3 * cb if compiled else 2 * (FP32 + FP32 + cb)) * h + cb * h
    if m["moe"]:
        k = int(m["num_experts_per_tok"])
        ffn = (2 * FP32 * int(m["num_experts"]) + cb * (2 * k * h + 4 * k * int(m["moe_intermediate_size"])
                                                         + 4 * int(m["shared_expert_intermediate_size"])))
    else:
        ffn = cb * (3 if compiled else 4) * int(m["intermediate_size"])
    return float(around + ffn)


def attention_bytes_per_token(m: Any, cb: int, compiled: bool = False) -> float:
    """transformers' full attention over flash / memory-efficient SDPA (no [T, T] scores): q and k norms in fp32
    (input copy + output), rotated q and k, v, the attention output, its contiguous copy, the sigmoid output gate and
    the gated product in the compute dtype, the fp32 log-sum-exp per head. Counted on the 0.8B modules. `compiled`:
    the q and k norms keep their inputs in the compute dtype instead, views of the projections' outputs (q's is twice
    as wide with the output gate)."""
    nq, nkv, hd = int(m["num_attention_heads"]), int(m["num_key_value_heads"]), int(m["head_dim"])
    gated = 2 if m["attn_output_gate"] else 0
    norms = cb * ((1 + gated // 2) * nq * hd + nkv * hd) if compiled else FP32 * (2 * nq * hd + 2 * nkv * hd)
    return float(cb * ((3 + gated) * nq * hd + 2 * nkv * hd) + norms + FP32 * nq)


def gdn_bytes_per_token(m: Any, cb: int, kernels: str, compiled: bool = False) -> float:
    """Gated DeltaNet mixer per token. torch fallback (counted on the 0.8B modules: 189 KB): qkv projection, conv
    output and the gated norm's three outputs in the compute dtype; in fp32 the q/k copies, the l2-normed q, padded
    q/k/v, two triangular solves, decayed q/k, the gated norm's input/gate/silu, v_new, five [64, 64] intra-chunk
    matrices per head and one recurrent state per 64-token chunk. fla (what fla 0.6's chunk_gated_delta_rule saves;
    the H200 runs came within 5% of this estimate): the conv input, q and k (L2-normed by the convolution), the
    contiguous v, beta and the solved [64]-wide chunk matrix A in the compute dtype, g and the gate's intermediates in
    fp32, and the gated norm as above. `compiled`: the gated norm keeps none of its fp32 input, gate and silu(gate)."""
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    value_dim, conv_dim = nv * dv, 2 * nk * dk + nv * dv
    gated_norm = 0 if compiled else FP32 * 3 * value_dim
    if kernels == "torch":  # the fallback expands q and k to the value heads
        qk = nv * dk
        return float(cb * (2 * conv_dim + 3 * value_dim) + gated_norm
                     + FP32 * (8 * qk + 3 * value_dim + 5 * nv * GDN_CHUNK + nv * dk * dv / GDN_CHUNK + 10 * nv))
    return float(cb * (conv_dim + 2 * nk * dk + 4 * value_dim + nv * GDN_CHUNK + nv) + gated_norm
                 + FP32 * (2 * nk + 3 * nv))


def hf_layer_bytes_per_token(m: Any, kind: str, cb: int, kernels: str, compiled: bool = False) -> float:
    """Bytes one transformers decoder layer saves for backward per token (FSDP trainer): its mixer plus the norms
    and MLP around it. 0.8B with the torch GDN fallback: 240 KB (GDN layer) and 95 KB (attention layer); with
    `compiled` parts (backend.compile_layers) 46 KB and 33 KB less."""
    mixer = (attention_bytes_per_token(m, cb, compiled) if kind == "full"
             else gdn_bytes_per_token(m, cb, kernels, compiled))
    return mixer + norm_mlp_bytes_per_token(m, cb, compiled)


def compiles_layers(cfg: Any) -> bool:
    """backend.compile_layers: the FSDP engine's layers run compiled norms and MLPs."""
    return bool(cfg["backend"].get("compile_layers", False))


def final_norm_bytes_per_token(h: int, cb: int) -> float:
    """The final RMSNorm computes in fp32: its input copy and normalised tensor, and its output in `cb`."""
    return float((FP32 + FP32 + cb) * h)
