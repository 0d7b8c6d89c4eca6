"""One prompt of the dataset, as the GRPO loop sees it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class PromptExample:
    prompt_ids: List[int]
    """Token ids of the prompt (chat template applied when `data.use_chat_template`). Empty for multimodal data:
    the processor builds them together with the image tokens."""
    prompt_text: str
    """The text behind `prompt_ids` (for multimodal data: the user text, `<image>` placeholders removed)."""
    answer: str
    """Ground truth the reward function compares against."""
    images: Optional[List[Any]] = None
    """PIL images of a multimodal prompt, in order; None for text."""
    index: int = 0
    """Row of the source file (or number of the synthetic prompt): stable across runs, used for grouping and logs."""
    messages: Optional[List[Dict[str, Any]]] = None
    """Chat messages behind the prompt (system + user); multimodal user content is a list of
    {"type": "image"} / {"type": "text", "text": ...} parts, the form processors' chat templates take."""
    data_source: Optional[str] = None
    """The row's `data_source` column (verl's preprocessed parquet has one), else the dataset's name: what a
    verl-signature reward (`data.reward=verl:FILE:FUNCTION`) is given as `data_source`."""
    extra_info: Optional[Dict[str, Any]] = None
    """The row's `extra_info` column, else an empty dict: a verl-signature reward's `extra_info`."""
