"""Where one rank sits in megatron-core's process groups, and the few collectives the engine runs over them.

The layout comes from the driver (`config.layout.Layout`, derived once); this module only checks it against the
process group the engine runs in and hands it to megatron's `parallel_state`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from qwen35rl.config.layout import Layout
from qwen35rl.engines.megatron.mapping import RankLayout


def check_world(layout: Layout, world_size: int) -> None:
    if layout.world != world_size:
        raise ValueError(f"the process group has {world_size} ranks but the layout has {layout.world} "
                         f"(hw.nodes x hw.devices_per_node)")


def transformer_parallel(layout: Layout) -> Dict[str, Any]:
    """The parallel sizes under TransformerConfig / MindSpeed names."""
    return {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
            "context_parallel_size": layout.cp, "expert_model_parallel_size": layout.ep,
            "expert_tensor_parallel_size": layout.etp, "sequence_parallel": layout.tp > 1}


class Ranks:
    """This rank's megatron process groups (initialised on first use: the policy and the reference share them)."""

    def __init__(self, layout: Layout, device: torch.device, *, timeout_s: int, seed: int):
        from megatron.core import parallel_state as mpu

        self.layout, self.device, self.mpu = layout, device, mpu
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=layout.vpp or None, context_parallel_size=layout.cp,
                expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
                distributed_timeout_minutes=max(1, timeout_s // 60))
            if device.type != "cpu":
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(seed)

    @property
    def dp_rank(self) -> int:
        return self.mpu.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self.mpu.get_data_parallel_world_size()

    @property
    def pp_rank(self) -> int:
        return self.mpu.get_pipeline_model_parallel_rank()

    def shard(self) -> RankLayout:
        """Coordinates in the tensor / expert / expert-tensor groups (what the weight mapping shards by)."""
        m = self.mpu
        return RankLayout(tp_rank=m.get_tensor_model_parallel_rank(), tp_size=m.get_tensor_model_parallel_world_size(),
                          ep_rank=m.get_expert_model_parallel_rank(), ep_size=m.get_expert_model_parallel_world_size(),
                          etp_rank=m.get_expert_tensor_parallel_rank(),
                          etp_size=m.get_expert_tensor_parallel_world_size())

    def key(self) -> str:
        """This rank's model-parallel coordinates, the prefix of its checkpoint keys (DP replicas share it)."""
        r = self.shard()
        return f"pp{self.pp_rank}_tp{r.tp_rank}_ep{r.ep_rank}_etp{r.etp_rank}"

    def tp_group(self) -> Optional[Any]:
        return self.mpu.get_tensor_model_parallel_group() if self.layout.tp > 1 else None

    def is_last_stage(self) -> bool:
        return self.mpu.is_pipeline_last_stage(ignore_virtual=True)

    def pp_broadcast(self, t: torch.Tensor, src_stage: Optional[int] = None) -> torch.Tensor:
        """`t` from pipeline stage `src_stage` (default: the last) to every stage, in place (same shape everywhere)."""
        if self.layout.pp == 1:
            return t
        group = self.mpu.get_pipeline_model_parallel_group()
        src = self.layout.pp - 1 if src_stage is None else src_stage
        dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
        return t

    def pp_all_gather_object(self, obj: Any) -> list:
        if self.layout.pp == 1:
            return [obj]
        out = [None] * self.layout.pp
        dist.all_gather_object(out, obj, group=self.mpu.get_pipeline_model_parallel_group())
        return out

    def sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        dist.all_reduce(t, group=self.mpu.get_data_parallel_group())
        return t
