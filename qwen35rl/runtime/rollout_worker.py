"""The rollout worker of `placement=split`: one process per device of the rollout pool, holding a rollout engine with
the full policy and nothing of the trainer. It generates its share of prompts and takes new weights from training
rank 0 over the weight-sync communicator (`weight_sync`), never through the training pool's torch.distributed group.

Generation and weight loading never overlap: the driver waits for a generation to finish before it starts a sync
(the engine would otherwise sample from half-loaded weights).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

from qwen35rl.config import engine_specs
from qwen35rl.config.layout import Layout
from qwen35rl.config.schema import typed
from qwen35rl.engines.base import RolloutEngine, RolloutRequest, RolloutResult
from qwen35rl.config.memory import trains_vision  # the config rule: the modeling loads with the engines
from qwen35rl.runtime.memory_peaks import MemoryPeaks
from qwen35rl.runtime.platform import require_stack, resolve_platform
from qwen35rl.runtime.quiet import quiet_known_warnings
from qwen35rl.runtime.worker import PolicyWorker, accelerator_ids, hf_rollout_engine

log = logging.getLogger(__name__)


class RolloutWorker:
    def __init__(self, cfg: Union[DictConfig, Dict[str, Any]], *, layout: Layout, rank: int, world_size: int,
                 local_rank: int, run_dir: str = "", optimizer_steps: Optional[int] = None):
        """`rank`: in the rollout pool (0 .. rollout_world - 1); the signature is the training worker's, so that both
        pools are placed by the same code."""
        self.cfg = cfg if OmegaConf.is_config(cfg) else typed(cfg)
        self.layout, self.rank, self.world_size, self.local_rank = layout, rank, world_size, local_rank
        self.platform = resolve_platform(self.cfg)
        quiet_known_warnings(self.platform.device_type)
        require_stack(self.platform, self.cfg.rollout.engine)
        self.device = self.platform.torch_device(self.platform.local_device_index(accelerator_ids(self.platform)))
        self.memory = MemoryPeaks(self.platform.device_module())
        self.text_only = not trains_vision({"model": self.cfg.model, "data": self.cfg.data})
        self.rollout: Optional[RolloutEngine] = None
        self.sync_group = None
        self.version = -1
        """The policy version of the loaded weights (the training step they come from)."""

    rendezvous_address = PolicyWorker.rendezvous_address

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Build the engine; the rollout pool has no torch.distributed world of its own (each hf engine holds the whole
        policy), so the address is unused."""
        from qwen35rl.models.tokenizer import build_tokenizer

        torch.manual_seed(self.cfg.trainer.seed)
        tokenizer = build_tokenizer(self.cfg.model)
        processor = None
        if not self.text_only:
            from qwen35rl.models.processor import build_processor

            processor = build_processor(self.cfg.model, tokenizer)
        if not engine_specs.rollout_engine(self.cfg).split_pool:  # the plan refuses it (split_rollout_needs_hf)
            raise RuntimeError(f"placement=split runs rollout.engine=hf, not {self.cfg.rollout.engine}")
        self.rollout = hf_rollout_engine(self.cfg, self.device, tokenizer, processor, self.text_only)

    def data_shards(self) -> Dict[str, int]:
        """One rollout group per worker (the hf engine has no tensor parallel)."""
        return {"rollout_group": self.rank, "rollout_groups": self.world_size}

    def join_weight_sync(self, host: str, port: int, world_size: int) -> None:
        """Join the sync communicator as its rank 1 + this worker's rank (training rank 0 is its rank 0)."""
        from qwen35rl.runtime.weight_sync import WeightSyncGroup, collective_backend

        self.sync_group = WeightSyncGroup(host, port, 1 + self.rank, world_size,
                                          collective_backend(self.platform.device_type), self.device,
                                          self.cfg.backend.dist_timeout_s)

    def receive_weights(self, version: int) -> Dict[str, float]:
        """Take the policy of training step `version` bucket by bucket into the engine (called while training rank 0
        sends; the driver has paused generation)."""
        self.rollout.load_weights(self.sync_group.receive())
        self.version = int(version)
        return self.sync_group.last_stats.as_dict()

    def generate(self, prompt_ids: List[List[int]], params: Dict[str, Any]) -> RolloutResult:
        if not prompt_ids:
            return RolloutResult(response_ids=[], log_probs=[], finish_reasons=[])
        with self.memory.phase("gen"):
            result = self.rollout.generate(RolloutRequest(prompt_ids=prompt_ids, **params))
        stats = getattr(self.rollout, "stats", None)
        if stats is not None:
            result.decode = dataclasses.asdict(stats)
        return result

    max_memory_allocated_gb = PolicyWorker.max_memory_allocated_gb
    phase_memory_gb = PolicyWorker.phase_memory_gb

    def shutdown(self) -> None:
        if self.sync_group is not None:
            self.sync_group.close()
