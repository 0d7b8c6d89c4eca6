"""Names that several layers check or offer (the config's rules, the runtime, the verl converter), stated once, and
the did-you-mean helper their messages use. A leaf module: standard library only, imports nothing of qwen35rl."""
from __future__ import annotations

import difflib
from typing import Iterable

TRACKERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""`trainer.trackers` values the runtime can write to."""

REWARDS = ("exact_match", "math", "format", "copy_digit", "sum_digits")
"""Built-in `data.reward` names (`qwen35rl.rewards.registry.BUILTIN` holds their scorers; a test keeps both equal)."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """'did you mean 'x'?' for the closest of `candidates`, or '' when none is close."""
    close = difflib.get_close_matches(str(word), list(candidates), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
