"""This rank's model chunks from the run config: the TransformerConfig (recompute, MoE, platform and user
overrides, the GDN kernel choice), the chunks on the device, and the vision tower's training setup."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from qwen35rl.config.layout import Layout
from qwen35rl.engines.gdn_kernels import fla_gdn_backward_refused, fla_tilelang_usable, triton_version
from qwen35rl.engines.megatron import mapping as mp
from qwen35rl.engines.megatron.support import TeOptions, has_fla
from qwen35rl.engines.megatron.vision import build_vision_tower
from qwen35rl.models.build import build_model, enable_activation_checkpointing

log = logging.getLogger(__name__)


def param_dtype(backend: Any) -> torch.dtype:
    return torch.bfloat16 if backend.bf16 else torch.float32


@dataclass
class Built:
    """`meta`: the HF model on the meta device (its config, names and whole-model shapes, no memory);
    `chunk_layers[ci]`: the global decoder-layer ids of chunk ci."""

    tconfig: Any
    chunks: List[torch.nn.Module]
    chunk_layers: List[List[int]]
    meta: torch.nn.Module
    vision_names: List[str]


def gdn_fallback(overrides: Dict[str, Any], *, reference: bool, device: torch.device) -> None:
    """Where fla would refuse the GDN backward, the policy trains with megatron-core's torch GDN recurrence
    (`deterministic_mode`), unless backend.transformer_overrides (or the platform) chose. The frozen reference
    only runs forwards and keeps fla's kernels."""
    if reference or device.type != "cuda" or "deterministic_mode" in overrides:
        return
    capability = tuple(torch.cuda.get_device_capability(device))
    triton = triton_version()
    if fla_gdn_backward_refused(capability, triton, fla_tilelang_usable()):
        overrides["deterministic_mode"] = True
        log.warning("flash-linear-attention's chunked GDN backward refuses compute capability %d.%d with Triton "
                    "%s and no usable TileLang (fla issue #640): training with megatron-core's torch GDN "
                    "recurrence (deterministic_mode=True; slower, more activation memory). Install tilelang (and "
                    "nvcc) or Triton >= 3.7.1 for fla's kernels, or set backend.transformer_overrides."
                    "deterministic_mode to choose.", capability[0], capability[1], triton)


def transformer_config(cfg: Any, layout: Layout, shape: mp.Qwen35Shape, *, platform: Any, te: TeOptions,
                       device: torch.device, reference: bool, vision: bool):
    from qwen35rl.engines.megatron import model as mm

    b = cfg.backend
    recompute: Dict[str, Any] = {}
    if b.gradient_checkpointing and not reference and b.recompute_granularity:
        recompute = {"recompute_granularity": b.recompute_granularity}
        if b.recompute_granularity == "full":
            recompute.update(recompute_method=b.recompute_method, recompute_num_layers=b.recompute_num_layers)
    aux, z = b.moe_aux_loss_coeff, b.moe_z_loss_coeff
    moe = {"moe_token_dispatcher_type": b.moe_token_dispatcher_type,
           "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none", "moe_aux_loss_coeff": aux,
           "moe_z_loss_coeff": z if z > 0 else None,
           "moe_grouped_gemm": te.moe_grouped_gemm, "moe_permute_fusion": te.moe_permute_fusion}
    overrides = {**platform.transformer, **dict(b.transformer_overrides or {})}
    gdn_fallback(overrides, reference=reference, device=device)
    if device.type == "cpu":
        overrides.setdefault("use_cpu_initialization", True)
    if device.type == "cpu" or (device.type == "cuda" and not has_fla()):
        # megatron-core's torch GDN recurrence, the only one without fla (the declaration refuses an explicit false)
        overrides.setdefault("deterministic_mode", True)
    return mm.transformer_config(cfg.model, shape, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
                                 cp=layout.cp, vpp=layout.vpp or None,
                                 pipeline_layout=cfg.parallelism.pipeline_layout or None, dtype=param_dtype(b),
                                 recompute=recompute, moe=moe, overrides=overrides, vision=vision)


def build(cfg: Any, layout: Layout, shape: mp.Qwen35Shape, *, platform: Any, te: TeOptions, device: torch.device,
          reference: bool, vision: bool) -> Built:
    from qwen35rl.engines.megatron import model as mm

    dtype = param_dtype(cfg.backend)
    tconfig = transformer_config(cfg, layout, shape, platform=platform, te=te, device=device, reference=reference,
                                 vision=vision)
    meta = build_model(cfg.model, dtype=dtype, device="meta", text_only=not vision)
    vision_names = [n[len(mp.VISION_PREFIX):] for n, _ in meta.named_parameters() if n.startswith(mp.VISION_PREFIX)]
    tower = (lambda: build_vision_tower(meta.config, dtype)) if vision else None
    chunks = mm.build_chunks(tconfig, cfg.model, shape, megatron_attention=platform.megatron_core_attention,
                             vision_tower=tower)
    for c in chunks:
        c.to(device)
        if hasattr(c, "visual"):
            setup_tower(c.visual, freeze=cfg.model.freeze_vision_tower,
                        recompute=tconfig.recompute_granularity == "full")
    return Built(tconfig, chunks, mm.chunk_layer_ids(tconfig, chunks), meta, vision_names)


def setup_tower(tower: torch.nn.Module, *, freeze: bool, recompute: bool) -> None:
    """The vision tower trains like the decoder: frozen with model.freeze_vision_tower (before DDP wraps it: no
    gradient buffer, no optimizer state), its blocks recomputed when the decoder's layers are (megatron's
    recompute does not reach transformers' modules; the plan's memory estimate counts it so)."""
    if freeze:
        tower.requires_grad_(False)
    elif recompute:
        enable_activation_checkpointing(tower)
