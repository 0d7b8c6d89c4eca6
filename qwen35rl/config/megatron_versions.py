"""megatron-core version facts the Megatron backend relies on, in one place (checked against the 0.16.1, 0.17.0,
0.18.0 and 0.19.2 sources). Standard library only: the planning rules and the Megatron engine both read it.

What changes across 0.16 - 0.19 and how the backend copes:
- GDN (GatedDeltaNet) accepts packed (THD) sequences and context parallelism from 0.18 (`GDN_PACKED_AND_CP`);
  before, it raises NotImplementedError for packed sequences and TransformerConfig asserts
  `context_parallel_size == 1` for `gated_delta_net` (0.16.1, 0.17.1): batches must be padded (right padding) and
  CP = 1. From 0.18.0 (NVIDIA/Megatron-LM PR #2642) GDN runs CP by an all-to-all from sequence shards to head shards
  and back; 0.18.x's GatedDeltaNet does not take the `cp_comm_type` argument TransformerLayer passes it when
  `TransformerConfig.cp_comm_type` is set (0.19 accepts and ignores it). Checked in the 0.16.1, 0.17.1, 0.18.0,
  0.18.2, 0.19.0 and 0.19.2 wheels.
- `megatron.core.ssm.gated_delta_net` is a module up to 0.18 and a package in 0.19; the import path is the same.
- TransformerLayer builds its norms with `build_module(spec, ...)` in 0.16 and calls them as builders from 0.17;
  MLP / MoE submodules became builder callables too. The backend starts from megatron's own
  `get_gpt_layer_local_spec` (right for each version) and swaps in norm *classes*, which both styles accept.
- The legacy (non-TE) GroupedMLP is gone from 0.17: without Transformer Engine experts are a SequentialMLP.
- Up to 0.18, expert weights with EP = 1 and ETP != TP get wrong gradients (`EXPERT_GROUPS_WITHOUT_EP`): refused.
- In every version, the local DotProductAttention takes neither packed sequences nor CP > 1, and the
  TE-only features (grouped GEMM, permute fusion, precision-aware optimizer, THD attention) need Transformer Engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from qwen35rl.config.quirks import version_tuple

MIN_SUPPORTED: Tuple[int, int] = (0, 16)
"""Oldest megatron-core the backend targets (what Ascend / MindSpeed users pin)."""
GDN_PACKED_AND_CP: Tuple[int, int] = (0, 18)
"""First megatron-core whose GDN takes packed (THD) sequences and context parallel > 1."""
EXPERT_GROUPS_WITHOUT_EP: Tuple[int, int] = (0, 19)
"""First megatron-core that reduces expert gradients over the expert groups when EP = 1 but ETP != TP. Before,
such experts reduce like dense weights, over data parallel only, and miss the sum over the TP ranks (which route
different tokens under sequence parallelism): gradients come out wrong."""
LAYER_BUILDERS: Tuple[int, int] = (0, 17)
"""First megatron-core whose TransformerLayer calls norm / MLP builders instead of build_module(spec)."""

INSTALL_HINT = "pip install 'qwen35rl[gpu]'"


def installed() -> Optional[str]:
    """The installed megatron-core version, or None."""
    from importlib import metadata

    for dist in ("megatron-core", "megatron_core"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:  # a source checkout on PYTHONPATH (MindSpeed setups often use one)
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:
        return None


@dataclass(frozen=True)
class Capabilities:
    """What a megatron-core version (plus Transformer Engine or not) can do for Qwen3.5."""

    version: Tuple[int, ...]
    has_te: bool

    @property
    def gdn_packed_sequences(self) -> bool:
        return self.version >= GDN_PACKED_AND_CP

    @property
    def gdn_context_parallel(self) -> bool:
        return self.version >= GDN_PACKED_AND_CP

    @property
    def packed_sequences(self) -> bool:
        """THD input end to end: GDN support and an attention kernel that takes it (TE; local attention cannot)."""
        return self.gdn_packed_sequences and self.has_te

    @property
    def context_parallel(self) -> bool:
        return self.gdn_context_parallel and self.has_te

    @property
    def expert_groups_without_ep(self) -> bool:
        return self.version >= EXPERT_GROUPS_WITHOUT_EP

    def check_layout(self, cp: int, packed: bool, tp: int = 1, ep: int = 1, etp: int = 1, moe: bool = False) -> None:
        """Raise with the reason when the run asks for what this stack cannot do."""
        name = ".".join(map(str, self.version))
        if moe and ep == 1 and etp != tp and not self.expert_groups_without_ep:
            raise RuntimeError(f"parallelism.ep=1 with etp={etp} != tp={tp}: megatron-core {name} reduces expert "
                               f"gradients like dense ones then and misses the sum over TP ranks (fixed in "
                               f"{'.'.join(map(str, EXPERT_GROUPS_WITHOUT_EP))}); set parallelism.etp={tp} or ep > 1")
        if cp > 1 and not self.gdn_context_parallel:
            raise RuntimeError(f"parallelism.cp={cp}: megatron-core {name}'s Gated DeltaNet has no context "
                               f"parallelism (its TransformerConfig asserts CP == 1 for gated_delta_net; GDN runs CP "
                               f"from {'.'.join(map(str, GDN_PACKED_AND_CP))}.0)")
        if cp > 1 and not self.has_te:
            raise RuntimeError(f"parallelism.cp={cp} needs Transformer Engine attention (the local attention has no CP)")
        if packed and not self.gdn_packed_sequences:
            raise RuntimeError(f"packed sequences (backend.remove_padding) need megatron-core >= "
                               f"{'.'.join(map(str, GDN_PACKED_AND_CP))} for GDN (installed {name}): use padded batches")
        if packed and not self.has_te:
            raise RuntimeError("packed sequences (backend.remove_padding) need Transformer Engine attention")


def te_available() -> bool:
    from importlib.util import find_spec

    return find_spec("transformer_engine") is not None


def capabilities(version: Optional[str] = None, has_te: Optional[bool] = None) -> Capabilities:
    """Capabilities of `version` (default: the installed megatron-core; an ImportError naming the install when
    there is none)."""
    text = version if version is not None else installed()
    if text is None:
        raise ImportError(f"backend=megatron needs megatron-core (>= {'.'.join(map(str, MIN_SUPPORTED))}): {INSTALL_HINT}")
    parsed = version_tuple(text)
    if parsed[:2] < MIN_SUPPORTED:
        raise ImportError(f"megatron-core {text} is older than {'.'.join(map(str, MIN_SUPPORTED))}, the oldest the "
                          f"Qwen3.5 backend supports (GDN layers): {INSTALL_HINT}")
    return Capabilities(parsed, te_available() if has_te is None else has_te)
