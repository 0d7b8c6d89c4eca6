"""Built-in reward functions: `fn(response_text, answer, example) -> float`.

They never time out on their own; `scoring.score_responses` enforces the time limit by killing the worker process,
which is why math-verify runs here with its signal-based timeouts off (signals only work on a main thread).
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K_ANSWER = "####"
_NUMBER_WITH_COMMAS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def _normalize(text: str) -> str:
    return " ".join(text.strip().rstrip(".").split()).casefold()


def _gold(answer: str) -> str:
    """The final answer of a ground-truth string: GSM8K's `... #### 1,000` gives 1000; a boxed answer its content."""
    if _GSM8K_ANSWER in answer:
        answer = answer.rsplit(_GSM8K_ANSWER, 1)[1]
    boxed = extract_boxed(answer)
    return _strip_thousands((boxed if boxed is not None else answer).strip())


def _strip_thousands(text: str) -> str:
    return text.replace(",", "") if _NUMBER_WITH_COMMAS.fullmatch(text) else text


def exact_match(response_text: str, answer: str, example: Any = None) -> float:
    """1.0 when the final answer (the last \\boxed{} content, else the whole response) equals the ground truth up
    to surrounding whitespace, a trailing period and case."""
    boxed = extract_boxed(response_text)
    predicted = boxed if boxed is not None else response_text
    return float(_normalize(predicted) == _normalize(_gold(answer)))


def format_reward(response_text: str, answer: str = "", example: Any = None) -> float:
    """1.0 when the response ends its reasoning properly: a non-empty \\boxed{} answer, and any <think> block
    closed before it."""
    boxed = extract_boxed(response_text)
    if not boxed:
        return 0.0
    if "<think>" in response_text:
        close = response_text.find("</think>")
        if close < 0 or close > response_text.rfind("\\boxed"):
            return 0.0
    return 1.0


def math_reward(response_text: str, answer: str, example: Any = None) -> float:
    """1.0 when the last \\boxed{} answer of the response is mathematically equal to the ground truth
    (math-verify: numbers, fractions, radicals, expressions, sets); 0.0 without a boxed answer."""
    predicted = extract_boxed(response_text)
    if not predicted:
        return 0.0
    predicted, gold = _strip_thousands(predicted), _gold(answer)
    if _normalize(predicted) == _normalize(gold):
        return 1.0
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: we kill instead
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${predicted}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return 0.0
    return float(verify(gold_parsed, pred_parsed, timeout_seconds=None))
