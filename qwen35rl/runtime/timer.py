"""Wall time per named part: the GRPO step's phases, a worker's engine builds and the parts of its generation."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator


class Timer:
    """Accumulates wall time per name (dynamic sampling generates several times per step)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def metrics(self) -> Dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}
