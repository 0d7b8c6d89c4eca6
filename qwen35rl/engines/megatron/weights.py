"""Weights in and out of this rank's model chunks under HF names: filling the shards from HF tensors at start, and
gathering whole-model tensors for the rollout engine (`export`). The name and layout rules are `mapping`'s; this
module adds where each tensor lives (which chunk, which pipeline stage, which experts) and the collectives.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from qwen35rl.engines.megatron import mapping as mp
from qwen35rl.engines.megatron.ranks import Ranks

log = logging.getLogger(__name__)


def hf_source(model_cfg: Any, hf_state: Optional[Dict[str, torch.Tensor]], *, dtype: torch.dtype, seed: int,
              vision: bool):
    """Where the start weights come from: `hf_state`, the pretrained checkpoint, or the seeded random init the
    rollout engine and the FSDP engine build too (every rank builds it identically)."""
    from qwen35rl.engines.megatron.hf_source import CheckpointSource, DictSource
    from qwen35rl.models.build import build_model

    if hf_state is not None:
        return DictSource(hf_state)
    if model_cfg.init == "pretrained":
        return CheckpointSource(model_cfg.path)
    return DictSource(build_model(model_cfg, dtype=dtype, device="cpu", seed=seed, text_only=not vision).state_dict())


@dataclass
class ChunkWeights:
    """The HF view of this rank's chunks. `chunk_layers[ci]`: the global decoder-layer ids of chunk ci, in order;
    `meta`: the HF model on the meta device (whole-model shapes); `hf_prefix`: the names exports carry."""

    chunks: Sequence[torch.nn.Module]
    chunk_layers: List[List[int]]
    shape: mp.Qwen35Shape
    meta: torch.nn.Module
    vision_names: List[str]
    hf_prefix: str
    ranks: Ranks
    device: torch.device
    names: mp.MegatronNames = field(default_factory=mp.MegatronNames)

    def __post_init__(self):
        self._plan_exports()

    # ------------------------------------------------------------------------------------------ naming
    def _local_experts(self, rank: mp.RankLayout) -> range:
        return rank.local_experts(self.shape.num_experts) if self.shape.moe else range(0)

    def _chunk_maps(self, ci: int) -> List[mp.ParamMap]:
        chunk = self.chunks[ci]
        maps = mp.param_maps(self.shape, self.names, layers=self.chunk_layers[ci], pre_process=chunk.pre_process,
                             post_process=chunk.post_process, vision_names=self.vision_names)
        if self.shape.tie_word_embeddings and chunk.post_process and not chunk.pre_process:
            maps.append(mp.tied_output_layer_map())
        return maps

    def _local_name(self, ci: int, p: mp.MegatronParam, local_experts: range) -> str:
        """`p`'s name inside chunk ci: layers and experts numbered from 0 within the chunk / the rank."""
        name = p.name
        layer = mp.layer_index(name)
        if layer is not None:
            name = mp.with_layer_index(name, self.chunk_layers[ci].index(layer))
        if p.expert is not None:
            name = mp.with_expert_index(name, p.expert - local_experts.start)
        return name

    # ------------------------------------------------------------------------------------------ in
    @torch.no_grad()
    def load(self, source, strict: bool) -> None:
        """Fill this rank's shards from HF tensors; with `strict` every parameter of every chunk must be set (a
        platform may allow missing ones, which keep megatron's random init)."""
        rank = self.ranks.shard()
        local_experts = self._local_experts(rank)
        for ci, chunk in enumerate(self.chunks):
            params = dict(chunk.named_parameters())
            loaded = set()
            for m in self._chunk_maps(ci):
                missing = [n for n in m.hf if n not in source]
                if missing:
                    if strict:
                        raise KeyError(f"HF weights lack {missing}")
                    log.warning("HF weights lack %s: those parameters keep megatron's random init", missing)
                    continue
                for p, t in zip(m.megatron, m.to_megatron([source.get(n) for n in m.hf])):
                    if p.expert is not None and p.expert not in local_experts:
                        continue
                    name = self._local_name(ci, p, local_experts)
                    tp_rank, tp_size = (rank.etp_rank, rank.etp_size) if p.expert is not None else (rank.tp_rank, rank.tp_size)
                    shard = mp.split_for_rank(t, p.split, tp_rank, tp_size)
                    if name not in params:
                        raise KeyError(f"megatron model has no parameter {name!r} (chunk {ci}); the specs and the "
                                       f"mapping disagree")
                    if params[name].shape != shard.shape:
                        raise ValueError(f"{name}: model shape {tuple(params[name].shape)} vs mapped {tuple(shard.shape)}")
                    params[name].copy_(shard)
                    loaded.add(name)
            unset = sorted(set(params) - loaded)
            if unset and strict:
                raise RuntimeError(f"chunk {ci}: parameters not set from the HF weights: {unset[:8]}")

    # ------------------------------------------------------------------------------------------ out
    def _plan_exports(self) -> None:
        """Which pipeline rank and chunk own each map, and the whole-model shapes (for broadcasts), agreed by all
        ranks: the full shapes come from running the mapping on meta tensors."""
        self.export_maps = mp.param_maps(self.shape, self.names, hf_prefix=self.hf_prefix,
                                         vision_names=self.vision_names)
        meta = dict(self.meta.state_dict())
        self.full_shapes = {p.name: tuple(t.shape) for m in self.export_maps
                            for p, t in zip(m.megatron, m.to_megatron([meta[n] for n in m.hf]))}
        mine = {}
        pp_rank = self.ranks.pp_rank
        for ci, chunk in enumerate(self.chunks):
            for m in mp.param_maps(self.shape, self.names, hf_prefix=self.hf_prefix, layers=self.chunk_layers[ci],
                                   pre_process=chunk.pre_process, post_process=chunk.post_process,
                                   vision_names=self.vision_names):
                mine[m.hf] = (pp_rank, ci)
        self.owner = {k: v for o in self.ranks.pp_all_gather_object(mine) for k, v in o.items()}

    def _gather_local(self, ci: int, m: mp.ParamMap) -> List[torch.Tensor]:
        """Whole-model tensors of `m` from this pipeline stage's shards (collective over TP / EP / ETP)."""
        rank = self.ranks.shard()
        mpu = self.ranks.mpu
        params = dict(self.chunks[ci].named_parameters())
        local_experts = self._local_experts(rank)
        if any(p.expert is not None for p in m.megatron):
            mine = [params[self._local_name(ci, p, local_experts)].detach() for p in m.megatron if p.expert in local_experts]
            split = m.megatron[0].split
            mine = [_gather(t, split, mpu.get_expert_tensor_parallel_group(), rank.etp_size) for t in mine]
            stacked = torch.stack(mine)
            if rank.ep_size > 1:
                parts = [torch.empty_like(stacked) for _ in range(rank.ep_size)]
                dist.all_gather(parts, stacked.contiguous(), group=mpu.get_expert_model_parallel_group())
                stacked = torch.cat(parts)
            return list(stacked.unbind(0))
        return [_gather(params[self._local_name(ci, p, local_experts)].detach(), p.split, self.ranks.tp_group(),
                        rank.tp_size) for p in m.megatron]

    def _fetch(self, out_dtype: torch.dtype, out_device: torch.device, m: mp.ParamMap) -> List[torch.Tensor]:
        owner_pp, ci = self.owner[m.hf]
        if self.ranks.pp_rank == owner_pp:
            full = [t.to(out_dtype) for t in self._gather_local(ci, m)]
        else:
            full = [torch.empty(self.full_shapes[p.name], dtype=out_dtype, device=self.device) for p in m.megatron]
        for t in full:
            self.ranks.pp_broadcast(t, src_stage=owner_pp)
        return [t.to(out_device, copy=True) for t in full]

    def export(self, bucket_mb: float, dtype: torch.dtype,
               device: Optional[Any] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """HF-named full tensors (tied embedding once) in `dtype`, on CPU or on `device`. Collective over every
        rank, one map at a time."""
        out = torch.device("cpu") if device is None else torch.device(device)
        return mp.export_hf(self.export_maps, partial(self._fetch, dtype, out), bucket_mb)


def _gather(t: torch.Tensor, split: Optional[mp.Split], group, size: int) -> torch.Tensor:
    if split is None or size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return mp.merge_ranks(parts, split)
