"""`data.reward` -> reward function `fn(response_text, answer, example) -> float`."""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Callable, Dict

from qwen35rl.data.synthetic import TASKS, digit_reward
from qwen35rl.names import VERL_REWARD
from qwen35rl.rewards.builtin import exact_match, format_reward, math_reward

RewardFn = Callable[[str, str, Any], float]

BUILTIN: Dict[str, RewardFn] = {
    "exact_match": exact_match,
    "format": format_reward,
    "math": math_reward,
    **{task: digit_reward for task in TASKS},
}


def _loaded(name: str, load: Callable[[], Any]) -> Any:
    """`load()` (importing the reward's module) with what user code does at import time turned into a ValueError
    naming `data.reward`: a module that calls sys.exit would otherwise end the run quietly."""
    try:
        return load()
    except SystemExit as e:
        raise ValueError(f"data.reward={name!r}: its module called sys.exit({e.code!r}) while being imported") from None
    except Exception as e:  # noqa: BLE001 - any failure of user code at import
        raise ValueError(f"data.reward={name!r}: cannot import it ({type(e).__name__}: {e})") from None


class FileReward:
    """`path/to/file.py:function`: the function of a file that is no importable module. Pickles as the path (the
    scoring workers load the file themselves, when they unpickle it)."""

    def __init__(self, path: str, attr: str):
        self.path, self.attr = os.path.abspath(path), attr
        self.fn = self._load()

    def _load(self) -> RewardFn:
        spec = importlib.util.spec_from_file_location(f"qwen35rl_reward_{abs(hash(self.path))}", self.path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{self.path} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, self.attr)

    def __call__(self, response: str, answer: str, example: Any) -> float:
        return self.fn(response, answer, example)

    def __getstate__(self) -> Dict[str, str]:
        return {"path": self.path, "attr": self.attr}

    def __setstate__(self, state: Dict[str, str]) -> None:
        self.path, self.attr = state["path"], state["attr"]
        self.fn = self._load()


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
    if module_name.endswith(".py") or "/" in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"data.reward={name!r}: the file {module_name} does not exist here")
        fn = _loaded(name, lambda: FileReward(module_name, attr))
    else:
        fn = _loaded(name, lambda: getattr(importlib.import_module(module_name), attr))
    if not callable(fn) or (isinstance(fn, FileReward) and not callable(fn.fn)):
        raise ValueError(f"data.reward={name!r} is not callable")
    return fn
