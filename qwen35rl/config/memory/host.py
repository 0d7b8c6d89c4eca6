"""Off the device: host memory per device for what the trainer offloads, and the size of one checkpoint on disk."""
from __future__ import annotations

from typing import Any

from qwen35rl.config import params as P
from qwen35rl.config.engine_specs import train_engine
from qwen35rl.config.layout import Layout
from qwen35rl.config.memory.common import BF16, FP32, _model_parallel, _offload_policy_on, gib, kl_on
from qwen35rl.config.memory.shard import TrainShard
from qwen35rl.config.memory.training import optimizer_states_gib, train_grads_gib, train_weights_gib


def host_offloaded_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """Host memory per device for what the trainer offloads: Megatron's CPU optimizer share (12 B/param), and
    between phases weights (2 B), fp32 grads and the device optimizer share; FSDP offloaded (`_offload_policy_on`)
    keeps fp32 params + grads + Adam m, v (16 B/param; frozen parameters 4 B) there; plus an offloaded reference
    model (bf16)."""
    b = cfg["backend"]
    if train_engine(cfg).offloads_between_phases:
        host = 0.0
        if b["optimizer_cpu_offload"]:
            full = optimizer_states_gib({**cfg, "backend": {**b, "optimizer_cpu_offload": False}}, layout, shard)
            host += full * float(b["optimizer_offload_fraction"])
        host += train_weights_gib(cfg, layout, shard) if b["param_offload"] else 0.0
        host += train_grads_gib(cfg, layout, shard) if b["grad_offload"] else 0.0
        host += optimizer_states_gib(cfg, layout, shard) if b["optimizer_offload"] else 0.0
    else:
        host = gib(shard.trained * 4 * FP32 + shard.frozen * FP32) if _offload_policy_on(cfg) else 0.0
    offloaded_ref = b["param_offload"] or (not _model_parallel(layout) and _offload_policy_on(cfg))
    return host + (gib(shard.held * BF16) if kl_on(cfg) and offloaded_ref else 0.0)


def checkpoint_gib(cfg: Any) -> float:
    """Size of one checkpoint of the policy (the reference is rebuilt, not saved): the trained parameters (the
    vision tower when the run sees images) times what the engine's checkpoint holds per parameter (its spec's
    `checkpoint_bytes_per_param`)."""
    count = P.count_params(cfg["model"])
    trained = count.text + (count.vision if cfg["data"].get("has_images") else 0)
    return gib(trained * train_engine(cfg).checkpoint_bytes_per_param)
