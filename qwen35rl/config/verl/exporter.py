"""A composed qwen35rl config -> the verl 0.9.1 launch that runs the same settings: the worker environment, the
override list of `python3 -m verl.trainer.main_ppo` (verl's key names, `+` where verl's tree lacks the key), and
every qwen35rl setting verl has no key for. Reads the one table in `keys.py`; imports nothing heavy."""
from __future__ import annotations

import re
import shlex
from typing import Any, Dict, Iterator, List, Tuple

from qwen35rl.config.verl.keys import (CHOICE_KEYS, IMPLIED, OVERRIDE_TC, UNUSED_BY_BACKEND, VLLM_KWARGS, get,
                                       keys_for, why_not_exported, worker_env)

ENTRY = ["python3", "-m", "verl.trainer.main_ppo"]
_BARE = re.compile(r"^[A-Za-z_/.][A-Za-z0-9_\-/.+:@]*$")
_KEYWORDS = {"null", "true", "false", "nan", "inf", "-inf", "+inf"}


def hydra_value(v: Any) -> str:
    """`v` in Hydra's override grammar (what verl's command line parses back to the same value)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    if _BARE.match(s) and s.lower() not in _KEYWORDS and not _numeric(s):
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _flatten(prefix: str, d: Any) -> Iterator[Tuple[str, Any]]:
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            yield from _flatten(f"{prefix}{k}.", v)
        else:
            yield f"{prefix}{k}", v


def _leaves(prefix: str, d: Any) -> Iterator[Tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in ("hw.env", "backend.env", "rollout.engine_kwargs",
                                                     "backend.transformer_overrides"):
            yield from _leaves(key + ".", v)
        else:
            yield key, v


def to_plain(cfg: Any) -> Dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg


def export(cfg: Any) -> Dict[str, Any]:
    """{"argv": overrides after `python3 -m verl.trainer.main_ppo`, "env": worker environment,
    "not_exported": [{"key", "value", "why"}]} for a composed (resolved) config."""
    from qwen35rl.config.quirks import effective_engine_kwargs

    cfg = to_plain(cfg)
    backend = str(get(cfg, "backend.name"))
    argv: List[str] = ["model_engine=megatron"] if backend == "megatron" else []
    covered = {"backend.name", "format", "trainer.run_name"}

    def put(key: str, value: Any, plus: bool = False) -> None:
        argv.append(f"{'+' if plus else ''}{key}={hydra_value(value)}")

    device = str(get(cfg, "hw.device"))
    put("trainer.nnodes", int(get(cfg, "hw.nodes")))
    put("trainer.n_gpus_per_node", int(get(cfg, "hw.devices_per_node")))
    put("trainer.device", device)
    covered |= {q for q in CHOICE_KEYS.values()}
    for k in keys_for(backend):
        if not k.exported or (k.export_when and not k.export_when(cfg)):
            continue
        value = k.to_verl(k.qwen_value(cfg), cfg)
        if value is None and k.plus:
            continue
        covered.add(k.qwen)
        for name in (k.verl, *k.also):
            put(name, value, k.plus)
    kwargs = effective_engine_kwargs(cfg)
    for key, value in _flatten("", kwargs):
        put(f"{VLLM_KWARGS}.{key}", value, plus=True)
    covered |= {"rollout.engine_kwargs", "hw.vllm_quirks"}
    if backend == "megatron":
        for key, value in _flatten("", get(cfg, "backend.transformer_overrides") or {}):
            put(f"{OVERRIDE_TC}.{key}", value, plus=True)
        covered.add("backend.transformer_overrides")
    if get(cfg, "model.path"):
        covered |= {"model.hf_id", "model.name"}
    env = worker_env(cfg)
    covered |= {"hw.env", "backend.env"}
    covered |= {key for key, holds in IMPLIED.items() if holds(cfg)}
    unused = set(UNUSED_BY_BACKEND.get(backend, ()))
    not_exported = [{"key": key, "value": value, "why": why_not_exported(key)}
                    for key, value in _leaves("", cfg)
                    if key not in covered and key not in unused and not any(key.startswith(c + ".") for c in covered)]
    return {"argv": argv, "env": env, "not_exported": not_exported}


def render(exported: Dict[str, Any]) -> str:
    """The export as a shell script: `export` lines, the launch with one override per line, then a comment block
    of the settings verl has no key for (grouped by reason)."""
    lines = ["# verl 0.9.1 launch equivalent of this qwen35rl config (qwen35rl-plan ... format=verl)"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(exported["env"].items())]
    lines.append(" ".join(ENTRY) + " \\")
    argv = exported["argv"]
    lines += [f"    {shlex.quote(a)}" + (" \\" if i < len(argv) - 1 else "") for i, a in enumerate(argv)]
    by_why: Dict[str, List[str]] = {}
    for item in exported["not_exported"]:
        by_why.setdefault(item["why"], []).append(f"{item['key']}={hydra_value(item['value'])}")
    if by_why:
        lines += ["", "# qwen35rl settings verl has no key for:"]
        for why, items in by_why.items():
            lines.append(f"#   {why}:")
            lines += [f"#     {x}" for x in items]
    return "\n".join(lines)
