"""The rollout phase beside the trainer: the engine's weights, sleep mode (what a sleeping engine leaves on the
training devices), what the trainer keeps during the rollout, and vLLM's pool (`auto` sizing), KV cache, GDN state
and profiled activations."""
from __future__ import annotations

import math
from typing import Any

from qwen35rl.config import params as P
from qwen35rl.config.engine_specs import rollout_engine
from qwen35rl.config.layout import Layout
from qwen35rl.config.memory.common import (BF16, FP32, GIB, _model_parallel, capacity_gib, dtype_bytes, gib,
                                           sequence_length)
from qwen35rl.config.memory.layers import layer_activation_elems_per_token
from qwen35rl.config.memory.shard import TrainShard, vision_tower_params
from qwen35rl.config.memory.training import (optimizer_states_gib, reference_model_gib, train_grads_gib,
                                             train_weights_gib)


def rollout_weights_params(cfg: Any, layout: Layout) -> float:
    """Parameters one rollout device holds: the text model without MTP, plus the vision tower on image data
    (`trains_vision`: the hf engine builds the transformers VL model only then, and vLLM skips building the tower
    when limit_mm_per_prompt is 0 for images and video, which the engine sets for text data). Dense weights,
    embeddings and vLLM's vision tower split by rollout TP (the tower replicated on each TP rank with
    engine_kwargs.mm_encoder_tp_mode=data), experts by rollout EP (one DP-attention engine) or TP."""
    m = cfg["model"]
    tp = max(layout.rollout_tp, 1)
    tower = vision_tower_params(cfg)
    replicated = rollout_engine(cfg).tensor_parallel and (cfg["rollout"].get("engine_kwargs") or {}).get(
        "mm_encoder_tp_mode") == "data"
    expert = len(P.layer_kinds(m)) * P.layer_expert_params(m)
    split_experts = layout.rollout_ep if layout.rollout_ep > 1 else layout.rollout_tp
    dense = P.count_params(m).text - expert
    return dense / tp + (tower if replicated else tower / tp) + expert / max(split_experts, 1)


def hf_engine_sleeps(cfg: Any) -> bool:
    """The hf engine moves its weights to the host between generations only with free_cache_engine and sleep
    level 2 (it has no cache to free at level 1)."""
    r = cfg["rollout"]
    return bool(r["free_cache_engine"]) and int(r["sleep_level"]) >= 2


def sleeping_engine_gib(cfg: Any, layout: Layout) -> float:
    """vLLM with free_cache_engine sleeps during training (level 1 moves weights to the host, level 2 drops
    them; the KV cache is freed): nothing stays. Without it the whole pool stays. The hf engine keeps its copy of
    its weights in the model dtype unless it sleeps (`hf_engine_sleeps`). With placement=split no engine shares
    the training devices."""
    if layout.split:
        return 0.0
    if not rollout_engine(cfg).own_weights:
        if hf_engine_sleeps(cfg):
            return 0.0
        return gib(rollout_weights_params(cfg, layout) * dtype_bytes(cfg["model"]["dtype"]))
    return 0.0 if cfg["rollout"]["free_cache_engine"] else vllm_pool_gib(cfg)


def train_state_during_rollout_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """What the trainer leaves on the device while the rollout runs: weights unless param_offload, optimizer
    states unless optimizer_offload, Megatron gradients unless grad_offload (FSDP frees them after the step),
    and the reference model (see reference_model_gib). With placement=split the rollout runs on other devices:
    nothing."""
    if layout.split:
        return 0.0
    b = cfg["backend"]
    kept = 0.0 if b["param_offload"] else train_weights_gib(cfg, layout, shard)
    kept += 0.0 if b["optimizer_offload"] else optimizer_states_gib(cfg, layout, shard)
    if _model_parallel(layout) and not b["grad_offload"]:
        kept += train_grads_gib(cfg, layout, shard)
    return kept + reference_model_gib(cfg, layout, shard)


AUTO = "auto"
AUTO_POOL_MAX = 0.9
"""The largest share of the device an `auto` vLLM pool takes (vLLM's own default gpu_memory_utilization)."""
AUTO_POOL_HEADROOM = 0.10
"""Share of the usable memory an `auto` pool leaves free beside what the trainer keeps: the estimate's margin, and
`layout_search.MIN_HEADROOM`, below which the search penalises a layout."""


def pool_is_auto(cfg: Any) -> bool:
    return str(cfg["rollout"]["gpu_memory_utilization"]) == AUTO


def nominal_gib(cfg: Any) -> float:
    return float(cfg["hw"]["memory_gb"]) * 1e9 / GIB


def vllm_pool_gib(cfg: Any) -> float:
    """vLLM claims gpu_memory_utilization of the device's nominal memory for weights, activations and cache. `auto`:
    here the most it may take (`AUTO_POOL_MAX`, or the usable memory less the headroom when that is less);
    `assemble` sizes it from what the trainer leaves (`auto_pool_gib`)."""
    if pool_is_auto(cfg):
        return min(AUTO_POOL_MAX * nominal_gib(cfg), capacity_gib(cfg))
    return float(cfg["rollout"]["gpu_memory_utilization"]) * nominal_gib(cfg)


def auto_pool_gib(cfg: Any, kept: float, minimal: float) -> float:
    """`rollout.gpu_memory_utilization=auto`: the pool from the memory the trainer leaves during the rollout
    (`kept`): the usable memory less `AUTO_POOL_HEADROOM` less `kept`, at most `AUTO_POOL_MAX` of the device; where
    that cannot hold the engine (`minimal`: weights, activations, one sequence), every byte left. Whole hundredths
    of the device (the value the plan writes into the config), at least one."""
    nominal, cap = nominal_gib(cfg), capacity_gib(cfg)
    pool = min(AUTO_POOL_MAX * nominal, (1.0 - AUTO_POOL_HEADROOM) * cap - kept)
    if pool < minimal:
        pool = cap - kept
    return max(math.floor(pool / nominal * 100 + 1e-9), 1) / 100 * nominal


def rollout_max_model_len(cfg: Any) -> int:
    return int(cfg["rollout"]["max_model_len"] or sequence_length(cfg))


def kv_cache_bytes_per_token(cfg: Any, layout: Layout) -> float:
    """Full-attention layers only: L_full * 2 (K,V) * KV heads per device * head_dim * dtype; KV heads split by
    rollout TP and replicated when TP exceeds them."""
    m = cfg["model"]
    n_full = P.layer_kinds(m).count("full")
    kv_heads = max(int(m["num_key_value_heads"]) / max(layout.rollout_tp, 1), 1)
    return n_full * 2 * kv_heads * int(m["head_dim"]) * dtype_bytes(m["dtype"])


def gdn_state_bytes_per_sequence(cfg: Any, layout: Layout) -> float:
    """GDN layers keep a constant state per sequence: fp32 recurrent L_lin*nv*dk*dv plus the conv window
    L_lin*(2*nk*dk + nv*dv)*(kernel-1) in the model dtype, heads split by rollout TP."""
    m = cfg["model"]
    n_lin = P.layer_kinds(m).count("linear")
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    recurrent = n_lin * nv * dk * dv * FP32
    conv = n_lin * (2 * nk * dk + nv * dv) * (int(m["linear_conv_kernel_dim"]) - 1) * dtype_bytes(m["dtype"])
    return (recurrent + conv) / max(layout.rollout_tp, 1)


def sequence_cache_gib(cfg: Any, layout: Layout) -> float:
    """Cache of one sequence of max_model_len tokens: its KV cache plus one GDN state."""
    return gib(rollout_max_model_len(cfg) * kv_cache_bytes_per_token(cfg, layout)
               + gdn_state_bytes_per_sequence(cfg, layout))


def rollout_activations_gib(cfg: Any, layout: Layout) -> float:
    """vLLM's profiled forward of max_num_batched_tokens: one layer's transient tensors (split by rollout TP) plus
    the residual stream, and the sampler's fp32 logits and probabilities for max_num_seqs sequences."""
    m, r = cfg["model"], cfg["rollout"]
    layer = max(layer_activation_elems_per_token(m, k) for k in ("linear", "full"))
    per_token = layer / max(layout.rollout_tp, 1) + 2 * int(m["hidden_size"])
    sampler = int(r["max_num_seqs"]) * int(m["vocab_size"]) * 2 * FP32
    return gib(int(r["max_num_batched_tokens"]) * per_token * BF16 + sampler)
