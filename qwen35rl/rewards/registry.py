"""`data.reward` -> reward function `fn(response_text, answer, example) -> float`."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict

from qwen35rl.data.synthetic import TASKS, digit_reward
from qwen35rl.rewards.builtin import exact_match, format_reward, math_reward

RewardFn = Callable[[str, str, Any], float]

BUILTIN: Dict[str, RewardFn] = {
    "exact_match": exact_match,
    "format": format_reward,
    "math": math_reward,
    **{task: digit_reward for task in TASKS},
}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward (exact_match, format, math, a synthetic task's name) or `pkg.module:function`.

    The function runs in worker processes, so a custom one must be importable by that path (module level)."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(f"data.reward={name!r}: expected one of {', '.join(BUILTIN)} or a dotted path "
                         f"pkg.module:function")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"data.reward={name!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise ValueError(f"data.reward={name!r} is not callable")
    return fn
