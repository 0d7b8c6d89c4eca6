"""Each engine declared once, by name: what the worker builds, which parallelism degrees it reads and what it can
do. The plan, the memory and cost models and the workers ask these specs for an ability instead of comparing engine
names. Torch-free: the builders are `module:Class` strings the workers import.

A new engine is one entry here (and its `backend=` / `rollout=` config file); `tests/config/test_engine_specs.py`
checks every entry against the schema's choices and that its builder exists."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, Tuple

from qwen35rl.names import did_you_mean


@dataclass(frozen=True)
class TrainEngineSpec:
    name: str
    builder: str
    """`module:Class` of the engine (engines.base.TrainEngine) a training worker builds."""
    layout_keys: Tuple[str, ...]
    """The `parallelism.*` degrees this engine reads."""
    model_parallel: bool
    """Splits layers and tensors over devices (TP / PP / CP / EP); otherwise it shards parameters (FSDP, Ulysses
    SP) and every device runs every layer."""
    reshardable_checkpoints: bool
    """Its checkpoints load onto any layout (DTensor shards); otherwise only onto the split that wrote them."""
    expert_parallel_rollout: bool
    """With an MoE model its recipes generate with one DP-attention engine with EP over every device."""
    packages: Tuple[str, ...]
    """Importable packages it needs beyond torch."""


@dataclass(frozen=True)
class RolloutEngineSpec:
    name: str
    builder: str
    """`module:Class` of the engine (engines.base.RolloutEngine)."""
    own_weights: bool
    """Keeps its own copy of the weights (refreshed after every update, asleep while the trainer works); otherwise
    it generates with a model that the weight sync fills in place on the same worker."""
    kv_pool: bool
    """Preallocates its KV cache as a share of the device's memory (`rollout.gpu_memory_utilization`)."""
    tensor_parallel: bool
    """One engine spans `parallelism.rollout.tp` devices."""
    split_pool: bool
    """Runs on a rollout pool of its own (`placement=split`)."""
    packages: Tuple[str, ...]


TRAIN_ENGINES: Dict[str, TrainEngineSpec] = {s.name: s for s in (
    TrainEngineSpec("fsdp", "qwen35rl.engines.fsdp_engine:FsdpTrainEngine", ("fsdp_size", "sp"),
                    model_parallel=False, reshardable_checkpoints=True, expert_parallel_rollout=False, packages=()),
    TrainEngineSpec("megatron", "qwen35rl.engines.megatron.engine:MegatronTrainEngine", ("tp", "pp", "cp", "ep", "etp"),
                    model_parallel=True, reshardable_checkpoints=False, expert_parallel_rollout=True,
                    packages=("megatron",)),
)}

ROLLOUT_ENGINES: Dict[str, RolloutEngineSpec] = {s.name: s for s in (
    RolloutEngineSpec("hf", "qwen35rl.engines.hf_rollout:HfRolloutEngine", own_weights=False, kv_pool=False,
                      tensor_parallel=False, split_pool=True, packages=()),
    RolloutEngineSpec("vllm", "qwen35rl.engines.vllm_rollout:VllmRolloutEngine", own_weights=True, kv_pool=True,
                      tensor_parallel=True, split_pool=False, packages=("vllm",)),
)}


def _named(table: Dict[str, Any], name: str, key: str) -> Any:
    try:
        return table[name]
    except KeyError:
        hint = did_you_mean(name, table)
        raise ValueError(f"{key}={name!r}: expected one of {', '.join(table)}" + (f"; {hint}" if hint else "")) from None


def train_engine(cfg_or_name: Any) -> TrainEngineSpec:
    """The spec of `backend.name` (a config tree, DictConfig or dict, or the name itself)."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else str(cfg_or_name["backend"]["name"])
    return _named(TRAIN_ENGINES, name, "backend.name")


def rollout_engine(cfg_or_name: Any) -> RolloutEngineSpec:
    """The spec of `rollout.engine` (a config tree, or the name itself)."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else str(cfg_or_name["rollout"]["engine"])
    return _named(ROLLOUT_ENGINES, name, "rollout.engine")


def load(builder: str) -> Any:
    """The class a `module:Class` builder names (imports the module: workers only)."""
    module, _, attr = builder.partition(":")
    return getattr(importlib.import_module(module), attr)
