"""The forward-only passes (old and reference log-probs): the training terms still on the device beside them, the
micro batches they cut, and one pass's working set."""
from __future__ import annotations

from typing import Any, Optional

from qwen35rl.config.layout import Layout
from qwen35rl.config.memory.common import BF16, FP32, _model_parallel, compute_bytes, gdn_kernels, gib
from qwen35rl.config.memory.layers import (compiles_layers, hf_layer_bytes_per_token, megatron_gdn_kernels,
                                           megatron_layer_bytes_per_token)
from qwen35rl.config.memory.shard import TrainShard
from qwen35rl.config.memory.training import head_tokens_per_device, tokens_per_device

LOG_PROB_BESIDE = ("train/weights", "train/optimizer", "train/gathered_params", "train/reference",
                   "train/sleeping_engine")
"""Training terms still on the device while the old and the reference log-probs are computed; the backward's and
the optimizer step's moments are not (FSDP's gradients are freed after each step: `log_prob/grads` is Megatron's
buffer)."""


def log_prob_tree(cfg: Any) -> Any:
    """`cfg` as the forward-only passes cut their micro batches: `backend.log_prob_micro_batch_size_per_device` and
    `backend.log_prob_max_tokens_per_device` in place of the training values (null: the training value)."""
    b = cfg["backend"]
    micro, tokens = b.get("log_prob_micro_batch_size_per_device"), b.get("log_prob_max_tokens_per_device")
    if micro is None and tokens is None:
        return cfg
    backend = dict(b)
    if micro is not None:
        backend["micro_batch_size_per_device"] = int(micro)
    if tokens is not None:
        backend["max_tokens_per_device"] = int(tokens)
    return {**cfg, "backend": backend}


def log_prob_activations_gib(cfg: Any, layout: Layout, shard: TrainShard, kernels: Optional[str] = None) -> float:
    """One log-prob micro batch's forward under no_grad keeps nothing for a backward: the hidden state between
    layers, plus the larger of the widest layer's tensors (freed when the layer ends) and the head (the response
    tokens' final hidden states and three fp32 [chunk, V / tp] tensors, no gradient accumulator). Megatron runs each
    micro batch through the pipeline on its own (no 1F1B in flight). The vision tower's forward is not counted."""
    lp, m, h = log_prob_tree(cfg), cfg["model"], int(cfg["model"]["hidden_size"])
    tokens, head_tokens = tokens_per_device(lp, layout), head_tokens_per_device(lp, layout)
    kinds = set(shard.layers)
    if _model_parallel(layout):
        cb, kernels, vocab = BF16, megatron_gdn_kernels(cfg, kernels), int(m["vocab_size"]) / max(layout.tp, 1)
        widest = max((megatron_layer_bytes_per_token(m, k, kernels) for k in kinds), default=0.0)
    else:
        cb, kernels, vocab = compute_bytes(cfg), gdn_kernels(cfg, kernels), int(m["vocab_size"])
        widest = max((hf_layer_bytes_per_token(m, k, cb, kernels, compiles_layers(cfg)) for k in kinds), default=0.0)
    chunk = min(int(cfg["backend"]["logprob_chunk_size"]), head_tokens)
    head = head_tokens * cb * h + 3 * chunk * vocab * FP32
    return gib(tokens * cb * h + max(tokens * widest, head))
