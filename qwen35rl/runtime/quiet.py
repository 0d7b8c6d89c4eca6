"""Library warnings known to be irrelevant to a run, kept off its console.

On a CPU, transformers' Qwen3.5 layers say for each Gated DeltaNet / causal-conv1d kernel that they fall back to
their reference PyTorch implementation because flash-linear-attention / causal_conv1d is not installed. Those are
GPU kernels: on a CPU the reference code is the only one there is, so the six warnings (two per worker and kernel)
say nothing. The driver notes the fact once in train.log instead (`note_for_log`). On GPUs and NPUs the warnings
stay: there the missing package is a real slowdown. Stdlib only: every worker imports it.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Any, Optional

KERNEL_LOGGER = "transformers.integrations.hub_kernels"
_FALLBACK = "is falling back to its reference PyTorch implementation"
_KERNEL_PACKAGES = (("fla", "flash-linear-attention"), ("causal_conv1d", "causal_conv1d"))


class _DropKernelFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FALLBACK not in record.getMessage()


_FILTER = _DropKernelFallback()


def quiet_known_warnings(device: Optional[str]) -> bool:
    """In this process, drop the kernel fallback warnings when the run's device is the CPU; returns whether it
    did."""
    if str(device) != "cpu":
        return False
    logger = logging.getLogger(KERNEL_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return True


def note_for_log(device: Any) -> Optional[str]:
    """The one line train.log gets instead of the warnings (None when none are silenced)."""
    if str(device) != "cpu":
        return None
    missing = [dist for module, dist in _KERNEL_PACKAGES if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (f"CPU run: transformers runs the Gated DeltaNet and causal-conv1d layers in its reference PyTorch code "
            f"({' and '.join(missing)} are GPU kernels, not installed); its 'falling back to its reference PyTorch "
            "implementation' warnings are not shown")
