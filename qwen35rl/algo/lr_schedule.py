"""The learning-rate schedule both train engines follow: the factor of `backend.lr` at each optimizer step."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional


def lr_lambda(warmup: int, scheduler: str, total_steps: Optional[int], min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup over `warmup` optimizer steps (step k uses (k+1)/warmup), then constant or cosine down to
    min_lr_ratio at `total_steps`."""
    if scheduler not in ("constant", "cosine"):
        raise ValueError(f"backend.lr_scheduler={scheduler!r}: expected constant or cosine")
    if scheduler == "cosine" and not total_steps:
        raise ValueError("backend.lr_scheduler=cosine needs the total number of optimizer steps")

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def from_backend(backend: Any, total_steps: Optional[int]) -> Callable[[int], float]:
    """The schedule `backend.lr_warmup_steps` / `lr_scheduler` / `min_lr_ratio` name, over a run of `total_steps`
    optimizer steps (the cosine needs them)."""
    return lr_lambda(backend.lr_warmup_steps, backend.lr_scheduler, total_steps, backend.min_lr_ratio)
