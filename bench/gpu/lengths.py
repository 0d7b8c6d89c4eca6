"""The realistic response-length workload: every response of a generation ends at a length drawn from a fixed,
seeded distribution, the same on every side of a comparison.

Log-normal with its median at 35% of the cap and sigma 0.8, clipped to [1, cap]: ~10% of the responses run to the
cap (ln(1 / 0.35) / 0.8 = 1.31 sigma), the rest spread below it, as RL responses do once a policy learns to stop.
A random-init policy almost never samples its end token, so without this every response is at the cap and there is
no padding for packing or token-budget micro batches to remove. `shape` cuts a response to its drawn length and
ends it with the end token; the row order of a generation (prompt-major, n samples each) picks the lengths, so two
engines given the same prompts in the same order train on identical token counts.
"""
from __future__ import annotations

import math
import random
from typing import List, Sequence

MEDIAN_FRACTION, SIGMA = 0.35, 0.8


def response_lengths(rows: int, cap: int, call: int, seed: int = 1234) -> List[int]:
    """Lengths of the `rows` responses of generation number `call` (0, 1, ...)."""
    rng = random.Random(seed * 1_000_003 + call)
    mu = math.log(MEDIAN_FRACTION * cap)
    return [max(1, min(cap, int(round(math.exp(rng.gauss(mu, SIGMA)))))) for _ in range(rows)]


def shape(responses: Sequence[Sequence[int]], lengths: Sequence[int], eos: int) -> List[List[int]]:
    """Each response cut to its length, its last token the end token (an end token sampled before that becomes
    the id below it, so every response ends exactly at its drawn length). A response shorter than its length (it
    ended on its own) keeps its own end."""
    out = []
    for ids, n in zip(responses, lengths):
        ids = list(ids)
        if len(ids) < n:
            out.append(ids)
            continue
        body = [t if t != eos else max(eos - 1, 0) for t in ids[:n - 1]]
        out.append(body + [eos])
    return out
