"""verl's reward functions as they are: `data.reward=verl:path/to/file.py:compute_score`.

verl names a reward with custom_reward_function.path / .name and calls it once per response as
`compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` (keyword arguments; a
coroutine function is awaited), taking a number, or a dict whose "score" is the reward. `VerlReward` makes such a
function qwen35rl's `fn(response_text, answer, example) -> float`: solution_str is the decoded response,
ground_truth the row's answer (as text), data_source and extra_info the row's own (`PromptExample.data_source` /
`extra_info`; the dataset's name and an empty dict for rows without them). verl's single-turn rollout adds
`num_turns=2` and `rollout_reward_scores={}` to extra_info; so does this adapter, for functions that read them.

A prefix of `data.reward` rather than a separate switch: the reward stays one setting (one plan line, one key the
verl import and export map, one value in a run's identity), and the value itself says which calling convention the
function follows, so a verl function can never be called with qwen35rl's arguments by a forgotten second key.

Like `FileReward`, it pickles as its file (or module) and function name; the scoring workers load the file when
they unpickle it. Anything the function raises, a dict without "score" or a value that is no finite number fails
that response like any other reward failure (`scoring`: it scores 0 and counts in reward/failed)."""
from __future__ import annotations

import asyncio
import importlib
import inspect
import os
from typing import Any, Callable, Dict

from qwen35rl.names import parse_verl_reward, reward_is_file
from qwen35rl.rewards.loading import FileReward, loaded

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The keyword arguments verl 0.9.1's reward managers call compute_score with (without a reward model)."""
SINGLE_TURN_EXTRA = {"num_turns": 2, "rollout_reward_scores": {}}
"""What verl's single-turn agent loop puts into every response's extra_info."""


class VerlReward:
    """A verl compute_score function of a file (`path/to/file.py`) or module (`pkg.module`), called with verl's
    arguments. Pickles as (target, name)."""

    def __init__(self, target: str, name: str):
        self.target = os.path.abspath(target) if reward_is_file(target) else target
        self.name = name
        self.fn = self._load()

    def _load(self) -> Callable[..., Any]:
        if reward_is_file(self.target):
            return FileReward(self.target, self.name).fn
        return getattr(importlib.import_module(self.target), self.name)

    def __call__(self, response: str, answer: str, example: Any) -> float:
        extra = getattr(example, "extra_info", None)
        kwargs = {"data_source": getattr(example, "data_source", None) or "", "solution_str": response,
                  "ground_truth": answer, "extra_info": {**(extra if isinstance(extra, dict) else {}),
                                                         **SINGLE_TURN_EXTRA}}
        result = self.fn(**kwargs)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(f"{self.name} returned a dict without 'score' (keys: {sorted(map(str, result))})")
            result = result["score"]
        if isinstance(result, str) or not isinstance(result, (int, float)) and not hasattr(result, "__float__"):
            raise TypeError(f"{self.name} returned {type(result).__name__}, not a number or a dict with 'score'")
        return float(result)

    def __getstate__(self) -> Dict[str, str]:
        return {"target": self.target, "name": self.name}

    def __setstate__(self, state: Dict[str, str]) -> None:
        self.target, self.name = state["target"], state["name"]
        self.fn = self._load()

    def __repr__(self) -> str:
        return f"VerlReward({self.target!r}, {self.name!r})"


def signature_problem(fn: Callable[..., Any]) -> str:
    """Why `fn` cannot be called with verl's keyword arguments ('' when it can)."""
    try:
        inspect.signature(fn).bind(**{a: None for a in VERL_ARGUMENTS})
    except TypeError as e:
        return f"it cannot be called as verl calls compute_score ({', '.join(VERL_ARGUMENTS)}, by keyword): {e}"
    except ValueError:  # a builtin without a signature: let the call tell
        return ""
    return ""


def load_verl_reward(spec: str) -> VerlReward:
    """The reward of `data.reward=verl:...`; ValueError naming the setting when the file is missing, the function
    undefined or of another signature."""
    target, name = parse_verl_reward(spec) or ("", "")
    if not target or not name:
        raise ValueError(f"data.reward={spec!r}: expected verl:path/to/file.py:function or verl:pkg.module:function")
    if reward_is_file(target) and not os.path.isfile(target):
        raise ValueError(f"data.reward={spec!r}: the file {target} does not exist here")

    reward = loaded(spec, lambda: VerlReward(target, name))
    if not callable(reward.fn):
        raise ValueError(f"data.reward={spec!r}: {name} is not callable")
    why = signature_problem(reward.fn)
    if why:
        raise ValueError(f"data.reward={spec!r}: {why}")
    return reward
