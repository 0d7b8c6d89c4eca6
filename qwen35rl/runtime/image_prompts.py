"""Token ids of image prompts. The data layer leaves them empty: how many tokens an image takes is the model's
processor's decision (its image processor resizes to the model's patch grid), so they are made here, once, on the
driver. The workers later rebuild each image's vision inputs with the same image processor."""
from __future__ import annotations

import logging
from typing import Any, List, Optional

from qwen35rl.data.dataset import report_length_filter
from qwen35rl.data.example import PromptExample

log = logging.getLogger(__name__)


def tokenize_image_prompts(examples: List[PromptExample], model_cfg: Any, data_cfg: Any,
                           tokenizer: Any, split: Optional[str] = None) -> List[PromptExample]:
    """Fill `prompt_ids` (chat template, image tokens expanded). A prompt over data.max_prompt_length is dropped
    with data.filter_overlong_prompts (logged; a DataError when all are: `split`, "train" or "val", names
    them), else an error: cutting it
    could split an image's tokens."""
    from qwen35rl.models.processor import build_processor, prompt_ids

    processor = build_processor(model_cfg, tokenizer)
    limit = int(data_cfg.max_prompt_length)
    kept, dropped = [], []
    for ex in examples:
        ex.prompt_ids = prompt_ids(processor, ex.messages, ex.images)
        if len(ex.prompt_ids) <= limit:
            kept.append(ex)
        elif data_cfg.filter_overlong_prompts:
            dropped.append(ex)
        else:
            raise ValueError(f"image prompt {ex.index} has {len(ex.prompt_ids)} tokens > data.max_prompt_length="
                             f"{limit}; raise data.max_prompt_length or set data.filter_overlong_prompts=true")
    report_length_filter(data_cfg, split, len(examples), kept, dropped, image_prompts=True)
    return kept
