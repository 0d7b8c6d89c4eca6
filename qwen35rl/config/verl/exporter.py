"""A composed qwen35rl config -> the verl 0.9.1 launch that runs the same settings: the worker environment, the
override list of `python3 -m verl.trainer.main_ppo` (verl's key names, `+` where verl's tree lacks the key), and
every qwen35rl setting verl has no key for. Reads the one table in `keys.py`; imports nothing heavy.

`render` writes a shell script that is safe by construction, whatever an overlay holds: every word is quoted for a
POSIX shell, every comment line stays one line, and a worker environment name that is not a shell identifier (or a
NUL character, which no process can receive) is refused (`shell_problems`) rather than written."""
from __future__ import annotations

import re
import shlex
from typing import Any, Dict, Iterator, List, Tuple

from qwen35rl.config.problems import ERROR, Problem
from qwen35rl.config.verl.keys import (CHOICE_KEYS, FIXED, IMPLIED, OVERRIDE_TC, UNSET, UNUSED_BY_BACKEND,
                                       VLLM_KWARGS, get, keys_for, needs_plus, why_not_exported, worker_env)

ENTRY = ["python3", "-m", "verl.trainer.main_ppo"]
_BARE = re.compile(r"^[A-Za-z_/.][A-Za-z0-9_\-/.+:@]*$")
_KEYWORDS = {"null", "true", "false", "nan", "inf", "-inf", "+inf"}
SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
"""What `export NAME=...` accepts as a name; anything else would be parsed as shell code."""
_BACKSLASHES_BEFORE_INTERPOLATION = re.compile(r"(\\*)\$\{")
_BACKSLASHES_BEFORE_QUOTE = re.compile(r"(\\+)(?='|\Z)")


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
    return _quoted(s)


def _quoted(s: str) -> str:
    """`s` as a single-quoted Hydra string that verl reads back as exactly `s`. Two layers read it: OmegaConf
    resolves `${...}` (k backslashes before it are k/2 literal ones and, when odd, an escape), so a literal `${`
    gets its backslashes doubled and one more; Hydra's quoted string takes backslashes literally except a run just
    before a quote (the closing one included), which it halves, so those runs are doubled and a quote escaped."""
    s = _BACKSLASHES_BEFORE_INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", s)
    s = _BACKSLASHES_BEFORE_QUOTE.sub(lambda m: m.group(1) * 2, s)
    return "'" + s.replace("'", "\\'") + "'"


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
                                                     "backend.transformer_overrides", "hw.mindspeed"):
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
    for f in FIXED:  # where verl's default is not what qwen35rl always does
        if backend in f.backends and f.export is not UNSET:
            put(f.verl, f.export)
    kwargs = effective_engine_kwargs(cfg)
    for key, value in _flatten("", kwargs):
        put(f"{VLLM_KWARGS}.{key}", value, plus=needs_plus(VLLM_KWARGS, key))
    covered |= {"rollout.engine_kwargs", "hw.vllm_quirks"}
    if backend == "megatron":
        for key, value in _flatten("", get(cfg, "backend.transformer_overrides") or {}):
            put(f"{OVERRIDE_TC}.{key}", value, plus=needs_plus(OVERRIDE_TC, key))
        covered.add("backend.transformer_overrides")
        for key, value in _flatten("", get(cfg, "hw.mindspeed") or {}):  # verl hands these to MindSpeed on NPU
            put(f"{OVERRIDE_TC}.{key}", value, plus=needs_plus(OVERRIDE_TC, key))
        covered.add("hw.mindspeed")
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


def shell_problems(cfg: Any, exported: Dict[str, Any]) -> List[Problem]:
    """What `render` cannot write safely, as plan errors: a worker environment name (hw.env, backend.env) that is not
    a shell identifier, and a NUL character in an exported value. `exported` is what will be rendered (redacted)."""
    cfg = to_plain(cfg)
    problems = []
    for where in ("hw.env", "backend.env"):
        for name in get(cfg, where) or {}:
            if not SHELL_NAME.match(str(name)):
                problems.append(Problem(
                    "env_name_not_shell_identifier", where,
                    f"the variable name {str(name)!r} is not a shell identifier: format=verl writes the worker "
                    f"environment as `export NAME=value` lines, where this name would run as shell code",
                    f"rename or remove it where it is set (a cluster overlay, an experiment, +{where}.NAME=...): "
                    f"a name is letters, digits and _, not starting with a digit", ERROR))
    nul = [k for k, v in exported["env"].items() if "\0" in str(v)]
    nul += [a.partition("=")[0].lstrip("+") for a in exported["argv"] if "\0" in a]
    for key in nul:
        problems.append(Problem("nul_in_exported_value", key, "the value holds a NUL character, which no command "
                                "line or environment can carry", "remove the NUL character from the value", ERROR))
    return problems


def render(exported: Dict[str, Any]) -> str:
    """The export as a shell script: `export` lines, the launch with one override per line, then a comment block
    of the settings verl has no key for (grouped by reason). ValueError for what `shell_problems` reports."""
    for name, value in exported["env"].items():
        if not SHELL_NAME.match(name) or "\0" in str(value):
            raise ValueError(f"cannot export the worker environment variable {name!r} (see shell_problems)")
    if any("\0" in a for a in exported["argv"]):
        raise ValueError("an override holds a NUL character (see shell_problems)")
    lines = ["# verl 0.9.1 launch equivalent of this qwen35rl config (qwen35rl-plan ... format=verl)"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(exported["env"].items())]
    lines.append(" ".join(ENTRY) + " \\")
    argv = exported["argv"]
    lines += [f"    {shlex.quote(a)}" + (" \\" if i < len(argv) - 1 else "") for i, a in enumerate(argv)]
    by_why: Dict[str, List[str]] = {}
    for item in exported["not_exported"]:
        by_why.setdefault(item["why"], []).append(_setting(item["key"], item["value"]))
    if by_why:
        lines += ["", "# qwen35rl settings verl has no key for:"]
        for why, items in by_why.items():
            lines.append(_comment(f"   {why}:"))
            lines += [_comment(f"     {x}") for x in items]
    return "\n".join(lines)


def _setting(key: str, value: Any) -> str:
    """`key=value` for the comment block: in Hydra's grammar, or as a Python literal (marked so) when that would
    hold a line break or another character that is not printable."""
    text = f"{key}={hydra_value(value)}"
    return text if text.isprintable() else f"{key if key.isprintable() else repr(key)}={value!r}  (Python literal)"


def _comment(text: str) -> str:
    """A `#` line of `text`: a line break in it would end the comment and make the rest a command."""
    return "#" + (text if text.isprintable() else text.encode("unicode_escape").decode("ascii"))
