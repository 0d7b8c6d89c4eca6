"""The model's architecture is one a Qwen3.5 checkpoint (and the engines) can be: grouped-query
and GDN heads, experts and top-k, rotary and M-RoPE sections, and a vocabulary that holds the tokenizer's ids."""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Optional, Tuple

from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import Problem
from qwen35rl.config.rules.registry import _divisors, _err, _nearest, _try, rule, val


# Overrides can make any model.* value: what no Qwen3.5 checkpoint (and no engine) can be is refused here, before
# the engines build it (they would fail deep inside, or route, rotate or embed wrongly without failing).
def _gqa_problems(m: Dict[str, Any]) -> List[Problem]:
    out = []
    heads, kv = int(m["num_attention_heads"]), int(m["num_key_value_heads"])
    if heads % kv:
        best = _nearest(kv, _divisors(heads))
        out += _err("architecture_consistent", "model.num_key_value_heads", f"{kv} KV heads do not divide the "
                    f"{heads} attention heads (grouped-query attention shares each KV head among whole groups)",
                    _try("model.num_key_value_heads", best))
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    if nv % nk:
        out += _err("architecture_consistent", "model.linear_num_value_heads", f"{nv} GDN value heads are not a "
                    f"multiple of the {nk} GDN key heads (model.linear_num_key_heads)",
                    _try("model.linear_num_value_heads", max(nk, nv // nk * nk)))
    return out


def _expert_problems(m: Dict[str, Any]) -> List[Problem]:
    if not m["moe"]:
        return []
    experts, top_k = int(m["num_experts"]), int(m["num_experts_per_tok"])
    if experts < 1:
        return _err("architecture_consistent", "model.num_experts", "an MoE model (model.moe=true) with no experts",
                    "set model.num_experts, or pick a dense model (model.moe=false)")
    if not 1 <= top_k <= experts:
        return _err("architecture_consistent", "model.num_experts_per_tok", f"each token is routed to {top_k} "
                    f"experts, but the router picks among {experts} (model.num_experts), at least one",
                    _try("model.num_experts_per_tok", min(max(top_k, 1), experts)))
    return []


def _rope_problems(m: Dict[str, Any]) -> List[Problem]:
    section = [int(x) for x in m["mrope_section"] or []]
    rotary = float(m["head_dim"]) * float(m["partial_rotary_factor"])
    if rotary != int(rotary) or int(rotary) % 2:
        return _err("architecture_consistent", "model.partial_rotary_factor", f"head_dim {m['head_dim']} x "
                    f"partial_rotary_factor {m['partial_rotary_factor']} = {rotary:g} rotary dimensions, not an even "
                    "whole number", "choose them so that head_dim * partial_rotary_factor is even")
    half = int(rotary) // 2
    if len(section) != 3 or min(section) < 0 or sum(section) != half:
        even = [half - 2 * (half // 3), half // 3, half // 3]
        return _err("architecture_consistent", "model.mrope_section", f"M-RoPE sections {section} must be three "
                    f"(temporal, height, width) summing to the {half} rotary frequency pairs (head_dim "
                    f"{m['head_dim']} x partial_rotary_factor {m['partial_rotary_factor']} / 2)",
                    f"try model.mrope_section=[{','.join(map(str, even))}]")
    return []


def tokenizer_size(m: Dict[str, Any]) -> Optional[Tuple[int, str]]:
    """(ids the tokenizer `model.tokenizer` uses, which one) where that is known without loading it: the byte
    tokenizer's, the Qwen3.5 specials' highest id, or a directory's tokenizer.json."""
    from qwen35rl.config.special_tokens import NUM_BYTES, QWEN_SPECIAL_IDS, SPECIAL_TOKENS

    kind = str(m["tokenizer"])
    if kind == "byte":
        return NUM_BYTES + len(SPECIAL_TOKENS), "the byte tokenizer"
    if kind == "qwen":
        return max(QWEN_SPECIAL_IDS.values()) + 1, "the Qwen3.5 tokenizer (its special tokens)"
    folder = m.get("path") if kind == "checkpoint" else kind
    found = os.path.join(str(folder), "tokenizer.json") if folder else ""
    if not found or not os.path.isfile(found):
        return None
    size = _tokenizer_json_size(found, os.stat(found).st_mtime_ns)
    return (size, found) if size else None


@functools.lru_cache(maxsize=8)
def _tokenizer_json_size(path: str, mtime_ns: int) -> int:
    """Token ids a tokenizer.json uses (0: unreadable, the loader says why). Cached: the layout search asks often."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            tree = json.load(f)
        ids = list(((tree.get("model") or {}).get("vocab") or {}).values())
        ids += [t["id"] for t in tree.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return 0


def _vocab_problems(m: Dict[str, Any]) -> List[Problem]:
    size = tokenizer_size(m)
    if size is None or int(m["vocab_size"]) >= size[0]:
        return []
    return _err("architecture_consistent", "model.vocab_size", f"{m['vocab_size']} embedding rows, but "
                f"{size[1]} uses token ids up to {size[0] - 1}", _try("model.vocab_size", size[0]))


@rule("config")
def architecture_consistent(cfg: Any, layout: Layout) -> List[Problem]:
    """Heads, experts, rotary sections and the vocabulary agree with each other and with the tokenizer."""
    m = val(cfg, "model")
    return _gqa_problems(m) + _expert_problems(m) + _rope_problems(m) + _vocab_problems(m)
