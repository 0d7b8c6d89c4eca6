"""The training phase's terms on the device, FSDP and Megatron: weights, gradients, optimizer states, gathered FSDP
units, saved activations (tokens per device, micro batches in flight, recompute groups), the log-prob head's and a
recomputed layer's backward transient, the optimizer step and the reference model."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

from qwen35rl.config import params as P
from qwen35rl.config.layout import Layout
from qwen35rl.config.memory.common import (BF16, FP32, FP64, _model_parallel, _offload_policy_on, compute_bytes,
                                           gdn_kernels, gib, kl_on, micro_batch_tokens, micro_batches_per_mini_batch,
                                           sequence_length)
from qwen35rl.config.memory.layers import (compiles_layers, final_norm_bytes_per_token, hf_layer_bytes_per_token,
                                           megatron_gdn_kernels, megatron_layer_bytes_per_token)
from qwen35rl.config.memory.shard import TrainShard, largest_parameter


def train_weights_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """Megatron: bf16 parameters on the device while training (param_offload only moves them out between
    phases). FSDP: fp32 sharded parameters (bf16 is the compute copy), on the host with offload_policy. Frozen
    parameters count here like the trained ones."""
    if _model_parallel(layout):
        return gib(shard.held * BF16)
    return 0.0 if _offload_policy_on(cfg) else gib(shard.held * FP32)


def train_grads_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """Gradients on the device at the backward's peak. Megatron: the fp32 main-grad buffer of every local
    parameter (always allocated). FSDP: the fp32 sharded gradients of the earlier micro batches of the optimizer
    step (none with a single micro batch: the peak is at the start of its backward), on the host when offloaded."""
    if _model_parallel(layout):
        return gib(shard.trained * FP32)
    if _offload_policy_on(cfg) or micro_batches_per_mini_batch(cfg, layout) <= 1:
        return 0.0
    return gib(shard.trained * FP32)


def optimizer_states_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """Adam. Megatron: fp32 master + m + v (12 B/param), the distributed optimizer shards dense states over
    DP*CP and expert states over expert-DP; optimizer_cpu_offload keeps `optimizer_offload_fraction` on the host.
    FSDP: m + v (8 B/param, the fp32 parameters are the master copy) of the shard, on the host with offload_policy.
    A trained vision tower is dense (Megatron: sharded over DP*CP like the other replicated parameters); a frozen
    one has no states."""
    b = cfg["backend"]
    if not _model_parallel(layout):
        return 0.0 if _offload_policy_on(cfg) else gib(shard.trained * 2 * FP32)
    if b["use_distributed_optimizer"]:
        states = shard.dense / max(layout.dp * layout.cp, 1) + shard.expert / max(layout.edp, 1)
    else:
        states = shard.dense + shard.expert
    on_device = 1.0 - float(b["optimizer_offload_fraction"]) if b["optimizer_cpu_offload"] else 1.0
    return gib(states * 3 * FP32 * on_device)


def fsdp_gathered_params_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """FSDP: unsharded compute-dtype copies: the root unit (FSDP2 never reshards the root after a forward, so it
    stays from the log-prob pass until the update's backward ends) plus the layer being computed and the one
    prefetched; without reshard_after_forward every gathered layer stays until backward (the whole model)."""
    if _model_parallel(layout):
        return 0.0
    if not cfg["backend"].get("reshard_after_forward", True):
        return gib(shard.held * max(layout.fsdp_size, 1) * compute_bytes(cfg))
    return gib((shard.root + 2 * shard.largest_unit) * compute_bytes(cfg))


def tokens_per_device(cfg: Any, layout: Layout) -> float:
    """Tokens of one micro batch each device keeps activations for: Megatron splits them over TP (sequence
    parallel) and CP, FSDP over Ulysses SP."""
    div = layout.tp * layout.cp if _model_parallel(layout) else layout.sp
    return micro_batch_tokens(cfg) / max(div, 1)


def in_flight_micro_batches(cfg: Any, layout: Layout) -> float:
    """1F1B keeps up to PP micro batches of activations on the first stage (interleaving adds
    (pp-1)/(pp*vpp)); without a pipeline one micro batch."""
    if not _model_parallel(layout) or layout.pp <= 1:
        return 1.0
    n = min(layout.pp, micro_batches_per_mini_batch(cfg, layout))
    if layout.vpp:
        n *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return float(n)


def recompute_groups(cfg: Any, layout: Layout) -> Optional[Dict[str, Any]]:
    """How activations are recomputed: None (all saved), or {method: uniform|block, n: layers per group}.
    Megatron recomputes with gradient_checkpointing and a recompute_granularity (the engine's rule); its
    'selective' recompute only re-runs core attention, which flash attention never stores: counted as no
    recompute. FSDP gradient checkpointing = uniform groups of one layer."""
    b = cfg["backend"]
    if not _model_parallel(layout):
        return {"method": "uniform", "n": 1} if b["gradient_checkpointing"] else None
    if not b["gradient_checkpointing"] or b.get("recompute_granularity") != "full":  # the engine needs both
        return None
    return {"method": b.get("recompute_method") or "uniform", "n": max(int(b.get("recompute_num_layers") or 1), 1)}


def response_tokens_per_device(cfg: Any, layout: Layout) -> float:
    """Response tokens of one micro batch on a device (the log-prob head sees only these): the response share of
    the micro batch's tokens, split like the activations."""
    share = int(cfg["data"]["max_response_length"]) / sequence_length(cfg)
    return tokens_per_device(cfg, layout) * share


def head_tokens_per_device(cfg: Any, layout: Layout) -> float:
    """Response tokens of one micro batch that a device's log-prob head runs over (only these: prompt positions
    have no use for it). FSDP: split like the activations (Ulysses SP); Megatron: each TP rank runs the whole
    micro batch's tokens (the output layer's input is gathered over the sequence) over its vocabulary slice."""
    if not _model_parallel(layout):
        return response_tokens_per_device(cfg, layout)
    share = int(cfg["data"]["max_response_length"]) / sequence_length(cfg)
    return micro_batch_tokens(cfg) * share / max(layout.cp, 1)


def activations_gib(cfg: Any, layout: Layout, shard: TrainShard, kernels: Optional[str] = None) -> float:
    """Saved activations of the device's layers for the in-flight micro batches: all layers' tensors without
    recompute; with full recompute / checkpointing one hidden state per recompute group (block: the first n
    layers recomputed, the rest saved). Megatron adds the recomputed group's tensors and their gradients here;
    FSDP counts its recomputed layer in `backward_transient_gib`; both keep the final norm's tensors and the
    head's response hidden states besides."""
    m, h = cfg["model"], int(cfg["model"]["hidden_size"])
    if not _model_parallel(layout):
        cb, tokens, kernels = compute_bytes(cfg), tokens_per_device(cfg, layout), gdn_kernels(cfg, kernels)
        if recompute_groups(cfg, layout) is None:
            compiled = compiles_layers(cfg)
            layers = sum(hf_layer_bytes_per_token(m, k, cb, kernels, compiled) for k in shard.layers)
        else:  # non-reentrant checkpointing keeps each layer's input
            layers = len(shard.layers) * cb * h
        return gib(tokens * (layers + final_norm_bytes_per_token(h, cb)) + head_tokens_per_device(cfg, layout) * cb * h)
    tokens, flight = tokens_per_device(cfg, layout), in_flight_micro_batches(cfg, layout)
    kernels = megatron_gdn_kernels(cfg, kernels)
    per_layer = [megatron_layer_bytes_per_token(m, k, kernels) for k in shard.layers] or [0.0]
    rec = recompute_groups(cfg, layout)
    if rec is None:
        saved, working = sum(per_layer) * flight, 0.0
    elif rec["method"] == "block":
        n = min(rec["n"], len(per_layer))
        saved = (n * BF16 * h + sum(sorted(per_layer)[: len(per_layer) - n])) * flight
        working = 2 * max(per_layer)
    else:
        n = rec["n"]
        saved = math.ceil(len(per_layer) / n) * BF16 * h * flight
        working = 2 * sum(sorted(per_layer, reverse=True)[:n])
    # the last stage's final norm and head inputs, combined with the heaviest rank's layers (conservatively)
    head = tokens * final_norm_bytes_per_token(h, BF16) + head_tokens_per_device(cfg, layout) * BF16 * h
    return gib((saved + working) * tokens + head)


def logits_gib(cfg: Any, layout: Layout) -> float:
    """Log-probs and entropy over the vocabulary in `logprob_chunk_size`-token chunks of response tokens
    (`engines.logprob`, both engines; the head's backward is the peak): the fp32 gradient accumulator of the
    device's vocabulary rows [V / tp, h] (Megatron splits the vocabulary over TP) plus three fp32 [chunk, V / tp]
    tensors (log-probs, probabilities, their product for the entropy)."""
    m = cfg["model"]
    vocab = int(m["vocab_size"]) / (layout.tp if _model_parallel(layout) else 1)
    chunk = min(int(cfg["backend"]["logprob_chunk_size"]), head_tokens_per_device(cfg, layout))
    return gib(vocab * int(m["hidden_size"]) * FP32 + 3 * chunk * vocab * FP32)


def recomputed_layer_gib(cfg: Any, layout: Layout, shard: TrainShard, kernels: Optional[str] = None) -> float:
    """FSDP with checkpointing: during a layer's backward its forward is re-run (its saved tensors, as without
    checkpointing; their gradients replace them as they are consumed) while the lm_head's gradient waits in the
    compute dtype for the end of the backward."""
    if _model_parallel(layout) or recompute_groups(cfg, layout) is None:
        return 0.0
    m, cb, kernels = cfg["model"], compute_bytes(cfg), gdn_kernels(cfg, kernels)
    widest = max(hf_layer_bytes_per_token(m, k, cb, kernels, compiles_layers(cfg)) for k in set(shard.layers))
    return gib(tokens_per_device(cfg, layout) * widest + P.embedding_params(m) * cb)


def backward_transient_gib(cfg: Any, layout: Layout, shard: TrainShard, kernels: Optional[str] = None) -> float:
    """The transient on top of the saved activations. FSDP: the larger of the log-prob head's backward and one
    recomputed layer (the head runs first and frees its buffers before the layers). Megatron: the last stage's
    head (its recomputed group is in `activations_gib`, combined conservatively across pipeline ranks)."""
    if _model_parallel(layout):
        return logits_gib(cfg, layout)
    return max(logits_gib(cfg, layout), recomputed_layer_gib(cfg, layout, shard, kernels))


def optimizer_step_gib(cfg: Any, layout: Layout, shard: TrainShard, backward_set: float) -> float:
    """FSDP on the device: the optimizer step holds every local fp32 gradient plus the larger temporary of the grad
    norm (an fp64 copy of a local gradient and its square: 16 B per element of the largest tensor's shard) and
    AdamW's foreach step (sqrt of the second moments: 4 B per local parameter); it raises the peak only by what
    exceeds the backward's set (`backward_set`: its gradients, gathered units, activations and transient).
    Megatron: torch's foreach Adam, megatron's choice without Transformer Engine or Apex (the plan cannot see the
    nodes' packages: assumed), allocates that sqrt for every parameter whose states are on the device (a third of
    their 12 B); its gradient buffer persists through the step, so only the activations and the transient are
    gone by then (measured on an H200, 2026-12-04: the 4B's step added 15.7 GiB, its peak)."""
    if _model_parallel(layout):
        freed = backward_set - train_grads_gib(cfg, layout, shard)
        return max(0.0, optimizer_states_gib(cfg, layout, shard) / 3 - freed)
    if _offload_policy_on(cfg):
        return 0.0
    local = shard.trained
    largest = largest_parameter(cfg["model"]) / max(layout.fsdp_size, 1)
    step = gib(local * FP32 + max(largest * (FP64 + FP64), local * FP32))
    return max(0.0, step - backward_set)


def reference_model_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """With KL on, a bf16 reference model sharded like the policy, its copy of the vision tower included (weights
    only: it never trains) (FSDP: plus its root unit, which stays gathered after each of its forward passes); it
    follows the policy's parameter offload (host between its forward passes) and is absent without KL."""
    if not kl_on(cfg) or cfg["backend"]["param_offload"] or (not _model_parallel(layout) and _offload_policy_on(cfg)):
        return 0.0
    root = 0.0 if _model_parallel(layout) else shard.root
    return gib((shard.held + root) * BF16)
