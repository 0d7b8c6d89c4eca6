"""Dotted look-ups in a config tree (a DictConfig or the plain dict tree the planning code builds): `at` for a key
that must be there, `get` for one that may be absent (or sit under a null group)."""
from __future__ import annotations

from typing import Any


def at(cfg: Any, dotted: str) -> Any:
    """`cfg["a"]["b"]` for "a.b"."""
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """`at(cfg, dotted)`, or `default` when a key is missing or a group on the way is null (model.vision)."""
    try:
        return at(cfg, dotted)
    except (KeyError, AttributeError, TypeError):
        return default
