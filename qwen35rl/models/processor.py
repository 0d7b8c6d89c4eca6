"""The Qwen VL processor (tokenizer + image processor) of a vision model, built in code or read from a directory.

transformers' `Qwen3VLProcessor` also wants a video processor, which needs torchvision. Without torchvision the
processor here handles images only; it saves as a `Qwen3VLProcessor` so environments with torchvision (vLLM)
load the full class from the same files.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, List, Optional, Sequence

from transformers import Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# The official checkpoints' preprocessor_config.json (pixels per image, min and max).
OFFICIAL_MIN_PIXELS = 65536
OFFICIAL_MAX_PIXELS = 16777216
# Models built in code: small images keep tests fast (1 to 4 merged image tokens each).
SMALL_MAX_TOKENS = 4


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without the video processor."""

    @classmethod
    def get_attributes(cls):
        return ["image_processor", "tokenizer"]

    def to_dict(self):
        out = super().to_dict()
        out["processor_class"] = Qwen3VLProcessor.__name__
        return out


def image_processor(vision_cfg: Any, *, min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=vision_cfg.patch_size,
        temporal_patch_size=vision_cfg.temporal_patch_size,
        merge_size=vision_cfg.spatial_merge_size,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": int(min_pixels), "longest_edge": int(max_pixels)},
    )


def _with_tokenizer(image_proc: Any, tokenizer: Any) -> Qwen3VLProcessor:
    if importlib.util.find_spec("torchvision") is not None:
        from transformers import Qwen3VLVideoProcessor

        return Qwen3VLProcessor(image_processor=image_proc, tokenizer=tokenizer,
                                video_processor=Qwen3VLVideoProcessor(), chat_template=tokenizer.chat_template)
    return ImageOnlyQwen3VLProcessor(image_processor=image_proc, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def build_processor(model_cfg: Any, tokenizer: Any, *, max_pixels: Optional[int] = None) -> Qwen3VLProcessor:
    """The processor of a vision model. A checkpoint / tokenizer directory with a processor config is read;
    otherwise it is built in code: the official sizes for the official checkpoints (`model.hf_id`), small
    images (at most SMALL_MAX_TOKENS merged tokens) for models built in code."""
    v = model_cfg.vision
    if v is None:
        raise ValueError(f"model {model_cfg.name} has no vision tower (model.vision is null): it takes no images")
    directory = model_cfg.path if model_cfg.tokenizer == "checkpoint" else model_cfg.tokenizer
    if directory and any(os.path.isfile(os.path.join(directory, f)) for f in ("processor_config.json", "preprocessor_config.json")):
        return _with_tokenizer(Qwen2VLImageProcessorPil.from_pretrained(directory), tokenizer)
    unit = (v.patch_size * v.spatial_merge_size) ** 2  # pixels of one merged image token
    if model_cfg.hf_id:
        lo, hi = OFFICIAL_MIN_PIXELS, OFFICIAL_MAX_PIXELS
    else:
        lo, hi = unit, unit * SMALL_MAX_TOKENS
    return _with_tokenizer(image_processor(v, min_pixels=lo, max_pixels=max_pixels or hi), tokenizer)


def prompt_ids(processor: Any, messages: List[Dict[str, Any]], images: Optional[Sequence[Any]]) -> List[int]:
    """Token ids of a chat prompt with images: the chat template applied (generation prompt added), each image
    part expanded to as many image tokens as the image processor makes of that image."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=list(images) if images else None, return_tensors="pt")
    return enc["input_ids"][0].tolist()


def vision_inputs(image_processor: Any, images: Sequence[Any]) -> Dict[str, Any]:
    """`pixel_values` (patches of all images, concatenated) and `image_grid_thw` (one row per image) in the
    order given, which must be the order of the images' tokens in the batch; {} without images."""
    if not images:
        return {}
    enc = image_processor(images=list(images), return_tensors="pt")
    return {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
