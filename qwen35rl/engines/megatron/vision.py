"""The vision side of the Megatron Qwen3.5-VL model, in plain torch (no megatron import): the transformers vision
tower, Qwen3.5's interleaved multimodal RoPE, and which images belong to which rows of a micro batch (the 3-D
positions of each token come from `models.image_tokens`).

The tower is the transformers module itself (`Qwen3_5VisionModel` / `Qwen3_5MoeVisionModel`): next to the
language model it is small (0.1-0.4B), so the engine keeps HF's code and weights names instead of a Megatron copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn


# ------------------------------------------------------------------------------------------------- positions
class InterleavedMRoPE(nn.Module):
    """Qwen3.5's multimodal rotary embedding in megatron's interface: [3, b, s] positions (temporal, height, width)
    -> frequencies [s, b, 1, rotary dim] for megatron's (non-interleaved, rotate-half) `apply_rotary_pos_emb`.

    Qwen3.5 interleaves the three axes over the frequency index j (transformers' `recomposition_frequencies`):
    j % 3 == 1 takes the height position and j % 3 == 2 the width position while j < 3 * mrope_section[axis]; every
    other j the temporal one. megatron-core's `MultimodalRotaryEmbedding` assigns contiguous blocks instead (the
    Qwen2-VL layout): same positions, different rotations, so it is replaced by this module."""

    def __init__(self, head_dim: int, rotary_percent: float, rotary_base: float, mrope_section: Sequence[int],
                 device: Any = None):
        super().__init__()
        dim = int(head_dim * rotary_percent)
        if 2 * sum(mrope_section) != dim:
            raise ValueError(f"model.mrope_section={list(mrope_section)} must sum to the rotary dim / 2 = {dim // 2}")
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        self.mrope_section = [int(s) for s in mrope_section]

    def forward(self, position_ids: torch.Tensor, mrope_section: Any = None, cp_group: Any = None) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # [3, b, s, dim/2]
        out = freqs[0].clone()
        for axis in (1, 2):
            idx = slice(axis, 3 * self.mrope_section[axis], 3)
            out[..., idx] = freqs[axis, ..., idx]
        emb = torch.cat([out, out], dim=-1)  # [b, s, dim]
        return emb[..., None, :].transpose(0, 1).contiguous()


# ------------------------------------------------------------------------------------------------- the tower
def build_vision_tower(hf_config: Any, dtype: torch.dtype) -> nn.Module:
    """The transformers vision tower of a VL config (weights set later from the HF state)."""
    from transformers import AutoModel

    vision_config = hf_config.vision_config
    vision_config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        tower = AutoModel.from_config(vision_config, dtype=torch.float32)
    for p in tower.parameters():  # parameters only: the rotary inverse frequencies stay fp32
        p.data = p.data.to(dtype)
    return tower


def image_features(tower: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Merged features [image tokens, hidden] of every image, in order (transformers' `get_image_features`)."""
    dtype = next(tower.parameters()).dtype
    return tower(pixel_values.to(dtype), grid_thw=grid_thw, return_dict=True).pooler_output


# ------------------------------------------------------------------------------------------- images per row
@dataclass
class RowImages:
    """The images of a micro batch: vision inputs of all images (patches in image order, images in row order) and
    the row each image belongs to, so rows can be split and padded with their images."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    rows: torch.Tensor
    """[images]: the batch row of each image."""

    @classmethod
    def of(cls, multimodal: dict, image_mask: torch.Tensor, merge: int) -> Optional["RowImages"]:
        """From a `Batch.multimodal` of images (`pixel_values`, `image_grid_thw`) and the batch's image tokens
        (`prompt_image_mask`), which say how many images each row holds."""
        if not multimodal or multimodal.get("pixel_values") is None:
            return None
        grid = multimodal["image_grid_thw"].long()
        tokens = grid.prod(-1) // (merge * merge)
        per_row = image_mask.sum(1)
        if int(tokens.sum()) != int(per_row.sum()):
            raise ValueError(f"{int(per_row.sum())} image tokens in the batch for images of {int(tokens.sum())} tokens: "
                             "prompt ids and images do not belong together")
        ends = tokens.cumsum(0)
        row_ends = per_row.cumsum(0)
        rows = torch.searchsorted(row_ends, ends, right=False)
        return cls(multimodal["pixel_values"], grid, rows)

    def take_rows(self, start: int, stop: int) -> Optional["RowImages"]:
        """The images of rows [start, stop), renumbered from 0."""
        keep = (self.rows >= start) & (self.rows < stop)
        if not bool(keep.any()):
            return None
        patches = self.grid_thw.prod(-1)
        first = torch.cat([patches.new_zeros(1), patches.cumsum(0)])
        idx = keep.nonzero().flatten()
        a, b = int(first[idx[0]]), int(first[idx[-1] + 1])  # an image's rows are consecutive: one slice
        return RowImages(self.pixel_values[a:b], self.grid_thw[idx], self.rows[idx] - start)

    def to(self, device: Any) -> "RowImages":
        return RowImages(self.pixel_values.to(device), self.grid_thw.to(device), self.rows.to(device))

