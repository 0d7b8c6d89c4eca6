"""Compose the run config from command-line overrides, and turn every composition failure into a ConfigError that
names the key, the bad value, what is allowed and a hint. Pure hydra/omegaconf: nothing heavy is imported."""
from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf, errors as oc_errors

from qwen35rl.config.paths import config_dir, extra_config_dirs
from qwen35rl.config.store import register

# Config groups a user picks with `group=option` (recipe is picked automatically but may be forced).
GROUPS = ("model", "hw", "backend", "rollout", "algorithm", "data", "parallelism", "cluster", "recipe")
# Helper trees that are included by other configs, never chosen on the command line.
_INTERNAL_DIRS = {"model_base", "platform", "hydra", "schema"}


class ConfigError(Exception):
    """A config that cannot be composed: one short block for the user, exit code 2."""

    def __init__(self, key: str, message: str, value: Optional[str] = None, allowed: Sequence[str] = (),
                 hint: str = "", code: str = "config_error"):
        super().__init__(message)
        self.key, self.message, self.value, self.allowed, self.hint, self.code = key, message, value, list(allowed), hint, code

    def render(self) -> str:
        lines = [f"qwen35rl: config error at '{self.key}': {self.message}"]
        if self.value is not None:
            lines.append(f"  value:   {self.value}")
        if self.allowed:
            shown = ", ".join(self.allowed[:40]) + (" ..." if len(self.allowed) > 40 else "")
            lines.append(f"  allowed: {shown}")
        if self.hint:
            lines.append(f"  hint:    {self.hint}")
        lines.append("  (set HYDRA_FULL_ERROR=1 for the full traceback)")
        return "\n".join(lines)

    def to_problem_dict(self) -> dict:
        hint = self.hint or (f"allowed: {', '.join(self.allowed[:20])}" if self.allowed else "")
        return {"code": self.code, "severity": "error", "key": self.key, "message": self.message, "hint": hint}


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(candidates), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


# ------------------------------------------------------------------------------------------------ search path
def search_dirs() -> List[Path]:
    """The packaged tree first, then QWEN35RL_CONFIG_PATH overlays (later directories win on equal names)."""
    return [config_dir(), *extra_config_dirs()]


def searchpath_override() -> List[str]:
    extra = extra_config_dirs()
    for d in extra:
        if not d.is_dir():
            raise ConfigError("QWEN35RL_CONFIG_PATH", f"overlay directory {d} does not exist", value=str(d),
                              hint="fix or unset the environment variable QWEN35RL_CONFIG_PATH")
    return [f"hydra.searchpath=[{','.join('file://' + str(d) for d in extra)}]"] if extra else []


def available_options(group: str) -> List[str]:
    """Options of a config group across the search path, e.g. `megatron/qwen3_5_27b@gpu_1node` for parallelism."""
    names = set()
    for root in search_dirs():
        base = root / group
        if base.is_dir():
            for p in base.rglob("*.yaml"):
                rel = p.relative_to(base).with_suffix("").as_posix()
                if not rel.startswith("common/"):
                    names.add(rel)
    return sorted(names)


# ------------------------------------------------------------------------------------------------- overrides
def parse_overrides(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as e:
        bad = next((o for o in overrides if o in str(e)), None) or str(e).split("'")[1:2]
        raise ConfigError(str(bad), "cannot parse this override", hint="write overrides as key=value, "
                          "group=option, +new.key=value or key=a,b,c with -m") from None


def _group_of(key: str) -> Optional[str]:
    return key if key in GROUPS else None


def check_group_choices(parsed) -> None:
    """Unknown group options fail here with the list of options and a did-you-mean."""
    for o in parsed:
        group = _group_of(o.key_or_group)
        if group is None or o.is_delete():
            if o.key_or_group in _INTERNAL_DIRS:
                raise ConfigError(o.key_or_group, "is an internal config tree, not a group to choose",
                                  hint=f"choose one of the groups: {', '.join(GROUPS)}")
            continue
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        options = available_options(group)
        for v in values:
            if v is None or (group == "cluster" and str(v) == "null"):
                continue
            if str(v) not in options:
                raise ConfigError(group, f"unknown {group} '{v}'", value=str(v), allowed=options,
                                  hint=did_you_mean(str(v), options) or f"list them with: ls conf/{group}",
                                  code="unknown_group_option")


def single_overrides(parsed) -> List[List[str]]:
    """For a sweep: the override lists to compose so that every swept value is checked once."""
    base = []
    sweeps: List[Tuple[str, List[str]]] = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            vals = [str(v) for v in o.sweep_string_iterator()]
            base.append(f"{key}={vals[0]}")
            sweeps.append((key, vals))
        else:
            base.append(o.input_line)
    out = [base]
    for i, (key, vals) in enumerate(sweeps):
        for v in vals[1:]:
            variant = list(base)
            variant[[b.split("=", 1)[0] for b in base].index(key)] = f"{key}={v}"
            out.append(variant)
    return out


# ---------------------------------------------------------------------------------------------------- compose
def _hydra_compose(overrides: Sequence[str]) -> DictConfig:
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=[*overrides, *searchpath_override()])


def _keys_at(cfg: DictConfig, dotted_parent: str) -> List[str]:
    node = OmegaConf.select(cfg, dotted_parent) if dotted_parent else cfg
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _is_open_dict(dotted: str, overrides: Sequence[str]) -> bool:
    """A pass-through dict (env, engine_kwargs, ...) of the schema: it takes new keys with `+`."""
    try:
        cfg = _hydra_compose([o for o in overrides if o.split("=", 1)[0] in GROUPS])
        node = OmegaConf.select(cfg, dotted)
        return isinstance(node, DictConfig) and node._metadata.object_type in (None, dict)
    except Exception:
        return False


def _translate(exc: BaseException, overrides: Sequence[str]) -> ConfigError:
    """Map hydra/omegaconf exceptions onto a ConfigError with the key, value, allowed and a hint."""
    cause = exc
    while getattr(cause, "__cause__", None) is not None and not isinstance(cause, oc_errors.OmegaConfBaseException):
        cause = cause.__cause__
    msg = str(getattr(cause, "msg", None) or cause).split("\n")[0].strip()
    full_key = getattr(cause, "full_key", None) or ""
    unknown = re.search(r"Could not override '([^']+)'", str(exc))
    if unknown:
        full_key, msg = unknown.group(1), "not in struct"
    value = None
    for ov in overrides:
        k, _, v = ov.lstrip("+~").partition("=")
        if k == full_key:
            value = v
    if isinstance(cause, oc_errors.ConfigKeyError) or "not in struct" in msg:
        parent, _, leaf = full_key.rpartition(".")
        try:
            allowed = _keys_at(_hydra_compose([o for o in overrides if o.split("=", 1)[0] in GROUPS]), parent)
        except Exception:  # the suggestion is a courtesy; the error itself stands
            allowed = []
        hint = did_you_mean(leaf, allowed)
        if not hint and _is_open_dict(parent, overrides):
            hint = f"'{parent}' takes new entries with a leading plus: +{full_key}={value if value is not None else '...'}"
        hint = hint or f"see the keys of '{parent or '<root>'}' with: qwen35rl-plan --cfg job"
        return ConfigError(full_key or "?", f"unknown key '{leaf}'", value=value, allowed=allowed, hint=hint,
                           code="unknown_key")
    if isinstance(cause, oc_errors.ValidationError):
        node_type = getattr(cause, "object_type_str", None) or ""
        return ConfigError(full_key or "?", msg, value=value,
                           hint=f"give '{full_key}' a value of the right type{(' (' + node_type + ')') if node_type else ''}",
                           code="wrong_type")
    if isinstance(cause, oc_errors.MissingMandatoryValue):
        return ConfigError(full_key or "?", "has no value", hint=f"set it: {full_key}=...", code="missing_value")
    text = str(exc).strip()
    for group in GROUPS:
        if f"Could not find '{group}/" in text or f"'{group}/" in text and "Could not" in text:
            return ConfigError(group, text.splitlines()[0], allowed=available_options(group), code="unknown_group_option")
    return ConfigError(full_key or "?", text.splitlines()[0] if text else type(exc).__name__,
                       hint="check the overrides; HYDRA_FULL_ERROR=1 shows where it failed")


def compose(overrides: Sequence[str] = (), *, resolve: bool = True) -> DictConfig:
    """The resolved run config for command-line overrides (no sweeps). Raises ConfigError."""
    parsed = parse_overrides(overrides)
    check_group_choices(parsed)
    if any(o.is_sweep_override() for o in parsed):
        raise ConfigError(next(o.key_or_group for o in parsed if o.is_sweep_override()),
                          "a sweep (a,b,c) needs multirun", hint="add -m to run one job per value")
    try:
        cfg = _hydra_compose(overrides)
        if resolve:
            OmegaConf.resolve(cfg)
    except ConfigError:
        raise
    except Exception as e:  # every hydra/omegaconf failure becomes one clear block
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise _translate(e, overrides) from None
    return cfg


def check_sweep(overrides: Sequence[str]) -> None:
    """Before a multirun starts: every swept value must compose (typos stop the whole sweep, nothing runs)."""
    parsed = parse_overrides(overrides)
    check_group_choices(parsed)
    for variant in single_overrides(parsed):
        compose(variant)
