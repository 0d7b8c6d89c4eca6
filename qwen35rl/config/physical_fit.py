"""Whether a model can physically train on a hardware preset at all, layout aside: the bound the everyday grid's
test and the refusal's smallest-change hint both use. Torch-free."""
from __future__ import annotations

from typing import Any

from qwen35rl.config import params as P
from qwen35rl.config.engine_specs import train_engine

PLAIN_SHARE = 0.7
"""The share of device memory a cell's training state and rollout weights may take to count as plainly fitting."""
STATE_BYTES = 16
"""Training state per parameter, fully sharded: bf16 weights and gradients, fp32 master weights and Adam's two
moments (2 + 2 + 4 + 8)."""


def rollout_weights_fit(cfg: Any) -> bool:
    """A rollout layout gives a device at most `PLAIN_SHARE` of its memory in bf16 weights (TP up to a node, or one
    expert-parallel engine over every device where the backend builds one)."""
    m, hw = cfg["model"], cfg["hw"]
    count = P.count_params(m)
    devices = int(hw["nodes"]) * int(hw["devices_per_node"])
    tp = devices if hw["multi_node_rollout_tp"] else min(devices, int(hw["devices_per_node"]))
    experts = len(P.layer_kinds(m)) * P.layer_expert_params(m)
    ep = devices if (train_engine(cfg).expert_parallel_rollout and m["moe"]) else tp
    return 2 * ((count.total - experts) / tp + experts / ep) <= PLAIN_SHARE * float(hw["memory_gb"]) * 1e9


def plainly_fits(cfg: Any) -> bool:
    """The model can physically train here: `STATE_BYTES` per parameter of training state fully sharded plus the
    rollout's bf16 weights (the model's total parameters, vision tower included) within `PLAIN_SHARE` of every
    device's memory together, and `rollout_weights_fit`."""
    hw = cfg["hw"]
    total = P.count_params(cfg["model"]).total
    devices, memory = int(hw["nodes"]) * int(hw["devices_per_node"]), float(hw["memory_gb"]) * 1e9
    return (STATE_BYTES + 2) * total <= PLAIN_SHARE * devices * memory and rollout_weights_fit(cfg)
