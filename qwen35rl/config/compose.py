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
# Groups every run has (the defaults list of conf/config.yaml picks one): `~group` cannot delete them.
REQUIRED_GROUPS = ("model", "hw", "backend", "rollout", "algorithm", "data")
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


def _group_of(key: str) -> Optional[str]:
    return key if key in GROUPS else None


def check_group_choices(parsed) -> None:
    """Unknown group options fail here with the list of options and a did-you-mean."""
    for o in parsed:
        group = _group_of(o.key_or_group)
        if group in REQUIRED_GROUPS and o.is_delete():
            raise ConfigError(group, f"'{o.input_line}' deletes the required group '{group}'", value=o.input_line,
                              allowed=available_options(group),
                              hint=f"choose another option instead: {group}=<option>", code="required_group_deleted")
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
            base = _hydra_compose([o for o in overrides if o.split("=", 1)[0] in GROUPS])
            allowed, top = _keys_at(base, parent), _keys_at(base, "")
        except Exception:  # the suggestion is a courtesy; the error itself stands
            allowed, top = [], []
        head, _, rest = full_key.partition(".")
        if rest and top and head not in top:  # the first part is the typo: suggest the group
            close = difflib.get_close_matches(head, top, n=3, cutoff=0.6)
            hint = (f"did you mean {' or '.join(c + '.' + rest for c in close)}?" if close else
                    f"'{head}' is not a top-level key; see them with: qwen35rl-plan --cfg job")
            return ConfigError(full_key, f"unknown top-level key '{head}'", value=value, allowed=top, hint=hint,
                               code="unknown_key")
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
