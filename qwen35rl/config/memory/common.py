"""Constants and helpers every memory term shares: byte sizes, GiB conversion, the device's capacity, the batch
shapes (sequence length, micro batch tokens, micro batches per optimizer step) and the config rules the terms branch
on (KL, model-parallel engine, FSDP's CPU offload policy, GDN kernels, compute dtype, vision tower)."""
from __future__ import annotations

import math
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from qwen35rl.config.engine_specs import train_engine
from qwen35rl.config.layout import Layout

GIB = float(2 ** 30)
BF16, FP32 = 2, 4
FP64 = 8
GDN_CHUNK = 64
"""Tokens per chunk of the chunked GDN forms (transformers' torch fallback and flash-linear-attention alike)."""
_DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}


def as_tree(cfg: Any) -> Any:
    """A resolved plain-dict view of the config (fast to read many times); plain dicts pass through."""
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg


def dtype_bytes(name: Any) -> int:
    return _DTYPE_BYTES.get(str(name), 2)


def gib(n_bytes: float) -> float:
    return n_bytes / GIB


def capacity_gib(cfg: Any) -> float:
    """What the allocated peak may reach on one device: the nominal GB (10^9 bytes) in GiB minus what the runtime
    reserves, less the caching allocator's slack above the allocated bytes (`hw.allocator_slack`)."""
    hw = cfg["hw"]
    free = float(hw["memory_gb"]) * 1e9 / GIB - float(hw["reserve_gib"])
    return free / (1.0 + float(hw["allocator_slack"]))


def sequence_length(cfg: Any) -> int:
    return int(cfg["data"]["max_prompt_length"]) + int(cfg["data"]["max_response_length"])


def micro_batch_tokens(cfg: Any) -> int:
    """Tokens of one micro batch: max_tokens_per_device with dynamic batch size, else micro batch x the longest
    sequence (padded batches)."""
    b = cfg["backend"]
    if b["dynamic_batch_size"]:
        return int(b["max_tokens_per_device"])
    return int(b["micro_batch_size_per_device"]) * sequence_length(cfg)


def micro_batches_per_mini_batch(cfg: Any, layout: Layout) -> int:
    """Micro batches one DP rank runs per optimizer step (at least 1)."""
    responses = int(cfg["algorithm"]["mini_batch_size"]) * int(cfg["rollout"]["n"]) / max(layout.dp, 1)
    if cfg["backend"]["dynamic_batch_size"]:
        return max(1, math.ceil(responses * sequence_length(cfg) / int(cfg["backend"]["max_tokens_per_device"])))
    return max(1, int(responses // max(int(cfg["backend"]["micro_batch_size_per_device"]), 1)))


def kl_on(cfg: Any) -> bool:
    """A reference model exists when KL loss or in-reward KL is on."""
    return bool(cfg["algorithm"]["use_kl_loss"] or cfg["algorithm"]["use_kl_in_reward"])


def _model_parallel(layout: Layout) -> bool:
    """The training engine splits layers and tensors (its spec's `model_parallel`): the formulas named
    Megatron apply, else those named FSDP (an engine that shards parameters)."""
    return train_engine(layout.backend).model_parallel


def _offload_policy_on(cfg: Any) -> bool:
    """An engine without between-phase offload (its spec's `offloads_between_phases`; FSDP) turns any of
    offload_policy / param_offload / optimizer_offload / grad_offload into one CPU offload policy (FSDP2's
    CPUOffloadPolicy): parameters, gradients and optimizer states of the policy and the reference on the host."""
    b = cfg["backend"]
    if train_engine(cfg).offloads_between_phases:
        return False
    return any(bool(b.get(k, False)) for k in ("offload_policy", "param_offload", "optimizer_offload", "grad_offload"))


def gdn_kernels(cfg: Any, override: Optional[str] = None) -> str:
    """Which Gated DeltaNet kernels the transformers modules (FSDP trainer, hf rollout) run: 'fla'
    (flash-linear-attention chunk kernels; the short convolution is torch's either way) or 'torch' (transformers'
    pure-PyTorch fallback). The plan assumes the cluster has fla on its accelerators (CUDA; the Ascend image ships it
    too) and the fallback in CPU processes; a measurement without fla passes override='torch'."""
    if override is not None:
        if override not in ("fla", "torch"):
            raise ValueError(f"gdn kernels {override!r}: expected 'fla' or 'torch'")
        return override
    return "torch" if str(cfg["hw"].get("device", "cuda")) == "cpu" else "fla"


def compute_bytes(cfg: Any) -> int:
    """Bytes of the FSDP trainer's compute dtype: backend.mixed_precision, 'auto' = bf16 on accelerators and fp32
    on CPU (the engine's rule); Megatron computes in bf16."""
    setting = str(cfg["backend"].get("mixed_precision", "auto"))
    if setting == "auto":
        return FP32 if str(cfg["hw"].get("device", "cuda")) == "cpu" else BF16
    return dtype_bytes(setting)


def trains_vision(cfg: Any) -> bool:
    """The policy and the reference (FSDP and Megatron alike) and the hf rollout engine include the vision tower
    only for a vision model on image data (`models.build.trains_vision`); otherwise they are the text model."""
    return cfg["model"].get("vision") is not None and bool(cfg["data"].get("has_images", False))


def freezes_vision(cfg: Any) -> bool:
    """The policy includes the vision tower but `model.freeze_vision_tower` keeps it fixed: no gradients, no
    optimizer state, no activations kept for backward."""
    return trains_vision(cfg) and bool(cfg["model"].get("freeze_vision_tower", False))
