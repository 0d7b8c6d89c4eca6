"""Which Gated DeltaNet kernels a GPU node can train with: flash-linear-attention (fla) or the torch fallbacks.

fla 0.6's gated chunk backward (dq/dk/dw/dg) is miscompiled by Triton 3.4.0 up to 3.7.1 on Hopper, so fla raises
there unless its TileLang backend takes that kernel (fla issue #640). The trainers react differently: megatron-core
can switch to its own torch recurrence (`engines/megatron/build.py`), transformers' modules pick fla whenever it
imports and then fail in the first backward, after the first generation. The preflight probes every node with
`probe()` and refuses such an FSDP run before it starts (`runtime/preflight.py`).

Imports nothing heavy at module level: the preflight probe runs it in a fresh Ray task.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, Optional, Tuple

FLA_HOPPER_BAD_TRITON = ((3, 4, 0), (3, 7, 1))
"""Triton versions [from, to) that miscompile fla's gated chunk backward on Hopper (fla issue #640)."""


def fla_gdn_backward_refused(capability: Optional[Tuple[int, int]], triton_version: Optional[str],
                             tilelang_usable: bool) -> bool:
    """Whether flash-linear-attention's chunked GDN backward refuses this GPU: a Hopper (compute capability 9.x)
    with Triton in FLA_HOPPER_BAD_TRITON, and no usable TileLang to run the kernel instead."""
    from qwen35rl.config.quirks import version_tuple

    if capability is None or capability[0] != 9 or triton_version is None or tilelang_usable:
        return False
    low, high = FLA_HOPPER_BAD_TRITON
    return low <= version_tuple(triton_version) < high


def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def fla_tilelang_usable() -> bool:
    """What fla's backend dispatch checks before handing a kernel to TileLang: the package imports, nvcc is there
    for its JIT, and neither FLA_TILELANG=0 nor FLA_DISABLE_BACKEND_DISPATCH=1 switches it off."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1" or os.environ.get("FLA_TILELANG") == "0":
        return False
    if importlib.util.find_spec("tilelang") is None:
        return False
    try:
        from fla.utils import has_usable_nvcc
    except ImportError:  # an fla without the nvcc check
        return True
    return bool(has_usable_nvcc())


def fla_version() -> Optional[str]:
    """The installed flash-linear-attention (None without it: transformers then runs its torch GDN code)."""
    if importlib.util.find_spec("fla") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("flash-linear-attention", "fla-core"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def probe(device_index: int = 0) -> Dict[str, Any]:
    """This node's GDN kernel facts for a CUDA device: fla and Triton versions, compute capability, whether TileLang
    can take fla's kernels, and whether fla's backward refuses the device."""
    import torch

    capability = tuple(torch.cuda.get_device_capability(device_index)) if torch.cuda.is_available() else None
    fla, triton = fla_version(), triton_version()
    tilelang = fla is not None and fla_tilelang_usable()
    return {"fla": fla, "triton": triton, "capability": list(capability) if capability else None,
            "tilelang_usable": tilelang,
            "fla_backward_refused": fla is not None and fla_gdn_backward_refused(capability, triton, tilelang)}
