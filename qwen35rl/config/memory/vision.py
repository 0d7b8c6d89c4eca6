"""The vision tower's training activations on image data: image tokens and patches per micro batch, what a vision
block and the stem keep per patch, recompute and a frozen tower."""
from __future__ import annotations

from typing import Any

from qwen35rl.config.layout import Layout
from qwen35rl.config.memory.common import (BF16, FP32, FP64, _model_parallel, compute_bytes, freezes_vision, gib,
                                           micro_batch_tokens, sequence_length, trains_vision)
from qwen35rl.config.memory.training import in_flight_micro_batches, recompute_groups


def image_tokens_per_micro_batch(cfg: Any) -> float:
    """Merged image tokens of one micro batch, at most. Every prompt token may be an image token: a prompt holds at
    most data.max_prompt_length tokens (longer ones are filtered or refused), and the prompts' share of a micro
    batch is max_prompt_length / (prompt + response) of its tokens (padded batches: exactly its prompts; dynamic
    batches: by that share). Neither the data config nor the processor bounds it more tightly: images per prompt
    are not limited, and the official processor's ceiling of 16,777,216 pixels per image is 16,384 tokens."""
    return micro_batch_tokens(cfg) * int(cfg["data"]["max_prompt_length"]) / sequence_length(cfg)


def vision_patches_per_micro_batch(cfg: Any) -> float:
    """Patches the vision tower embeds for one micro batch: spatial_merge_size^2 per merged image token."""
    return image_tokens_per_micro_batch(cfg) * int(cfg["model"]["vision"]["spatial_merge_size"]) ** 2


def _pixels_per_patch(v: Any) -> int:
    return int(v["in_channels"]) * int(v["temporal_patch_size"]) * int(v["patch_size"]) ** 2


def vision_block_bytes_per_patch(v: Any, cb: int) -> float:
    """Bytes one vision block (transformers' Qwen3.5 ViT block) keeps for backward per patch, its output included:
    in the compute dtype its input, the first LayerNorm's output, the fused qkv output (v stays a view of it), the
    rotated q and k, the attention output and its concatenated copy, the residual sum, the second LayerNorm's
    output, the block output (11 x hidden) and the MLP's fc1 and GELU outputs (2 x intermediate); in fp32 the
    attention's log-sum-exp per head and the LayerNorms' mean and rstd. Counted tensor by tensor on the modules
    (tests/config/test_memory_calibration.py)."""
    d, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    return float(cb * (11 * d + 2 * inter) + FP32 * (int(v["num_heads"]) + 4))


def vision_stem_bytes_per_patch(v: Any, cb: int) -> float:
    """What the tower keeps for backward outside its blocks, per patch: the patch embedding's input in the compute
    dtype, the first block's input, the merger's LayerNorm output, fc1 output and GELU output (hidden each: a merged
    row is spatial_merge^2 patches wide) and its fc2 output (out_hidden per merged token); in fp32 the rotary cos
    and sin (head_dim each), the bilinear position lookup's four weights and the merger LayerNorm's mean and rstd;
    the lookup's four int64 indices."""
    d, merged = int(v["hidden_size"]), int(v["spatial_merge_size"]) ** 2
    head_dim = d // int(v["num_heads"])
    return float(cb * (_pixels_per_patch(v) + 4 * d + int(v["out_hidden_size"]) / merged)
                 + FP32 * (2 * head_dim + 4 + 2) + FP64 * 4)


def vision_recomputed(cfg: Any, layout: Layout) -> bool:
    """Whether the backward recomputes the vision blocks (each keeps only its input): whenever the decoder layers
    are recomputed (`recompute_groups`). FSDP: transformers' gradient checkpointing covers the vision blocks like
    the decoder layers. Megatron: an assumption on the engine. megatron-core's recompute does not reach the
    transformers tower the engine runs next to its decoder, so the engine has to checkpoint the tower's blocks
    itself when it recomputes, as the reference runs' bridge does (its vision blocks take the language model's
    recompute settings). Without it the tower keeps every block's tensors (`vision_block_bytes_per_patch` x depth
    per patch), which the 122B reference runs' 3240-token prompts do not fit."""
    return recompute_groups(cfg, layout) is not None


def vision_activations_gib(cfg: Any, layout: Layout) -> float:
    """The vision tower's activations for the images of the micro batches in flight (`in_flight_micro_batches`;
    Megatron: on the first stage, where the tower lives), `vision_patches_per_micro_batch` patches each, not split
    over TP, CP or SP: every rank of a model-parallel group runs the tower on all of them. Each micro batch in
    flight keeps its fp32 pixel values. A trained tower keeps what its stem and blocks save for backward
    (recomputed: each block only its input, plus one block recomputed at a time, for Megatron with its gradients
    as for the decoder's recomputed group). A frozen tower (`freezes_vision`) keeps nothing for backward: one
    block's forward tensors of one micro batch are live at a time, counted on top (conservatively: the forward
    runs before the decoder's backward)."""
    if not trains_vision(cfg):
        return 0.0
    v = cfg["model"]["vision"]
    cb = BF16 if _model_parallel(layout) else compute_bytes(cfg)
    patches, flight = vision_patches_per_micro_batch(cfg), in_flight_micro_batches(cfg, layout)
    block, pixels = vision_block_bytes_per_patch(v, cb), FP32 * _pixels_per_patch(v)
    if freezes_vision(cfg):
        return gib(patches * (pixels * flight + block))
    stem, depth = vision_stem_bytes_per_patch(v, cb), int(v["depth"])
    if vision_recomputed(cfg, layout):
        saved, working = stem + depth * cb * int(v["hidden_size"]), (2 if _model_parallel(layout) else 1) * block
    else:
        saved, working = stem + depth * block, 0.0
    return gib(patches * ((saved + pixels) * flight + working))
