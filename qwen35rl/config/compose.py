"""Compose the run config from command-line overrides, and turn every composition failure into a ConfigError that
names the key, the bad value, what is allowed and a hint. Pure hydra/omegaconf: nothing heavy is imported."""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf, errors as oc_errors, read_write

from qwen35rl.config.paths import config_dir, extra_config_dirs
from qwen35rl.names import did_you_mean
from qwen35rl.config.store import register

# Config groups a user picks with `group=option` (recipe is picked automatically but may be forced).
GROUPS = ("model", "hw", "backend", "rollout", "algorithm", "data", "placement", "parallelism", "cluster", "recipe")
# Groups every run has (the defaults list of conf/config.yaml picks one): `~group` cannot delete them.
REQUIRED_GROUPS = ("model", "hw", "backend", "rollout", "algorithm", "data", "placement")
# Helper trees that are included by other configs, never chosen on the command line.
_INTERNAL_DIRS = {"model_base", "platform", "hydra", "schema"}


class ConfigError(Exception):
    """A config that cannot be composed: one short block for the user, exit code 2."""

    def __init__(self, key: str, message: str, value: Optional[str] = None, allowed: Sequence[str] = (),
                 hint: str = "", code: str = "config_error"):
        super().__init__(message)
        self.key, self.message, self.value, self.allowed, self.hint, self.code = key, message, value, list(allowed), hint, code

    overrides: Sequence[str] = ()
    """The command line's overrides (set by the CLI): values of secret-looking keys among them are never echoed."""

    def _scrub(self, text: str) -> str:
        """`text` without the secret values of the overrides (qwen35rl/config/redact.py decides what is secret)."""
        from qwen35rl.config.redact import REDACTED, is_secret_name, scrub, secret_values

        pairs = []
        for ov in [*self.overrides, f"{self.key}={self.value}" if self.value is not None else ""]:
            k, eq, v = ov.lstrip("+~").partition("=")
            if eq and v and is_secret_name(k.strip()):
                pairs.append((k.strip(), v))
        for k, v in sorted(pairs, key=lambda p: len(p[1]), reverse=True):
            text = text.replace(f"{k}={v}", f"{k}={REDACTED}")
        return scrub(text, {v for _, v in pairs} | secret_values())

    def _shown_value(self) -> Optional[str]:
        from qwen35rl.config.redact import REDACTED, is_secret_name

        if self.value is not None and self.value != "" and is_secret_name(self.key):
            return REDACTED
        return self.value

    def render(self) -> str:
        lines = [f"qwen35rl: config error at '{self.key}': {self.message}"]
        value = self._shown_value()
        if value is not None:
            lines.append(f"  value:   {value}")
        if self.allowed:
            shown = ", ".join(self.allowed[:40]) + (" ..." if len(self.allowed) > 40 else "")
            lines.append(f"  allowed: {shown}")
        if self.hint:
            lines.append(f"  hint:    {self.hint}")
        lines.append("  (set HYDRA_FULL_ERROR=1 for the full traceback)")
        return self._scrub("\n".join(lines))

    def to_problem_dict(self) -> dict:
        hint = self.hint or (f"allowed: {', '.join(self.allowed[:20])}" if self.allowed else "")
        return {"code": self.code, "severity": "error", "key": self.key, "message": self._scrub(self.message),
                "hint": self._scrub(hint)}


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


def search_groups() -> List[str]:
    """Every config group on the search path (the packaged tree and the QWEN35RL_CONFIG_PATH overlays): its
    top-level directories holding YAML files, internal trees left out. Overlay groups such as `experiment` are
    added with `+experiment=NAME`."""
    names = set()
    for root in search_dirs():
        if root.is_dir():
            for d in root.iterdir():
                if d.is_dir() and d.name not in _INTERNAL_DIRS and not d.name.startswith((".", "_")) \
                        and next(d.rglob("*.yaml"), None) is not None:
                    names.add(d.name)
    return sorted(names)


def group_sources(group: str) -> List[Path]:
    """The search-path directories that hold options of `group`."""
    return [root for root in search_dirs() if (root / group).is_dir()]


GLOBAL_GROUPS = {"cluster": "cluster@_global_"}
"""Groups whose options are merged at the root (conf/config.yaml's defaults list names them so): a plain
`cluster/<name>.yaml` sets `ray_address` or `hw.nodes` without a `# @package _global_` header."""


def normalize_overrides(overrides: Sequence[str]) -> List[str]:
    """Group choices written either way mean the same: `+cluster=x` for a group the defaults list already has
    (Hydra: "Multiple values for cluster") becomes `cluster=x`, and `experiment=x` / `++experiment=x` for an overlay
    group it lacks (Hydra: "No match in the defaults list") becomes `+experiment=x`. A group of `GLOBAL_GROUPS` is
    chosen by its defaults-list name (`cluster=x` -> `cluster@_global_=x`; `cluster=null` and `~cluster` drop
    it). Everything else is kept."""
    out, groups = [], None
    for o in overrides:
        key, eq, value = o.partition("=")
        bare = key.lstrip("+")
        plus = len(key) - len(bare)
        if bare.lstrip("~") in GLOBAL_GROUPS and (eq or bare.startswith("~")) and plus <= 2:
            name = GLOBAL_GROUPS[bare.lstrip("~")]
            none = bare.startswith("~") or value.strip() in ("null", "None")  # no overlay: the entry goes
            out.append(f"~{name}" if none else f"{name}={value}")
            continue
        if eq and plus <= 2 and re.fullmatch(r"[A-Za-z_][\w-]*", bare or "-"):
            if bare in GROUPS:
                o = f"{bare}={value}" if plus else o
            elif plus != 1:
                groups = search_groups() if groups is None else groups
                if bare in groups:
                    o = f"+{bare}={value}"
        out.append(o)
    return out


# ------------------------------------------------------------------------------------------------- overrides
_FORMS = "write overrides as key=value, group=option, +new.key=value, ~key or key=a,b,c with -m"
_CONFUSABLE = {  # letters that look like ASCII ones (Cyrillic, Greek)
    "а": "a", "в": "b", "е": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c", "т": "t", "у": "y",
    "х": "x", "і": "i", "ј": "j", "ѕ": "s", "ԁ": "d", "ɡ": "g", "А": "A", "В": "B", "Е": "E", "З": "3", "К": "K",
    "М": "M", "Н": "H", "О": "O", "Р": "P", "С": "C", "Т": "T", "Х": "X", "І": "I", "Ј": "J", "Ѕ": "S",
    "α": "a", "ο": "o", "ν": "v", "ρ": "p", "τ": "t", "υ": "u", "ι": "i", "κ": "k", "Α": "A", "Β": "B", "Ε": "E",
    "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N", "Ο": "O", "Ρ": "P", "Τ": "T", "Χ": "X", "Υ": "Y",
    "‘": "'", "’": "'", "“": '"', "”": '"', "–": "-", "—": "-", " ": " ",
}


def _ascii_of(ch: str) -> Optional[str]:
    """The ASCII character `ch` stands for (a non-ASCII digit, a fullwidth form, a look-alike letter), if any."""
    import unicodedata

    if ch in _CONFUSABLE:
        return _CONFUSABLE[ch]
    if unicodedata.decimal(ch, None) is not None:
        return str(unicodedata.decimal(ch))
    folded = unicodedata.normalize("NFKC", ch)
    return folded if folded.isascii() and folded.isprintable() and len(folded) == 1 else None


def _key_part(override: str) -> str:
    return override.partition("=")[0].strip().lstrip("+~") if "=" in override else override.strip().lstrip("+~")


def _unbalanced(text: str) -> Optional[str]:
    """Why the brackets or quotes of a value do not pair up, if they do not."""
    pairs, stack, quote = {"]": "[", "}": "{", ")": "("}, [], None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return f"'{ch}' at position {i + 1} of the value closes nothing"
    if quote:
        return f"the quote {quote} is never closed"
    if stack:
        return f"'{stack[-1]}' is never closed (add '{ {'[': ']', '{': '}', '(': ')'}[stack[-1]]}')"
    return None


def explain_override(override: str, parses: bool = False) -> Optional["ConfigError"]:
    """A ConfigError naming the key and the reason when `override` is malformed, else None. Looks at the text
    itself (so the reason is ours, not the parser's grammar dump). `parses`: Hydra's parser accepts it, so only
    what the parser lets through is refused (no key at all)."""
    import unicodedata

    key = _key_part(override)
    if not override.strip():
        return ConfigError("(empty override)", "an empty string is not an override (a stray '' or \"\" on the "
                           "command line?)", value=repr(override), hint=f"drop it; {_FORMS}", code="parse_error")
    for i, ch in enumerate(override if not parses else ""):
        if not ch.isascii():
            name = unicodedata.name(ch, f"U+{ord(ch):04X}")
            fixed = "".join(_ascii_of(c) or c for c in override)
            where = "key" if i < len(override.partition("=")[0]) or "=" not in override else "value"
            if fixed.isascii():
                alt = f"the ASCII form is {fixed}"
                group = _group_of(_key_part(fixed))
                if group and "=" in fixed:
                    guess = did_you_mean(fixed.partition("=")[2], available_options(group))
                    alt = f"{guess} ({alt})" if guess else alt
            else:
                alt = "type it with ASCII characters"
            return ConfigError(key if key.isascii() and key else override, f"non-ASCII character {ch!r} ({name}, "
                               f"U+{ord(ch):04X}) at position {i + 1} of the {where}", value=override, hint=alt,
                               code="parse_error")
    body = override.lstrip("+~")
    if "=" not in override:
        if override.startswith("~") and body:
            return None
        if not body:
            return ConfigError(override, f"'{override}' alone names no key", hint=_FORMS, code="parse_error")
        return ConfigError(key, "has no '=value'", value=override, hint=f"e.g. {key}=... ({_FORMS})",
                           code="parse_error")
    k, _, v = body.partition("=")
    if not k.strip():
        return ConfigError(override, f"'{override}' has no key before '='", value=override, hint=_FORMS,
                           code="parse_error")
    if parses:
        return None
    if k != k.strip() or " " in k or "\t" in k:
        return ConfigError(k.strip(), "a key holds no spaces", value=override,
                           hint=f"try {''.join(k.split())}={v}", code="parse_error")
    if override.startswith("+++") or (override.startswith("~") and override[1:2] in "+~"):
        return ConfigError(k, f"'{override[:3]}' is not a prefix", value=override,
                           hint="use + (add), ++ (add or override) or ~ (delete)", code="parse_error")
    if v.startswith("="):
        return ConfigError(k, "has '==' (one '=' separates key and value)", value=override,
                           hint=f"try {override.replace('==', '=', 1)}", code="parse_error")
    why = _unbalanced(v)
    if why:
        return ConfigError(k, f"the value's brackets or quotes do not pair up: {why}", value=v,
                           hint="close it, e.g. key=[a,b] or key='text'; quote the whole override for your shell",
                           code="parse_error")
    return None


def parse_overrides(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_overrides([o])
            parses = True
        except OverrideParseException:
            parses = False
        err = explain_override(o, parses)
        if err is not None:
            raise err
    try:
        return parser.parse_overrides(list(overrides))
    except OverrideParseException as e:
        bad, reason = None, str(e).strip().splitlines()[0] if str(e).strip() else "cannot parse this override"
        for o in overrides:  # which one: parse them one at a time
            try:
                parser.parse_overrides([o])
            except OverrideParseException as one:
                bad, reason = o, (str(one).strip().splitlines() or [reason])[0]
                break
        reason = re.sub(r"^Error parsing override '.*'$", "cannot parse this override", reason)
        key = _key_part(bad) if bad else "?"
        raise ConfigError(key or str(bad), f"cannot parse this override: {reason}", value=bad, hint=_FORMS,
                          code="parse_error") from None


def _group_of(key: str, groups: Optional[Sequence[str]] = None) -> Optional[str]:
    """`key` when it names a config group (one of GROUPS, or an overlay group on the search path)."""
    if key in GROUPS:
        return key
    return key if "." not in key and key in (search_groups() if groups is None else groups) else None


def check_group_choices(parsed) -> None:
    """Unknown group options fail here with the list of options and a did-you-mean."""
    groups = search_groups()
    for o in parsed:
        group = _group_of(o.key_or_group, groups)
        if group in REQUIRED_GROUPS and o.is_delete():
            raise ConfigError(group, f"'{o.input_line}' deletes the required group '{group}'", value=o.input_line,
                              allowed=available_options(group),
                              hint=f"choose another option instead: {group}=<option>", code="required_group_deleted")
        if group is None or o.is_delete():
            if o.key_or_group in _INTERNAL_DIRS:
                raise ConfigError(o.key_or_group, "is an internal config tree, not a group to choose",
                                  hint=f"choose one of the groups: {', '.join(GROUPS)}")
            continue
        values = sweep_values(o, group) if o.is_sweep_override() else [o.value()]
        options = available_options(group)
        for v in values:
            if v is None or (group == "cluster" and str(v) == "null"):
                continue
            if str(v) not in options:
                where = ", ".join(str(d / group) for d in group_sources(group)) or f"conf/{group}"
                raise ConfigError(group, f"unknown {group} '{v}'", value=str(v), allowed=options,
                                  hint=did_you_mean(str(v), options) or f"the options are the YAML files in {where}",
                                  code="unknown_group_option")


def sweep_values(o: Any, group: Optional[str] = None) -> List[str]:
    """The values a sweep override takes, as strings; a ConfigError for a sweep of no values, a range with step 0,
    or a glob() outside a config group (Hydra raises IndexError / ValueError / HydraException for these)."""
    from hydra.core.override_parser.types import Glob

    key = o.get_key_element()
    if isinstance(o.value(), Glob):
        if group is None and _group_of(o.key_or_group) is None:
            raise ConfigError(key, "glob() picks among the options of a config group, and this is not a group",
                              value=o.input_line, hint=f"list the values: {key}=a,b,c, or use range(start,stop,step)",
                              code="sweep_invalid")
        options = o.value().filter(available_options(group or o.key_or_group))
        values = [str(v) for v in options]
    else:
        try:
            values = [str(v) for v in o.sweep_string_iterator()]
        except ValueError as e:  # range(a,b,0)
            raise ConfigError(key, f"this sweep cannot be expanded: {e}", value=o.input_line,
                              hint=f"give range() a non-zero step, e.g. {key}=range(2,10,2)", code="sweep_invalid") from None
    if not values and isinstance(o.value(), Glob):
        raise ConfigError(key, "this glob() matches no option of the group", value=o.input_line,
                          allowed=available_options(group or o.key_or_group), code="sweep_invalid")
    if not values:
        raise ConfigError(key, "this sweep has no values (an empty range or list)", value=o.input_line,
                          hint=f"e.g. {key}=range(2,10,2) or {key}=a,b", code="sweep_invalid")
    return values


def single_overrides(parsed) -> List[List[str]]:
    """For a sweep: the override lists to compose so that every swept value is checked once."""
    base = []
    sweeps: List[Tuple[str, List[str]]] = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            vals = sweep_values(o)
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
def _hydra_compose(overrides: Sequence[str], job_name: Optional[str] = None) -> DictConfig:
    """Hydra's composition of the overrides; with `job_name` (the command's, as `@hydra.main` names the job) the
    `hydra` node is kept."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name=job_name or "app"):
        return hydra_compose("config", overrides=[*overrides, *searchpath_override()],
                             return_hydra_config=job_name is not None)


def _run_dir_of(cfg: DictConfig) -> str:
    """`hydra.run.dir` of a composition that kept its `hydra` node, resolved as Hydra resolves it for the job: the
    directory a run writes to (Hydra makes it absolute against the working directory)."""
    from hydra.core.hydra_config import HydraConfig

    holder = HydraConfig.instance()
    before = holder.cfg
    try:
        holder.set_config(cfg)  # for ${hydra:...} in the directory's pattern
        return str(OmegaConf.select(cfg, "hydra.run.dir"))
    finally:
        holder.cfg = before


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


# ------------------------------------------------------------------------------------- strict keys, verl names
def _fields_of(object_type: Any) -> Optional[Dict[str, Any]]:
    """The schema fields of a config node's type, or None for a pass-through dict (or a tree no schema types)."""
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return {f.name: f for f in dataclasses.fields(object_type)}
    return None


def pass_through_dicts() -> List[str]:
    """The schema's dict-typed fields (any backend): the only places a leading `+` may add keys."""
    import typing

    from qwen35rl.config import schema

    out: List[str] = []

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint, path = hints.get(f.name), f"{prefix}{f.name}"
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            inner = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
            if typing.get_origin(inner) is dict and path not in out:
                out.append(path)
            elif isinstance(inner, type) and dataclasses.is_dataclass(inner):
                walk(inner, path + ".")
            elif path == "backend":
                for backend in schema.BACKENDS.values():
                    walk(backend, "backend.")

    walk(schema.RunConfig, "")
    return out


def stray_keys(cfg: DictConfig, prefix: str = "") -> List[str]:
    """Keys of a composed config that no schema field declares (what a `+key=` added outside the pass-through
    dicts), each at its first undeclared part."""
    fields = _fields_of(cfg._metadata.object_type)
    if fields is None:
        return []
    out = []
    for k in cfg.keys():
        path = f"{prefix}{k}"
        if str(k) not in fields:
            out.append(path)
            continue
        child = cfg._get_node(k)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing() \
                and not child._is_interpolation():
            out += stray_keys(child, path + ".")
    return out


def _verl_roots() -> List[str]:
    from qwen35rl.config import schema
    from qwen35rl.config.verl import keys as verl_keys

    ours = {f.name for f in dataclasses.fields(schema.RunConfig)} | {"hydra"}
    heads = {k.verl.split(".")[0] for k in verl_keys.KEYS} | {n.split(".")[0] for n in verl_keys.NOT_CARRIED}
    return sorted(heads - ours)


def verl_hint(key: str, value: Optional[str] = None) -> str:
    """For a verl config key (verl 0.9.1's or an older line's name): the qwen35rl key to set instead, from the
    verl<->qwen35rl table (`qwen35rl/config/verl/keys.py`). Empty for anything else."""
    from qwen35rl.config.verl import keys as verl_keys

    key = key.lstrip("+~")
    shown = f"={value}" if value is not None else "=..."
    for k in verl_keys.KEYS:
        if key in k.names() and k.qwen != key:
            return f"this is verl's key; qwen35rl's is {k.qwen}: try {k.qwen}{_converted(k, value)}"
    if key in verl_keys.CHOICE_KEYS:
        target = verl_keys.CHOICE_KEYS[key]
        if target == "backend.name":
            return "this is verl's key; qwen35rl picks the training engine with backend=fsdp or backend=megatron"
        return (f"this is verl's key; qwen35rl's is {target} (or pick a preset with hw=...): "
                f"try {target}{shown}")
    for prefix, target in verl_keys.PASS_THROUGH.items():
        if key.startswith(prefix) and len(key) > len(prefix):
            rest = key[len(prefix):]
            return f"this is verl's key; qwen35rl's is {target}{rest}: try +{target}{rest}{shown}"
    roots = _verl_roots()
    # a named verl key, or one under a prefix of verl's own (not under a root both trees have, such as trainer.)
    explicit = any(key == n or (n.endswith(".") and key.startswith(n) and (n.count(".") > 1 or n.split(".")[0] in roots))
                   for n in verl_keys.NOT_CARRIED)
    if explicit or key.split(".")[0] in roots:
        return (f"this is verl's key; qwen35rl has no such setting ({verl_keys.why_not_carried(key)}); "
                "qwen35rl-import verl converts a whole verl launch")
    return ""


def _converted(key: Any, value: Optional[str]) -> str:
    """`=value` in qwen35rl's terms for verl's `value` of `key` (its converter on the parsed value; the value as
    given when it does not convert: the hint then shows what was typed)."""
    if value is None:
        return "=..."
    from omegaconf import OmegaConf

    try:
        parsed = OmegaConf.create({"v": value})["v"]
        converted = key.to_qwen(parsed, None)
    except Exception:  # noqa: BLE001 - a value verl's converter refuses: shown as typed
        return f"={value}"
    if isinstance(converted, bool):
        return "=" + str(converted).lower()
    return f"={converted}" if converted is not None else "=null"


def _unknown_key(full_key: str, value: Optional[str], stray: str, parent_fields: Sequence[str],
                 top: Sequence[str], added: bool, other_backends: Sequence[str] = (), source: str = "",
                 overrides: Sequence[str] = ()) -> ConfigError:
    """The block for a key no schema field declares. `stray`: its first undeclared part; `parent_fields`: the keys
    declared beside it; `top`: the top-level keys; `added`: it came with a leading `+`."""
    parent, _, leaf = stray.rpartition(".")
    head, _, rest = full_key.partition(".")
    where = f" (set in {source})" if source else ""
    plus_rule = (" ('+' adds keys only inside the pass-through dicts: " + ", ".join(pass_through_dicts()) + ")"
                 if added else "")
    hint = verl_hint(full_key, value)
    if not parent:  # the first part is unknown
        if not hint and added and not rest and value is not None and re.fullmatch(r"[A-Za-z_][\w/@.-]*", value):
            dirs = ", ".join(str(d) for d in search_dirs())
            hint = (f"there is no config group '{head}' on the search path ({dirs}): put the directory holding "
                    f"{head}/{value}.yaml on QWEN35RL_CONFIG_PATH")
        if not hint and rest:
            close = difflib.get_close_matches(head, list(top), n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(c + '.' + rest for c in close)}?" if close else ""
        if not hint:
            hint = did_you_mean(head, top)
        hint = hint or f"'{head}' is not a top-level key; see them with: qwen35rl-plan --cfg job"
        return ConfigError(full_key, f"unknown top-level key '{head}'{where}{plus_rule}", value=value,
                           allowed=list(top), hint=hint, code="unknown_key")
    if not hint:
        hint = did_you_mean(leaf, parent_fields)
    if not hint and other_backends:
        hint = (f"'{stray}' is a setting of backend={' or backend='.join(other_backends)}, not of this run's "
                "backend")
    if not hint and not added and _is_open_dict(parent, overrides):
        hint = f"'{parent}' takes new entries with a leading plus: +{full_key}={value if value is not None else '...'}"
    hint = hint or f"see the keys of '{parent}' with: qwen35rl-plan --cfg job (the schema: qwen35rl/config/schema.py)"
    return ConfigError(full_key, f"unknown key '{leaf}'{where}{plus_rule}", value=value, allowed=list(parent_fields),
                       hint=hint, code="unknown_key")


def check_additions(cfg: DictConfig, parsed: Sequence[Any]) -> None:
    """Refuse keys that `+key=`/`++key=` added outside the schema and its pass-through dicts (Hydra adds any key
    with a leading plus; the engines would never read it)."""
    from qwen35rl.config import schema

    strays = stray_keys(cfg)
    if not strays:
        return
    stray = strays[0]
    added = [o for o in parsed if (o.is_add() or o.is_force_add()) and not o.is_delete()]
    owner = next((o for o in added if o.key_or_group == stray or o.key_or_group.startswith(stray + ".")), None)
    full_key = owner.key_or_group if owner is not None else stray
    value = owner.input_line.partition("=")[2] if owner is not None else None
    parent = stray.rpartition(".")[0]
    node = OmegaConf.select(cfg, parent) if parent else cfg
    fields = list(_fields_of(node._metadata.object_type) or {})
    others = []
    if parent == "backend":
        leaf = stray.rpartition(".")[2]
        others = [name for name, cls in schema.BACKENDS.items() if leaf in (_fields_of(cls) or {})]
    top = list(_fields_of(cfg._metadata.object_type) or {})
    raise _unknown_key(full_key, value, stray, fields, top, added=owner is not None, other_backends=others)


def _source_path(source: str) -> Optional[Path]:
    """The file of the search path Hydra read for the config `source` (e.g. `experiment/x`): overlays win."""
    for root in reversed(search_dirs()):
        f = root / f"{source}.yaml"
        if f.is_file():
            return f
    return None


def _source_file(source: str) -> str:
    """`experiment/x` -> `experiment/x (/path/to/experiment/x.yaml)`."""
    path = _source_path(source)
    return f"{source} ({path})" if path else source


def _set_in_file(path: Optional[Path], full_key: str) -> List[Tuple[str, Optional[str]]]:
    """(dotted key, value) of every leaf the config file sets at or under `full_key` (the file's own package, or
    _global_), so that an unknown section is named down to its keys."""
    if path is None:
        return []
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:
        return []
    parts = full_key.split(".")
    for start in range(len(parts)):  # the file may hold the key under its group's package
        node: Any = tree
        for part in parts[start:]:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None:
            out: List[Tuple[str, Optional[str]]] = []

            def walk(n: Any, prefix: str) -> None:
                if isinstance(n, dict) and n:
                    for k, v in n.items():
                        walk(v, f"{prefix}.{k}")
                else:
                    out.append((prefix, None if isinstance(n, (dict, list)) else str(n)))

            walk(node, full_key)
            return out
    return []


def _yaml_error(exc: BaseException) -> Optional[ConfigError]:
    """A config file that is not YAML (a parse error, a control character): the error names its file and line."""
    import yaml

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
            mark, since = exc.problem_mark, exc.context_mark
            what = str(exc.problem or exc.context)
            if exc.context and exc.problem:
                opened = f" from line {since.line + 1}, column {since.column + 1}" if since is not None else ""
                what += f" ({exc.context}{opened})"
            return ConfigError(f"{mark.name}:{mark.line + 1}", f"not valid YAML at line {mark.line + 1}, column "
                               f"{mark.column + 1}: {what}", hint=f"fix line {mark.line + 1} of {mark.name}",
                               code="config_file_invalid")
        if isinstance(exc, yaml.reader.ReaderError):
            char = f"U+{exc.character:04X}" if isinstance(exc.character, int) else repr(exc.character)
            return ConfigError(str(exc.name), f"not a YAML text file: {exc.reason} ({char} at offset {exc.position})",
                               hint=f"fix or remove {exc.name}", code="config_file_invalid")
        if isinstance(exc, UnicodeDecodeError):  # names no file: the one on the search path that is not UTF-8
            path = next((f for root in search_dirs() for f in sorted(root.rglob("*.yaml")) if not _utf8(f)), None)
            return ConfigError(str(path or "?"), f"not a UTF-8 text file: {exc.reason} (byte {exc.start})",
                               hint=f"save {path or 'the config file'} as UTF-8, or remove it", code="config_file_invalid")
        exc = exc.__cause__ or exc.__context__
    return None


def _utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    except OSError:  # unreadable: not this error
        pass
    return True


def _translate(exc: BaseException, overrides: Sequence[str]) -> ConfigError:
    """Map hydra/omegaconf exceptions onto a ConfigError with the key, value, allowed and a hint."""
    from_yaml = _yaml_error(exc)
    if from_yaml is not None:
        return from_yaml
    cause = exc
    while getattr(cause, "__cause__", None) is not None and not isinstance(cause, oc_errors.OmegaConfBaseException):
        cause = cause.__cause__
    msg = str(getattr(cause, "msg", None) or cause).split("\n")[0].strip()
    full_key = getattr(cause, "full_key", None) or ""
    unknown = re.search(r"Could not override '([^']+)'", str(exc))
    if unknown:
        full_key, msg = unknown.group(1), "not in struct"
        if full_key.startswith("hydra."):  # Hydra's own config, not qwen35rl's schema
            value = next((ov.partition("=")[2] for ov in overrides if ov.lstrip("+~").partition("=")[0] == full_key),
                         None)
            return ConfigError(full_key, "Hydra's own config cannot take this override", value=value,
                               hint=f"a Hydra dict that starts empty takes new keys one by one "
                               f"(+{full_key}.<name>=<value>); qwen35rl-plan --cfg hydra lists Hydra's keys",
                               code="unknown_key")
    # an error inside a config file (an overlay setting a key the schema lacks, or a value of the wrong type):
    # Hydra names the file first, then omegaconf's message with the key
    source, kind, value, reported = "", "", None, ""
    in_file = re.match(r"In '([^']+)': (\w+) raised while composing config:\s*(.*)", str(exc), re.S)
    if in_file:
        source, kind, body = _source_file(in_file.group(1)), in_file.group(2), in_file.group(3)
        found = re.search(r"full_key: (\S+)", body)
        full_key = found.group(1) if found else full_key
        msg = (body.strip().splitlines() or [msg])[0]
        leaves = _set_in_file(_source_path(in_file.group(1)), full_key)
        if kind == "ConfigKeyError":
            msg = "not in struct"
            # name the first key the file sets there, a verl name first (its hint says what to write instead)
            leaves = sorted(leaves, key=lambda kv: not verl_hint(kv[0], kv[1]))
        if leaves:
            (full_key, value), reported = leaves[0], full_key
    for ov in overrides:
        k, _, v = ov.lstrip("+~").partition("=")
        if k == full_key:
            value = v
    if (isinstance(cause, oc_errors.ConfigKeyError) and not kind) or "not in struct" in msg:
        try:
            base: Optional[DictConfig] = _hydra_compose([o for o in overrides if o.split("=", 1)[0] in GROUPS])
            top = _keys_at(base, "")
        except Exception:  # the suggestion is a courtesy; the error itself stands
            base, top = None, []
        head = full_key.partition(".")[0]
        stray = head if top and head not in top else (reported or full_key)  # its first undeclared part
        allowed = _keys_at(base, stray.rpartition(".")[0]) if base is not None else []
        return _unknown_key(full_key or "?", value, stray, allowed, top, added=False, source=source,
                            overrides=overrides)
    if isinstance(cause, oc_errors.ValidationError) or kind == "ValidationError":
        node_type = getattr(cause, "object_type_str", None) or ""
        where = f" (set in {source})" if source else ""
        return ConfigError(full_key or "?", msg + where, value=value,
                           hint=f"give '{full_key}' a value of the right type{(' (' + node_type + ')') if node_type else ''}",
                           code="wrong_type")
    if isinstance(cause, oc_errors.MissingMandatoryValue):
        return ConfigError(full_key or "?", "has no value", hint=f"set it: {full_key}=...", code="missing_value")
    text = str(exc).strip()
    present = re.search(r"An item is already at '([^']+)'", text)
    if present:  # `+key=` for a key the config has
        k = present.group(1)
        v = next((ov.partition("=")[2] for ov in overrides if ov.lstrip("+").partition("=")[0] == k), "...")
        return ConfigError(k, "is already in the config: a leading '+' adds a new key", value=v,
                           hint=f"set it without the plus: {k}={v}", code="key_exists")
    for group in GROUPS:
        if f"Could not find '{group}/" in text or f"'{group}/" in text and "Could not" in text:
            return ConfigError(group, text.splitlines()[0], allowed=available_options(group), code="unknown_group_option")
    if source:
        return ConfigError(full_key or source, f"{msg} (in {source})", value=value,
                           hint="fix that file; HYDRA_FULL_ERROR=1 shows where it failed")
    return ConfigError(full_key or "?", text.splitlines()[0] if text else type(exc).__name__,
                       hint="check the overrides; HYDRA_FULL_ERROR=1 shows where it failed")


def missing_values(node: Any, prefix: str = "") -> List[str]:
    """Dotted keys left at `???` (a mandatory schema field no config file set), without resolving anything."""
    out: List[str] = []
    for key in list(node.keys() if isinstance(node, DictConfig) else range(len(node))):
        path, child = f"{prefix}{key}", node._get_node(key)
        if path == "hydra":
            continue
        if isinstance(child, (DictConfig, ListConfig)):
            if not child._is_none() and not child._is_missing() and not child._is_interpolation():
                out += missing_values(child, path + ".")
        if child._value() == "???":
            out.append(path)
    return out


def check_missing(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """A mandatory value no file set (a hardware overlay without `device`, say) is named with the option's file,
    before anything reads it (omegaconf would raise MissingMandatoryValue from deep inside the plan or the run)."""
    missing = missing_values(cfg)
    if not missing:
        return
    key = missing[0]
    group = key.partition(".")[0]
    choices = OmegaConf.select(cfg, "hydra.runtime.choices") or {}
    option = choices.get(group) if group in GROUPS else None
    path = _source_path(f"{group}/{option}") if option else None
    where = f" (the {group} option '{option}', {path}, does not set it)" if path else ""
    leaf = key.rpartition(".")[2]
    fix = f"add `{leaf}: ...` to {path}, or set it: {key}=..." if path else f"set it: {key}=..."
    also = f"; also missing: {', '.join(missing[1:6])}" if len(missing) > 1 else ""
    raise ConfigError(key, f"is a mandatory value and has none{where}{also}", hint=fix, code="missing_value")


def _packaged_callbacks() -> Dict[str, Any]:
    tree = OmegaConf.load(config_dir() / "config.yaml")
    return OmegaConf.to_container(OmegaConf.select(tree, "hydra.callbacks") or OmegaConf.create(), resolve=False)


def _callback_file(name: str) -> Optional[Path]:
    """The overlay file that sets `hydra.callbacks.<name>`, if one does."""
    for root in reversed(extra_config_dirs()):
        for f in sorted(root.rglob("*.yaml")):
            try:
                tree = OmegaConf.to_container(OmegaConf.load(f), resolve=False)
            except Exception:  # a broken file is reported where it is composed
                continue
            callbacks = (tree.get("hydra") or {}).get("callbacks") if isinstance(tree, dict) else None
            if isinstance(callbacks, dict) and name in callbacks:
                return f
    return None


def check_callbacks(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Hydra imports and calls the `_target_` of every `hydra.callbacks` entry in each sweep and training run, and
    overlays are shared between teams: only the packaged callbacks and those the command line sets itself run."""
    node = OmegaConf.select(cfg, "hydra.callbacks")
    given = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else {}
    keys = [o.lstrip("+~").partition("=")[0] for o in overrides]
    if "hydra.callbacks" in keys:
        return
    typed = {k.split(".")[2] for k in keys if k.startswith("hydra.callbacks.") and k.count(".") >= 2}
    own = _packaged_callbacks()
    for name, spec in given.items():
        if name in typed or own.get(name) == spec:
            continue
        path = _callback_file(str(name))
        where = f" in {path}" if path else " in a config file"
        raise ConfigError(f"hydra.callbacks.{name}", f"a config overlay may not set Hydra callbacks (set{where}): "
                          "Hydra would import and call its _target_ in every sweep and training run",
                          value=str(spec.get("_target_")) if isinstance(spec, dict) else str(spec),
                          hint=f"remove hydra.callbacks from {path or 'the overlay'}; to run a callback, set it on "
                          f"the command line yourself: +hydra.callbacks.{name}._target_=...",
                          code="overlay_callback")


def _escaped(text: str) -> str:
    """`text` as a string node that reads back as `text`: each `${` escaped (backslashes before it doubled)."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)


def resolve_in_place(cfg: DictConfig) -> None:
    """OmegaConf.resolve, then a literal `${` that a value held (written `\\${`) escaped again: resolving drops the
    escape, and every later read would resolve the text a second time (an interpolation error, or another key's
    value)."""
    OmegaConf.resolve(cfg)

    def walk(node: Any) -> None:
        for key in list(node.keys() if isinstance(node, DictConfig) else range(len(node))):
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)):
                if not child._is_none() and not child._is_missing():
                    walk(child)
            elif isinstance(child._value(), str) and "${" in child._value():
                node[key] = _escaped(child._value())

    with read_write(cfg):
        walk(cfg)


def compose(overrides: Sequence[str] = (), *, resolve: bool = True) -> DictConfig:
    """The resolved run config for command-line overrides (no sweeps). Raises ConfigError."""
    return _compose(overrides, resolve, None)[0]


def compose_run(overrides: Sequence[str] = (), *, job_name: str = "train") -> Tuple[DictConfig, str]:
    """The resolved run config and the directory a run of it writes to: `hydra.run.dir` as Hydra resolves it for
    the job `job_name` (by default `${trainer.output_root}/${trainer.run_name}`; the command line, an overlay or
    `hydra.run.dir=` itself may set it). `qwen35rl-plan` reports it; `qwen35rl-train` runs there."""
    cfg, run_dir = _compose(overrides, True, job_name)
    return cfg, str(run_dir)


def _compose(overrides: Sequence[str], resolve: bool, job_name: Optional[str]) -> Tuple[DictConfig, Optional[str]]:
    overrides = normalize_overrides(overrides)
    parsed = parse_overrides(overrides)
    check_group_choices(parsed)
    if any(o.is_sweep_override() for o in parsed):
        raise ConfigError(next(o.key_or_group for o in parsed if o.is_sweep_override()),
                          "a sweep (a,b,c) needs multirun", hint="add -m to run one job per value")
    run_dir = None
    try:
        cfg = _hydra_compose(overrides, job_name)
        check_missing(cfg, overrides)
        if job_name is not None:
            check_callbacks(cfg, overrides)
            run_dir = _run_dir_of(cfg)
            from omegaconf import open_dict

            with open_dict(cfg):
                del cfg["hydra"]
        check_additions(cfg, parsed)
        if resolve:
            resolve_in_place(cfg)
    except ConfigError:
        raise
    except Exception as e:  # every hydra/omegaconf failure becomes one clear block
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise _translate(e, overrides) from None
    return cfg, run_dir


def check_sweep(overrides: Sequence[str]) -> None:
    """Before a multirun starts: every swept value must compose (typos stop the whole sweep, nothing runs)."""
    parsed = parse_overrides(normalize_overrides(overrides))
    check_group_choices(parsed)
    for variant in single_overrides(parsed):
        _compose(variant, True, "plan")  # the hydra node kept: its callbacks are checked
    check_sweep_dir(single_overrides(parsed)[0])


def check_sweep_dir(overrides: Sequence[str]) -> None:
    """The sweep directory (`hydra.sweep.dir`, by default under trainer.output_root) can be made here: Hydra makes
    it before the first job, and a file or a read-only directory in its way would end the sweep in a traceback."""
    from hydra.core.hydra_config import HydraConfig

    from qwen35rl.config.paths import unwritable_dir

    cfg = _hydra_compose(overrides, "plan")
    holder = HydraConfig.instance()
    before = holder.cfg
    try:
        holder.set_config(cfg)
        where = str(OmegaConf.select(cfg, "hydra.sweep.dir"))
    except Exception:  # a pattern that does not resolve before the sweep: Hydra reports it
        return
    finally:
        holder.cfg = before
    why = unwritable_dir(where)
    if why:
        given = any(o.lstrip("+").startswith("hydra.sweep.dir=") for o in overrides)
        key = "hydra.sweep.dir" if given else "trainer.output_root"
        raise ConfigError(key, f"the sweep directory {where} cannot be made: {why}", value=where,
                          hint=f"set {key} to a directory you can write", code="sweep_dir_unwritable")
