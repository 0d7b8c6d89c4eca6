"""megatron-core on Ascend NPUs: MindSpeed patches megatron-core for torch_npu, so it must be imported (and told
which features to switch on) before anything imports megatron.

`hw.megatron_quirks` (conf/platform/npu.yaml) states what the platform needs; `quirk_settings` sorts each quirk into
where it takes effect:
- MindSpeed features, passed to `mindspeed.megatron_adaptor.repatch`: `use_flash_attn` (its fused attention replaces
  megatron's DotProductAttention, so the model keeps that class as core attention), `gdn_naive_l2norm` (MindSpeed's
  `use_naive_l2norm`: GDN's q/k L2 norm in plain torch ops instead of the fla kernel),
  `moe_token_dispatcher_type`; and any other MindSpeed switch `hw.mindspeed` names (passed as it is).
- TransformerConfig fields: `moe_token_dispatcher_type`; `use_ascend_gdn_kernels` false runs megatron-core's own
  torch GDN recurrence (`deterministic_mode`) instead of MindSpeed's Ascend GDN kernels.
- weight loading: `hf_bridge` (HF checkpoints go through `mapping`, the only loader; false is refused) and
  `strict_load` (every tensor of the text model must be in the checkpoint).
Torch-free at import: the mapping is tested on CPU, and the import error without the Ascend stack names it.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional

ASCEND_INSTALL_HINT = (
    "install the Ascend stack on every NPU node: CANN, torch_npu matching the installed torch, and MindSpeed "
    "(git clone https://gitcode.com/Ascend/MindSpeed && pip install -e MindSpeed) next to megatron-core")

KNOWN_QUIRKS = ("use_flash_attn", "moe_token_dispatcher_type", "gdn_naive_l2norm", "use_ascend_gdn_kernels",
                "hf_bridge", "strict_load")


@dataclass(frozen=True)
class AscendSettings:
    """hw.megatron_quirks sorted by where they apply."""

    mindspeed: Dict[str, Any] = field(default_factory=dict)
    """Feature switches for `mindspeed.megatron_adaptor.repatch`."""
    transformer: Dict[str, Any] = field(default_factory=dict)
    """TransformerConfig fields."""
    strict_load: bool = True
    megatron_core_attention: bool = False
    """Build full attention with megatron's DotProductAttention (what MindSpeed's flash attention patches)."""


def quirk_settings(quirks: Optional[Mapping[str, Any]]) -> AscendSettings:
    """Sort `hw.megatron_quirks` into MindSpeed features, TransformerConfig fields and loader flags."""
    quirks = dict(quirks or {})
    unknown = sorted(set(quirks) - set(KNOWN_QUIRKS))
    if unknown:
        raise ValueError(f"hw.megatron_quirks: unknown {unknown}; known: {', '.join(KNOWN_QUIRKS)}")
    mindspeed: Dict[str, Any] = {}
    transformer: Dict[str, Any] = {}
    if "use_flash_attn" in quirks:
        mindspeed["use_flash_attn"] = bool(quirks["use_flash_attn"])
    if "gdn_naive_l2norm" in quirks:
        mindspeed["use_naive_l2norm"] = bool(quirks["gdn_naive_l2norm"])
    if "moe_token_dispatcher_type" in quirks:
        dispatcher = str(quirks["moe_token_dispatcher_type"])
        if dispatcher not in ("alltoall", "allgather", "flex"):
            raise ValueError(f"hw.megatron_quirks.moe_token_dispatcher_type={dispatcher!r}: expected alltoall, allgather or flex")
        mindspeed["moe_token_dispatcher_type"] = transformer["moe_token_dispatcher_type"] = dispatcher
    if "use_ascend_gdn_kernels" in quirks:
        transformer["deterministic_mode"] = not bool(quirks["use_ascend_gdn_kernels"])
    if quirks.get("hf_bridge", True) is not True:
        raise ValueError("hw.megatron_quirks.hf_bridge=false: HF checkpoints always load through "
                         "qwen35rl.engines.megatron.mapping (there is no other loader)")
    return AscendSettings(mindspeed=mindspeed, transformer=transformer,
                          strict_load=bool(quirks.get("strict_load", True)),
                          megatron_core_attention=bool(mindspeed.get("use_flash_attn", False)))


def with_switches(settings: AscendSettings, switches: Optional[Mapping[str, Any]]) -> AscendSettings:
    """`settings` with `hw.mindspeed`'s feature switches added (they win over what the quirks derive)."""
    import dataclasses

    extra = {str(k): v for k, v in dict(switches or {}).items()}
    if not extra:
        return settings
    mindspeed = {**settings.mindspeed, **extra}
    return dataclasses.replace(settings, mindspeed=mindspeed,
                               megatron_core_attention=bool(mindspeed.get("use_flash_attn", False)))


def require_ascend_stack(find_spec: Callable[[str], Any] = importlib.util.find_spec) -> None:
    """ImportError naming what to install when torch_npu or MindSpeed is missing."""
    missing = [name for name in ("torch_npu", "mindspeed") if find_spec(name) is None]
    if missing:
        raise ImportError(f"hw.device=npu with backend=megatron needs {' and '.join(missing)}: {ASCEND_INSTALL_HINT}")


def adapt_megatron(settings: AscendSettings, parallel: Mapping[str, Any],
                   import_module: Callable[[str], Any] = importlib.import_module,
                   find_spec: Callable[[str], Any] = importlib.util.find_spec) -> None:
    """Import MindSpeed's megatron adaptor before megatron and switch on the platform's features.

    MindSpeed parses sys.argv when imported: it sees an empty command line here, and the features come through
    `repatch` instead, together with the parallel sizes (`parallel`: TransformerConfig-style names) that its
    patches of parallel_state read.
    """
    require_ascend_stack(find_spec)
    if "megatron.core" in sys.modules and "mindspeed.megatron_adaptor" not in sys.modules:
        raise RuntimeError("megatron.core was imported before MindSpeed: its NPU patches cannot apply; import "
                           "qwen35rl.engines.megatron.ascend.adapt_megatron first")
    argv = sys.argv[:]
    try:
        sys.argv[:] = sys.argv[:1]
        adaptor = import_module("mindspeed.megatron_adaptor")
    finally:
        sys.argv[:] = argv
    repatch = getattr(adaptor, "repatch", None)
    if repatch is None:
        raise ImportError(f"this MindSpeed has no megatron_adaptor.repatch (too old for megatron-core >= 0.16): "
                          f"{ASCEND_INSTALL_HINT}")
    repatch({**dict(parallel), **settings.mindspeed, "experimental_attention_variant": "gated_delta_net"})


def prepare_platform(hw: Any, parallel: Mapping[str, Any]) -> AscendSettings:
    """Called before megatron is imported: on an NPU, adapt megatron-core through MindSpeed (`parallel`: the
    run's parallel sizes under TransformerConfig names); elsewhere nothing (the quirks describe the NPU platform)."""
    if str(hw.device) != "npu":
        return AscendSettings()
    settings = with_switches(quirk_settings(hw.get("megatron_quirks")), hw.get("mindspeed"))
    adapt_megatron(settings, parallel)
    return settings
