"""Running the rules: the gates (values out of range stop every other rule), then each scope's
rules in registration order (`run_rules`); `check_all` runs them all."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence

from qwen35rl.config import memory
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import ERROR, Problem
from qwen35rl.config.rules.choices import value_in_range
from qwen35rl.config.rules.parallelism import degrees_positive, engine_known
from qwen35rl.config.rules.registry import RULES, SCOPES, Rule


GATES = ("engine_known", "degrees_positive", "value_in_range")
"""Rules that run first, whatever the scopes: while they find a value out of its range no other rule runs (the
other rules, the layout search and the memory model compute with these values)."""


def gate_problems(cfg: Any, layout: Optional[Layout] = None) -> List[Problem]:
    """The out-of-range values (an empty list: the config's numbers are safe to compute with)."""
    return engine_known(cfg, layout) + degrees_positive(cfg, layout) + value_in_range(cfg, layout)


def run_rules(cfg: Any, layout: Layout, scopes: Iterable[str] = SCOPES, stop_at_error: bool = False,
              skip: Sequence[Rule] = (), errors_only: bool = False) -> List[Problem]:
    """Problems of the rules in `scopes` (minus `skip`). The other rules are skipped while a value is out of range."""
    wanted = set(scopes)
    if layout is not None and layout.split and min(layout.world, layout.rollout_world) < 1:
        wanted &= {"config"}  # an empty pool: split_pool_sizes says so, no layout rule computes over it
    gates = [(scope, fn) for scope, fn in RULES if fn.__name__ in GATES]
    out: List[Problem] = []
    for scope, fn in gates + [r for r in RULES if r[1].__name__ not in GATES]:
        if fn.__name__ in GATES:
            found = fn(cfg, layout)
            if found:
                wanted = set()
            if "config" not in scopes or fn in skip:
                found = []
        elif scope not in wanted or fn in skip:
            continue
        else:
            found = fn(cfg, layout)
        if errors_only:
            found = [p for p in found if p.severity == ERROR]
        out += found
        if stop_at_error and any(p.severity == ERROR for p in found):
            break
    return out


def check_all(cfg: Any, layout: Layout) -> List[Problem]:
    """Every rule's problems for `cfg` (a resolved DictConfig or plain dict tree) and its derived layout."""
    return run_rules(memory.as_tree(cfg), layout)
