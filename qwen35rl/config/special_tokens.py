"""Special-token ids: the official Qwen3.5 vocabulary's, or the byte-level tokenizer's (ids right after the 256
byte tokens). Both the model config (eos / pad / image token ids) and the tokenizer read them from here."""
from __future__ import annotations

from typing import Any, Dict

# Names used across the package -> token text.
SPECIAL_TOKENS: Dict[str, str] = {
    "eos": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "pad": "<|pad|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>",
    "think": "<think>",
    "think_end": "</think>",
}

NUM_BYTES = 256
BYTE_SPECIAL_IDS: Dict[str, int] = {name: NUM_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)}

# The official checkpoints pad with <|endoftext|>.
QWEN_SPECIAL_IDS: Dict[str, int] = {
    "eos": 248044,
    "im_start": 248045,
    "im_end": 248046,
    "pad": 248044,
    "vision_start": 248053,
    "vision_end": 248054,
    "image_pad": 248056,
    "video_pad": 248057,
    "think": 248068,
    "think_end": 248069,
}


def special_token_ids(model_cfg: Any) -> Dict[str, int]:
    """Ids of the special tokens for `model.tokenizer` (byte layout for `byte`, the official ids otherwise)."""
    if model_cfg.tokenizer == "byte":
        needed = NUM_BYTES + len(SPECIAL_TOKENS)
        if model_cfg.vocab_size < needed:
            raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is below the byte tokenizer's {needed} tokens")
        return dict(BYTE_SPECIAL_IDS)
    return dict(QWEN_SPECIAL_IDS)
