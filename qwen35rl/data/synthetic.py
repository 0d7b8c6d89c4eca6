"""Prompts generated in code for tasks a randomly initialised tiny model learns by RL from scratch.

Tasks work on text, so they hold for any tokenizer. Each reward is deterministic and gives partial credit, so random
samples of an untrained model already score above 0 and GRPO groups have spread from the first step:
  1.0  the first non-space character of the response is the target digit
  0.3  the target digit appears somewhere in the response
  0.1  the response contains some digit
  0.0  otherwise
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

NUM_DIGITS = 3


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    description: str
    target: Callable[[List[int]], int]
    """Target digit from the prompt's digits."""


TASKS: Dict[str, SyntheticTask] = {
    task.name: task
    for task in (
        SyntheticTask("copy_digit", "repeat the last digit (\"7 3 9\" -> 9)", lambda d: d[-1]),
        SyntheticTask("sum_digits", "sum of the digits mod 10 (\"7 3 9\" -> 9)", lambda d: sum(d) % 10),
    )
}


def get_task(name: str) -> SyntheticTask:
    if name not in TASKS:
        raise ValueError(f"data.synthetic_task={name!r}: expected one of {', '.join(TASKS)}")
    return TASKS[name]


def make_prompts(task_name: str, count: int, seed: int) -> List[Tuple[str, str]]:
    """`count` (prompt text, answer) pairs drawn with `seed`: the digits separated by spaces ("7 3 9").

    The prompt ends with its last digit, so the first response token is written at the position that reads it:
    with a trailing " =" (the digit two tokens back) most seeds of the embedded default settled on writing one digit
    for every prompt (bench/results/seeds_cpu.md)."""
    task = get_task(task_name)
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        digits = [rng.randrange(10) for _ in range(NUM_DIGITS)]
        pairs.append((" ".join(map(str, digits)), str(task.target(digits))))
    return pairs


def digit_reward(response_text: str, answer: str, example=None) -> float:
    """Reward of every synthetic task (see the module docstring)."""
    stripped = response_text.lstrip()
    if stripped[:1] == answer:
        return 1.0
    if answer in response_text:
        return 0.3
    if any(ch.isdigit() for ch in response_text):
        return 0.1
    return 0.0
