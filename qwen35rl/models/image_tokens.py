"""Which tokens of a Qwen3.5-VL batch are image slots, and the 3-D (M-RoPE) positions transformers gives each
token: shared by the training engines, which build the VL model's inputs themselves."""
from __future__ import annotations

import functools
import types
from typing import Any, Optional

import torch


def prompt_image_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                      image_token_id: int) -> torch.Tensor:
    """[B, T] bool: the image tokens of the prompts, which the vision features replace. A response may sample the
    image token id too; that token is text to the model (no image belongs to it)."""
    return (input_ids == image_token_id) & attention_mask.bool() & ~response_mask.bool()


def mrope_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, image_mask: torch.Tensor,
                    image_grid_thw: Optional[torch.Tensor], hf_config: Any) -> torch.Tensor:
    """3-D positions [3, B, T] of each token, exactly as transformers' Qwen3.5-VL computes them (`get_rope_index`):
    text tokens advance all three axes together, an image's tokens (`image_mask`) span its merged (h, w) grid.
    Padding gets 0."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    # get_rope_index reads only the config and the (stateless) per-grid helper: no model is built for it
    shim = types.SimpleNamespace(config=hf_config,
                                 get_vision_position_ids=functools.partial(Qwen3_5Model.get_vision_position_ids, None))
    positions, _ = Qwen3_5Model.get_rope_index(shim, input_ids, mm_token_type_ids=image_mask.long(),
                                               image_grid_thw=image_grid_thw, attention_mask=attention_mask.long())
    return positions
