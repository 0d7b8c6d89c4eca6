"""The forward-only (log-prob) passes against the device's memory: `backend.log_prob_micro_batch_size_per_device`
(or, with `dynamic_batch_size`, `backend.log_prob_max_tokens_per_device`) too large for what the trainer keeps on
the device is refused before launch, naming the largest value that fits. Only the pass's working set depends on the
value (`memory.log_prob_activations_gib`), so the search re-estimates that term alone. Torch-free."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from qwen35rl.config import memory
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import ERROR, Problem

MICRO, TOKENS = "backend.log_prob_micro_batch_size_per_device", "backend.log_prob_max_tokens_per_device"


def setting(tree: Any) -> Tuple[str, int]:
    """(the key that sizes a log-prob micro batch, its effective value: null is the training value)."""
    b = memory.log_prob_tree(tree)["backend"]
    if b["dynamic_batch_size"]:
        return TOKENS, int(b["max_tokens_per_device"])
    return MICRO, int(b["micro_batch_size_per_device"])


def _peak_with(tree: Any, layout: Layout, est: memory.MemoryEstimate, key: str, value: int) -> float:
    backend = {**tree["backend"], key.split(".", 1)[1]: value}
    other = {**tree, "backend": backend}
    act = memory.log_prob_activations_gib(other, layout, memory.train_shard(tree, layout))
    return est.log_prob_peak_gib - est.terms["log_prob/activations"] + act


def largest_fitting(tree: Any, layout: Layout, est: memory.MemoryEstimate) -> Optional[int]:
    """The largest log-prob micro batch (token budget: from one whole sequence up) below the current one whose
    peak fits, or None when not even the smallest does. The working set grows with the value: bisection."""
    key, now = setting(tree)
    low = 1 if key == MICRO else memory.sequence_length(tree)
    if low >= now or _peak_with(tree, layout, est, key, low) > est.capacity_gib:
        return None
    lo, hi = low, now - 1  # lo fits; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _peak_with(tree, layout, est, key, mid) <= est.capacity_gib:
            lo = mid
        else:
            hi = mid - 1
    return lo


def problems(cfg: Any, layout: Layout, est: memory.MemoryEstimate) -> List[Problem]:
    """The log-prob phase's peak fits the device, or one error naming the key and the value that fits."""
    if est.log_prob_peak_gib <= est.capacity_gib:
        return []
    tree = memory.as_tree(cfg)
    key, now = setting(tree)
    unit = "tokens" if key == TOKENS else "responses"
    what = (f"the forward-only log-prob passes (old and reference log-probs) need {est.log_prob_peak_gib:.1f} GiB "
            f"per device (their activations {est.terms['log_prob/activations']:.1f} GiB for micro batches of {now} "
            f"{unit}) but {est.capacity_gib:.1f} GiB are usable")
    fit = largest_fitting(tree, layout, est)
    if fit is not None:
        hint = f"try {key}={fit} (the largest that fits)"
    else:
        hint = ("the trainer's states alone leave no room for one log-prob micro batch: lower the training memory "
                "(offload, more parallelism, or more devices)")
    return [Problem("log_prob_memory_fits", key, what, hint, ERROR)]
