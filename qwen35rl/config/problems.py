"""A config problem: what every validation rule returns and every front end (text, JSON, sweeps) prints."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List

ERROR = "error"
WARNING = "warning"
from qwen35rl.exit_codes import EXIT_CONFIG  # noqa: E402,F401 - the table of exit codes lives there


@dataclass(frozen=True)
class Problem:
    code: str
    """Stable identifier of the rule, e.g. `tp_divides_attention_heads`."""
    key: str
    """The config key to change, e.g. `parallelism.tp`."""
    message: str
    """One line with the numbers."""
    hint: str = ""
    """A valid alternative, e.g. `try parallelism.tp=4`."""
    severity: str = ERROR

    def to_dict(self) -> Dict[str, Any]:
        from qwen35rl.config.redact import redact_urls

        return redact_urls(asdict(self))  # a message may quote an address with its password

    def render(self) -> str:
        from qwen35rl.config.redact import redact_url

        head = f"{self.severity}: [{self.code}] {self.key}: {self.message}"
        return redact_url(head + (f"\n  hint: {self.hint}" if self.hint else ""))


def errors(problems: List[Problem]) -> List[Problem]:
    return [p for p in problems if p.severity == ERROR]
