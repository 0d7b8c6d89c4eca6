"""Values against what the schema declares beside its fields: ranges (`schema.at_least`, `positive`,
`between`), integers and the few values of `Any` fields (`schema.int_or_auto`, `bool_or_auto`).

No rule is registered here: `degrees_positive` (the parallel degrees, `DEGREES`) and `value_in_range` (every
other ranged key) build their problems with `_range_problems` and `_choice_problems`."""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from qwen35rl.config import schema
from qwen35rl.config.problems import Problem
from qwen35rl.config.rules.registry import _err, _get, _shown, _try


DEGREES = ("parallelism.tp", "parallelism.pp", "parallelism.cp", "parallelism.ep", "parallelism.etp", "parallelism.sp",
           "parallelism.vpp", "parallelism.fsdp_size", "parallelism.rollout.tp", "parallelism.rollout.dp",
           "parallelism.rollout.ep", "hw.nodes", "hw.devices_per_node")
"""Ranged keys the layout is derived from: out of range, the layout rules do not run (they would divide by them)."""


def declared_fields() -> Dict[str, Any]:
    """key -> metadata of every schema field that declares something about its values (a range: `schema.at_least`,
    `positive`, `between`; `integer`, `choices`: `schema.int_or_auto`, `bool_or_auto`), over every group (both
    backends)."""
    global _FIELDS
    if _FIELDS is None:
        _FIELDS = {}
        todo = [(name, cls) for name, cls in typing.get_type_hints(schema.RunConfig).items()
                if dataclasses.is_dataclass(cls)]
        todo += [("backend", cls) for cls in schema.BACKENDS.values()]
        while todo:
            prefix, cls = todo.pop(0)
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                kind = hints[f.name]
                inner = [a for a in typing.get_args(kind) if dataclasses.is_dataclass(a)]
                if dataclasses.is_dataclass(kind) or inner:
                    todo.append((f"{prefix}.{f.name}", kind if dataclasses.is_dataclass(kind) else inner[0]))
                elif f.metadata:
                    default = None if f.default is dataclasses.MISSING else f.default
                    _FIELDS[f"{prefix}.{f.name}"] = {**f.metadata, "default": default}
    return _FIELDS


def declared_ranges() -> Dict[str, Tuple[Tuple[float, float, bool, bool], Tuple[Any, ...], bool, Any]]:
    """key -> ((low, high, low open, high open), special values, nullable, default): the ranges the schema declares
    beside its fields (`schema.at_least`, `positive`, `between`), over every group (both backends)."""
    global _RANGES
    if _RANGES is None:
        _RANGES = {k: (m["range"], m["also"], m["nullable"], m["default"]) for k, m in declared_fields().items()
                   if "range" in m}
    return _RANGES


_RANGES: Optional[Dict[str, Any]] = None
_FIELDS: Optional[Dict[str, Any]] = None


def _in_span(v: float, span: Tuple[float, float, bool, bool]) -> bool:
    lo, hi, lo_open, hi_open = span
    if not math.isfinite(v):
        return False
    return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)


def _span_text(span: Tuple[float, float, bool, bool], also: Sequence[Any], nullable: bool) -> str:
    lo, hi, lo_open, hi_open = span
    fmt = lambda x: f"{x:g}" if isinstance(x, float) else str(x)
    if hi in (math.inf, schema.INT_MAX):
        text = f"{'>' if lo_open else '>='} {fmt(lo)}"
    else:
        text = f"in {'(' if lo_open else '['}{fmt(lo)}, {fmt(hi)}{')' if hi_open else ']'}"
    extra = [str(a) for a in also] + (["null"] if nullable else [])
    return text + (f" (or {' or '.join(extra)})" if extra else "")


def _valid_example(span: Tuple[float, float, bool, bool], default: Any, v: float) -> Any:
    """A value inside the span for the hint: the field's default when it is inside, else the nearest bound."""
    if isinstance(default, (int, float)) and not isinstance(default, bool) and _in_span(default, span):
        return default
    lo, hi, lo_open, hi_open = span
    integer = isinstance(v, int) or (isinstance(lo, int) and not isinstance(lo, bool))
    step = 1 if integer else (abs(lo) * 0.01 or 1e-3)
    below = not (isinstance(v, (int, float)) and math.isfinite(v)) or v <= lo
    if below:
        return lo + step if lo_open else lo
    return hi - step if hi_open else hi


def _range_problems(cfg: Any, code: str, keys: Iterable[str]) -> List[Problem]:
    out = []
    for key in keys:
        span, also, nullable, default = declared_ranges()[key]
        v = _get(cfg, key)
        integer = bool(declared_fields()[key].get("integer"))
        if v is KeyError or (isinstance(v, bool) and not integer) or (v is None and nullable) or _among(v, also):
            continue
        allowed = _span_text(span, also, nullable)
        if integer and (isinstance(v, bool) or not isinstance(v, int)):  # an `Any` field (int_or_auto): the type too
            out += _err(code, key, f"{key}={_shown(v)} must be an integer {allowed}",
                        _try(key, _valid_example(span, default, math.nan)))
            continue
        if isinstance(v, (int, float)) and _in_span(v, span):
            continue
        if isinstance(v, (int, float)) and v > span[1] and span[1] == schema.INT_MAX:
            allowed = f"at most {schema.INT_MAX}"
        shown = "null" if v is None else v
        out += _err(code, key, f"{key}={shown} must be {allowed}",
                    _try(key, _valid_example(span, default, v if isinstance(v, (int, float)) else math.nan)))
    return out


def _among(v: Any, allowed: Sequence[Any]) -> bool:
    """v is one of `allowed` by type and value (True is not 1, "1" is not 1)."""
    return any(type(v) is type(a) and v == a for a in allowed)


def _choice_problems(cfg: Any, code: str) -> List[Problem]:
    """Fields typed `Any` that take a few values (`schema.bool_or_auto`): one of them, by type."""
    out = []
    for key, meta in declared_fields().items():
        v = _get(cfg, key)
        if "choices" not in meta or v is KeyError or _among(v, meta["choices"]):
            continue
        names = [_shown(c) for c in meta["choices"]]
        out += _err(code, key, f"{key}={_shown(v)} must be {', '.join(names[:-1])} or {names[-1]}",
                    _try(key, _shown(meta["default"])))
    return out
