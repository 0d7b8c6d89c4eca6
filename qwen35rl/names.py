"""Names that several layers check or offer (the config's rules, the runtime, the verl converter), stated once, and
the did-you-mean helper their messages use. A leaf module: standard library only, imports nothing of qwen35rl."""
from __future__ import annotations

import difflib
from typing import Iterable, Optional, Tuple

TRACKERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""`trainer.trackers` values the runtime can write to."""

REWARDS = ("exact_match", "math", "format", "copy_digit", "sum_digits")
"""Built-in `data.reward` names (`qwen35rl.rewards.registry.BUILTIN` holds their scorers; a test keeps both equal)."""

VERL_REWARD = "verl:"
"""`data.reward=verl:FILE.py:FUNCTION` (or `verl:pkg.module:FUNCTION`): a reward with verl's compute_score
signature (`qwen35rl.rewards.verl_signature`)."""
VERL_REWARD_NAME = "compute_score"
"""The function verl's custom_reward_function.name defaults to (also when `verl:FILE.py` names none)."""


def reward_is_file(target: str) -> bool:
    """A custom reward's `target` (what precedes `:function`) names a Python file rather than an importable module:
    it ends in .py or holds a path separator. The plan's check and the loader read it by this one rule."""
    return target.endswith(".py") or "/" in target


def parse_verl_reward(spec: str) -> Optional[Tuple[str, str]]:
    """(file or module, function) of a `verl:` reward, None for any other `data.reward`. The function is what
    follows the last ':' (a path may hold ':' itself); `verl:FILE.py` alone names verl's default, compute_score."""
    if not str(spec).startswith(VERL_REWARD):
        return None
    rest = str(spec)[len(VERL_REWARD):]
    target, sep, name = rest.rpartition(":")
    if not sep or rest.endswith(".py"):
        return rest, VERL_REWARD_NAME
    return target, name


def verl_reward(target: str, name: Optional[str]) -> str:
    """The `data.reward` value of verl's custom_reward_function (path, name)."""
    return f"{VERL_REWARD}{target}:{name or VERL_REWARD_NAME}"


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """'did you mean 'x'?' for the closest of `candidates`, or '' when none is close."""
    close = difflib.get_close_matches(str(word), list(candidates), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
