"""The rule registry and the helpers every rule shares.

`rule(scope)` registers a rule in `RULES` (in the order the modules of this package are imported, which is the
order the rules run and report); `val` / `_get` read a dotted key of the config tree, `_err` / `_try` build a
problem and its hint, `_divisors` / `_nearest` pick a valid alternative, and `_reads`, `_model_parallel`,
`_megatron_core`, `_vllm`, `_moe` ask the engine specs and the model which rules apply."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, List, Optional, Tuple

from qwen35rl.config import engine_specs, tree
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import ERROR, Problem


Rule = Callable[[Any, Layout], List[Problem]]
SCOPES = ("config", "train", "rollout", "colocated")
RULES: List[Tuple[str, Rule]] = []
"""(scope, rule) in the order they run: cheap arithmetic first, memory last."""


def rule(scope: str) -> Callable[[Rule], Rule]:
    assert scope in SCOPES, scope

    def register(fn: Rule) -> Rule:
        RULES.append((scope, fn))
        return fn

    return register


val = tree.at
"""`cfg["a"]["b"]` for "a.b": works on a DictConfig and on a plain dict tree."""


def _err(code: str, key: str, message: str, hint: str = "") -> List[Problem]:
    return [Problem(code, key, message, hint, ERROR)]


def _try(key: str, value: Any) -> str:
    return f"try {key}={value}"


def _divisors(n: int) -> List[int]:
    """The divisors of n in increasing order, in O(sqrt n)."""
    n = max(int(n), 1)
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _nearest(value: int, options: Iterable[int]) -> Optional[int]:
    """The option closest to value on a log scale (ties: the smaller)."""
    opts = sorted(set(options))
    if not opts:
        return None
    return min(opts, key=lambda o: (abs(math.log2(o) - math.log2(max(value, 1))), o))


def _reads(layout: Layout, axis: str) -> bool:
    """The training engine reads `parallelism.<axis>` (its spec's layout axes): the rules over that axis apply."""
    return axis in engine_specs.train_engine(layout.backend).layout_axes


def _model_parallel(layout: Layout) -> bool:
    """The world is TP*PP*CP*DP (model parallel) rather than shards of every layer (`TrainEngineSpec`)."""
    return engine_specs.train_engine(layout.backend).model_parallel


def _megatron_core(layout: Layout) -> bool:
    """The training engine builds on megatron-core: its version facts and TransformerConfig apply."""
    return engine_specs.train_engine(layout.backend).uses("megatron")


def _vllm(cfg: Any) -> bool:
    """The rollout engine runs vLLM: its version facts and platform quirks apply."""
    return engine_specs.rollout_uses(str(val(cfg, "rollout.engine")), "vllm")


def _moe(cfg: Any) -> bool:
    return bool(val(cfg, "model.moe"))


def _get(cfg: Any, dotted: str, default: Any = KeyError) -> Any:
    return tree.get(cfg, dotted, default)


def _shown(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
