"""Platform quirks of vLLM, stated as facts of the hardware (`hw.vllm_quirks`): each item {key, value,
below_version, why} sets `rollout.engine_kwargs[key] = value` while `rollout.vllm_version` < below_version
(null: on every version). A value the user sets in `rollout.engine_kwargs` wins; the rule `quirk_overridden`
warns about it with the quirk's reason."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple


def version_tuple(text: Any) -> Tuple[int, ...]:
    """'0.18.0' -> (0, 18, 0); suffixes such as rc1, .dev3 or +cpu are ignored ('0.11.0rc2' -> (0, 11, 0))."""
    parts = []
    for piece in str(text).split("+")[0].split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() < len(piece):
            break
    return tuple(parts)


def version_below(version: Any, bound: Optional[Any]) -> bool:
    """True when `version` < `bound`; a null bound applies to every version."""
    return True if bound is None else version_tuple(version) < version_tuple(bound)


def applying_quirks(cfg: Any) -> List[Dict[str, Any]]:
    """The vLLM quirks of this hardware that apply to the configured vLLM version."""
    version = cfg["rollout"]["vllm_version"]
    return [dict(q) for q in (cfg["hw"]["vllm_quirks"] or []) if version_below(version, q.get("below_version"))]


def effective_engine_kwargs(cfg: Any) -> Dict[str, Any]:
    """`rollout.engine_kwargs` with the applying quirks merged in (the user's own value for a key wins)."""
    user = dict(cfg["rollout"]["engine_kwargs"] or {})
    merged = {q["key"]: q["value"] for q in applying_quirks(cfg)}
    merged.update(user)
    return merged
