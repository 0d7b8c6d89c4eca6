"""`data.reward` -> reward function `fn(response_text, answer, example) -> float`."""
from __future__ import annotations

import importlib
import os
from typing import Dict

from qwen35rl.data.synthetic import TASKS, digit_reward
from qwen35rl.names import VERL_REWARD, reward_is_file
from qwen35rl.rewards.builtin import exact_match, format_reward, math_reward
from qwen35rl.rewards.loading import FileReward, RewardFn, loaded

BUILTIN: Dict[str, RewardFn] = {
    "exact_match": exact_match,
    "format": format_reward,
    "math": math_reward,
    **{task: digit_reward for task in TASKS},
}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward (exact_match, format, math, a synthetic task's name), `pkg.module:function`,
    `path/to/file.py:function`, or a function of verl's signature: `verl:path/to/file.py:compute_score`.

    The function runs in worker processes, so a custom one must be importable by that path (module level)."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name.startswith(VERL_REWARD):  # verl's compute_score(data_source, solution_str, ground_truth, extra_info)
        from qwen35rl.rewards.verl_signature import load_verl_reward

        return load_verl_reward(name)
    if ":" not in name:
        raise ValueError(f"data.reward={name!r}: expected one of {', '.join(BUILTIN)}, a dotted path "
                         f"pkg.module:function, path/to/file.py:function or verl:path/to/file.py:compute_score")
    module_name, _, attr = name.partition(":")  # as the plan reads it (rules.path_findings)
    if reward_is_file(module_name):
        if not os.path.isfile(module_name):
            raise ValueError(f"data.reward={name!r}: the file {module_name} does not exist here")
        fn = loaded(name, lambda: FileReward(module_name, attr))
    else:
        fn = loaded(name, lambda: getattr(importlib.import_module(module_name), attr))
    if not callable(fn) or (isinstance(fn, FileReward) and not callable(fn.fn)):
        raise ValueError(f"data.reward={name!r} is not callable")
    return fn
