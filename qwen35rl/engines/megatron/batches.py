"""Micro batches in the layout megatron's model and pipeline schedule take, and per-token results back in the
batch's own layout.

Rows are left-aligned (megatron's GDN ignores the attention mask, so padding must not precede a row's tokens),
columns padded to a multiple of TP (sequence parallelism), per-token inputs moved to the logit positions (logits
at t predict token t+1). The pipeline schedule exchanges fixed-shape activations: every micro batch of a step is
grown to the largest one's rows and columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from qwen35rl.engines.base import Batch
from qwen35rl.engines.megatron.tokens import Aligned, left_align, pad_columns
from qwen35rl.engines.megatron.vision import RowImages
from qwen35rl.models.image_tokens import mrope_positions, prompt_image_mask

ROW_KEYS = ("input_ids", "position_ids", "labels", "loss_mask", "advantages", "old", "ref", "rollout", "image_mask")
"""The per-row tensors of a prepared micro batch (split and padded with the rows)."""
PAD_ID = 0
"""Any valid id: padded positions are masked out of every loss and result."""


@dataclass(frozen=True)
class BatchShape:
    """What decides a prepared batch's layout. `vl_config`: the HF VL model's config (image token id, vision
    config, M-RoPE) when the model takes images, else None. `micro_multiple`: the number of micro batches a
    step must be a multiple of (PP with virtual pipeline stages, else 1)."""

    tp: int
    device: torch.device
    micro_multiple: int = 1
    vl_config: Optional[Any] = None


def prepare(batch: Batch, shape: BatchShape, train: bool) -> Dict[str, Any]:
    """A micro batch in the model's layout (see the module docstring)."""
    aligned = left_align(batch.input_ids, batch.attention_mask, PAD_ID)
    device = shape.device

    def at_logits(x: Optional[torch.Tensor], fill=0) -> Optional[torch.Tensor]:
        if x is None:
            return None
        y = aligned.take(x)
        y = torch.cat([y[:, 1:], torch.full_like(y[:, :1], fill)], dim=1)
        return pad_columns(y, shape.tp, fill).to(device)

    ids = pad_columns(aligned.input_ids, shape.tp, PAD_ID).to(device)
    out = {
        "aligned": aligned,
        "width": batch.input_ids.shape[1],
        "input_ids": ids,
        "position_ids": torch.arange(ids.shape[1], device=device)[None].expand(ids.shape[0], -1),
        "labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], PAD_ID)], dim=1),
        "loss_mask": at_logits(batch.response_mask.bool(), False),
        "images": None,
    }
    if shape.vl_config is not None:
        _add_images(out, batch, aligned, shape)
    elif batch.multimodal:
        raise ValueError("a multimodal batch needs a vision model and data.has_images=true")
    if train:
        out.update(advantages=at_logits(batch.advantages.float()), old=at_logits(batch.old_log_probs),
                   ref=at_logits(batch.ref_log_probs), rollout=at_logits(batch.rollout_log_probs))
    return out


def _add_images(out: Dict[str, Any], batch: Batch, aligned: Aligned, shape: BatchShape) -> None:
    """The VL model's inputs: which tokens are the prompts' image tokens, the images of each row, and
    transformers' 3-D M-RoPE positions (kept row-major as [B, 3, T], so they split and pad with the rows).
    Worked out on the host (the batch's tokens may already be on the device, its vision inputs not; the
    positions are a loop over rows and images), then moved to the device."""
    cols = out["input_ids"].shape[1]
    config = shape.vl_config
    mask = aligned.take(prompt_image_mask(batch.input_ids, batch.attention_mask, batch.response_mask,
                                          config.image_token_id)).cpu()
    multimodal = {k: v.cpu() for k, v in (batch.multimodal or {}).items()}
    images = RowImages.of(multimodal, mask, config.vision_config.spatial_merge_size)
    pos = mrope_positions(aligned.input_ids.cpu(), aligned.valid.cpu(), mask,
                          None if images is None else images.grid_thw, config)  # [3, B, T]
    out["image_mask"] = pad_columns(mask, shape.tp, False).to(shape.device)
    out["position_ids"] = F.pad(pos.permute(1, 0, 2), (0, cols - pos.shape[-1])).contiguous().to(shape.device)
    out["images"] = None if images is None else images.to(shape.device)


def to_batch_layout(prepared: Dict[str, Any], values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-logit values [B, T'] -> per-token values [B, T] of the original layout, 0 outside the response."""
    aligned: Aligned = prepared["aligned"]
    device = response_mask.device
    tok = F.pad(values[:, :-1], (1, 0))[:, :prepared["width"]].float().to(device)
    out = aligned.restore(tok)
    return torch.where(response_mask.bool(), out, torch.zeros((), dtype=out.dtype, device=device))


def split_rows(p: Dict[str, Any], parts: int) -> List[Dict[str, Any]]:
    """`p` split into up to `parts` micro batches of consecutive rows."""
    rows = p["input_ids"].shape[0]
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    images = p.get("images")
    return [{**{k: (v[a:b] if k in ROW_KEYS and v is not None else v) for k, v in p.items()},
             "images": None if images is None else images.take_rows(a, b)}
            for a, b in zip(bounds, bounds[1:]) if b > a]


def schedule_ready(prepared: List[Dict[str, Any]], shape: BatchShape) -> List[Dict[str, Any]]:
    """Micro batches of one shape (rows and columns padded with entries that count nowhere), so pipeline
    stages can exchange fixed-shape activations; a multiple of `shape.micro_multiple` of them (megatron's
    interleaved schedule needs a multiple of PP), padded with empty micro batches."""
    rows = max(p["input_ids"].shape[0] for p in prepared)
    cols = max(p["input_ids"].shape[1] for p in prepared)
    count = len(prepared) + (-len(prepared)) % shape.micro_multiple
    out = []
    for i in range(count):
        p = prepared[min(i, len(prepared) - 1)]
        q = dict(p)
        for k in ROW_KEYS:
            v = p.get(k)
            if v is None:
                continue
            if i >= len(prepared):  # an empty micro batch
                v = torch.zeros_like(v)
            grown = v.new_zeros((rows, *v.shape[1:-1], cols))  # [rows, cols] ([rows, 3, cols]: M-RoPE)
            grown[:v.shape[0], ..., :v.shape[-1]] = v
            q[k] = grown
        if shape.vl_config is None:
            q["position_ids"] = torch.arange(cols, device=shape.device)[None].expand(rows, -1)
        if i >= len(prepared):
            q["images"] = None
        out.append(q)
    return out
