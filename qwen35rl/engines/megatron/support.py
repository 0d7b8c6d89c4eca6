"""What this engine builds of a run on the stack it finds, checked once at construction.

Refusals and accepted-but-not-applied settings come from the declaration the plan reads (`config.capabilities`):
the engine refuses with the plan's problem code and message and logs the plan's warnings, so the two cannot
disagree. What is left here is what only this process can see: the installed megatron-core version, whether the
Transformer Engine kernels an option calls import, and whether flash-linear-attention is there on a GPU.

The layer specs are megatron-core's local ones whether or not Transformer Engine is installed (the specs' norms,
attention and GDN modules are this package's; see `model.py`), so of the TE options:
- `moe_grouped_gemm` is never applied: experts are a SequentialMLP (the declaration says so).
- `moe_permute_fusion` is the token dispatcher's, independent of the specs: applied when Transformer Engine is
  installed and megatron-core finds its fused permutation kernels (TE >= 2.1; TransformerConfig raises otherwise).
- `use_precision_aware_optimizer` would give TE's FusedAdam master weights, parameter remainders and decoupled
  gradients, a state the checkpoint and offload code here do not read: never applied (the declaration says so).
  Without it megatron-core still uses TE's FusedAdam wherever TE imports (plain AdamW math; its step count lives in
  the param groups, which `optimizer.optimizer_tensors` saves).
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch

from qwen35rl.config import capabilities
from qwen35rl.config import megatron_versions as versions
from qwen35rl.config.layout import Layout
from qwen35rl.engines.megatron.cpu import FLA_STANDIN

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TeOptions:
    """The Transformer Engine options as they apply on this rank."""

    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False
    use_precision_aware_optimizer: bool = False


def check_stack(cfg: Any, layout: Layout, device: torch.device) -> TeOptions:
    """Raise `capabilities.Unsupported` (or ImportError naming the install) for what this run cannot build here;
    log a warning for each setting accepted but not applied; return the TE options that apply."""
    stack = capabilities.Stack.installed(device.type)
    not_applied = capabilities.check_engine(cfg, layout, stack)
    for p in not_applied:
        log.warning("%s [%s]", p.message, p.code)  # the plan's own wording
    skipped = {p.key for p in not_applied}
    caps = versions.capabilities()
    caps.check_layout(cp=layout.cp, packed=False, tp=layout.tp, ep=layout.ep, etp=layout.etp, moe=cfg.model.moe)
    _import_megatron()
    if device.type == "cuda" and not has_fla():  # (Ascend: MindSpeed's GDN kernels, chosen by the platform)
        from qwen35rl.engines.megatron.cpu import fla_standins

        fla_standins()
        log.warning("flash-linear-attention is not installed: the Gated DeltaNet layers train with megatron-core's "
                    "torch recurrence (deterministic_mode; slower, more activation memory than the plan assumed). "
                    "pip install flash-linear-attention for its kernels (Hopper: see the GPU notes in the README)")

    b = cfg.backend
    permute = (cfg.model.moe and b.moe_permute_fusion and stack.transformer_engine
               and "backend.moe_permute_fusion" not in skipped)
    if permute and not _fused_permutation():
        log.warning("backend.moe_permute_fusion=true is accepted but not applied: this Transformer Engine lacks the "
                    "fused permutation kernels megatron-core calls (TE >= 2.1); the unfused permutation runs")
        permute = False
    return TeOptions(moe_permute_fusion=bool(permute))  # grouped GEMM and the precision-aware optimizer: never


def has_fla() -> bool:
    """flash-linear-attention itself is installed (not the stand-ins `cpu.fla_standins` put in its place)."""
    import sys

    module = sys.modules.get("fla")
    if module is not None:
        return getattr(module.__spec__, "origin", None) != FLA_STANDIN
    return importlib.util.find_spec("fla") is not None


def _import_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError(f"backend=megatron needs megatron-core: {versions.INSTALL_HINT} ({e})") from e


def _fused_permutation() -> bool:
    """Whether megatron-core's MoE utilities found Transformer Engine's fused permutation kernels (the check
    TransformerConfig makes for moe_permute_fusion)."""
    from megatron.core.transformer.moe import moe_utils

    names = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
             "fused_sort_chunks_by_index_with_probs", "fused_unpermute")
    return all(getattr(moe_utils, n, None) is not None for n in names)
