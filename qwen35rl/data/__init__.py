"""Prompt datasets (synthetic, text, multimodal) and the resumable prompt loader."""
from qwen35rl.data.dataset import DataError, build_dataset
from qwen35rl.data.example import PromptExample
from qwen35rl.data.loader import PromptLoader

__all__ = ["DataError", "PromptExample", "PromptLoader", "build_dataset"]
