"""Loading a user's reward function: from a module, or from a file that is no importable module (`FileReward`,
which pickles as its path so that scoring workers load the file themselves)."""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Dict

RewardFn = Callable[[str, str, Any], float]


def loaded(name: str, load: Callable[[], Any]) -> Any:
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
