"""Credentials stay out of what a run prints and keeps (plan output, logs, provenance): the one rule.

A value is secret when its name contains SECRET, PASSWORD, PASSWD or CREDENTIAL (any case), is one of the known
tracker / hub credentials (`SECRET_NAMES`, any case), or
  - for an environment variable (an upper-case name, as in hw.env / backend.env): ends in _TOKEN or _KEY;
  - for a config key (the last part of a dotted key, lower case): is `token`, or ends in api/access/auth/secret/
    private + _key or _token. Ordinary config keys such as data.prompt_key or a tokenizer's pad_token stay visible.
A secret value is shown as `REDACTED`. In any other value, a URL's password (`scheme://user:password@host`) is
replaced the same way (in a plan, `redact_urls`, whatever the key). Text (a log line, a file) is scrubbed of the
secret values themselves (`scrub`), wherever they appear.

Stdlib only: the plan imports it.
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping, Optional, Set

REDACTED = "REDACTED"
SECRET_NAMES = frozenset({
    "WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_TOKEN", "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "WANDB_PASSWORD", "NEPTUNE_API_TOKEN", "COMET_API_KEY", "GITHUB_TOKEN", "OPENAI_API_KEY"})
_SECRET_ANY = re.compile(r"SECRET|PASSWORD|PASSWD|CREDENTIAL")
_SECRET_ENV = re.compile(r"(^|_)(TOKEN|KEY)$")
_SECRET_CONFIG = re.compile(r"^TOKEN$|(^|_)(API|ACCESS|AUTH|SECRET|PRIVATE)_(KEY|TOKEN)$")
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<pw>[^/\s@]+)(?P<at>@)")
_MIN_SCRUB_LEN = 4
"""Secret values shorter than this are not scrubbed from text (they would blank out ordinary words)."""


def is_secret_name(name: Any) -> bool:
    raw = re.sub(r"-", "_", str(name).rsplit(".", 1)[-1])
    key = raw.upper()
    if key in SECRET_NAMES or _SECRET_ANY.search(key):
        return True
    return bool((_SECRET_ENV if raw.isupper() else _SECRET_CONFIG).search(key))


def redact_url(value: str) -> str:
    """`scheme://user:password@host...` with the password replaced; other text unchanged."""
    return _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED + m.group("at"), value)


def redact_urls(obj: Any) -> Any:
    """A copy of `obj` (a plan: dicts and lists of plain values) with a URL's password replaced in every string,
    whatever its key: a plan prints values of any key (an address, a path, a problem's message)."""
    if isinstance(obj, Mapping):
        return {k: redact_urls(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_urls(v) for v in obj)
    return redact_url(obj) if isinstance(obj, str) else obj


def redact_value(name: Any, value: Any) -> Any:
    if value is None or value == "":
        return value
    if is_secret_name(name):
        return REDACTED
    return redact_url(value) if isinstance(value, str) else value


def redact(obj: Any, name: Any = "") -> Any:
    """A copy of `obj` (dicts and lists of plain values, e.g. an env dict or a config as a container) with every
    secret value redacted."""
    if isinstance(obj, Mapping):
        return {k: redact(v, k) if isinstance(v, (Mapping, list, tuple)) else redact_value(k, v)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, name) for v in obj)
    return redact_value(name, obj)


def secret_values(*sources: Any, environ: Optional[Mapping[str, str]] = None) -> Set[str]:
    """The secret values in `sources` (nested dicts/lists) and in the environment (os.environ by default)."""
    found: Set[str] = set()

    def walk(obj: Any, name: Any = "") -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, k)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, name)
        elif isinstance(obj, str):
            if is_secret_name(name):
                found.add(obj)
            for m in _URL_PASSWORD.finditer(obj):
                found.add(m.group("pw"))

    for source in sources:
        walk(source)
    walk(dict(os.environ if environ is None else environ))
    return {v for v in found if len(v) >= _MIN_SCRUB_LEN}


def scrub(text: str, values: Iterable[str]) -> str:
    """`text` with every occurrence of the secret `values` (and any URL password) replaced."""
    for v in sorted(values, key=len, reverse=True):
        text = text.replace(v, REDACTED)
    return redact_url(text)


_YAML_ENTRY = re.compile(r"^(?P<head>\s*(?:- )?(?P<key>[^\s:#'\"][^:]*?|'[^']*'|\"[^\"]*\"):[ \t]+)(?P<value>\S.*)$")


def redact_yaml(text: str, values: Iterable[str] = ()) -> str:
    """YAML text (OmegaConf.to_yaml, Hydra's --cfg output) with the value of every secret-looking key shown as
    REDACTED, and the secret `values` scrubbed wherever else they appear."""
    out = []
    for line in text.split("\n"):
        m = _YAML_ENTRY.match(line)
        if m and is_secret_name(m.group("key").strip("'\"")) and m.group("value") not in ("null", "''", '""'):
            line = m.group("head") + REDACTED
        out.append(line)
    return scrub("\n".join(out), values)
