"""Each engine declared once, by name: what the worker builds, which parallelism degrees it reads and what it can
do. The plan, the memory and cost models and the workers ask these specs for an ability instead of comparing engine
names. Torch-free: the builders are `module:Class` strings the workers import.

A new engine is one entry here (and its `backend=` / `rollout=` config file); `tests/config/test_engine_specs.py`
checks every entry against the schema's choices and that its builder exists."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

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
    SP) and every device runs every layer. The memory model's formulas, the layout rules that relate the degrees
    to the world and the run name's layout tag follow this split."""
    reshardable_checkpoints: bool
    """Its checkpoints load onto any layout (DTensor shards); otherwise only onto the split that wrote them."""
    expert_parallel_rollout: bool
    """With an MoE model its recipes generate with one DP-attention engine with EP over every device."""
    packages: Tuple[str, ...]
    """Importable packages it needs beyond torch. Facts of a package hold for every engine that lists it: with
    `megatron` (megatron-core) its version rules, TransformerConfig overrides and GDN recurrence apply."""
    pipeline_keys: Tuple[str, ...]
    """`parallelism.*` keys besides the degrees that cut its pipeline into stages (VPP, an explicit layout)."""
    checkpoint_bytes_per_param: int
    """Bytes one checkpoint holds per trained parameter (the plan's disk estimate)."""
    offloads_between_phases: bool
    """backend.param_offload / grad_offload / optimizer_offload move its state to the host between training and
    generation, and backend.optimizer_cpu_offload runs a share of its optimizer step there; otherwise any of them
    turns on one CPU offload policy for the whole step (backend.offload_policy)."""
    compiles_layers: bool
    """Runs transformers' decoder layers: backend.use_torch_compile compiles their GDN convolution and
    backend.compile_layers their norms and MLPs."""
    declared_version: Optional[Tuple[str, str]]
    """(distribution, config key) of the package release the config declares, which the preflight holds against
    the nodes."""
    offload_keys: Tuple[str, ...]
    """The settings that put its state on the host, which the layout search turns on or off together (FSDP: its
    CPU offload policy, which any of them turns on; Megatron: the CPU optimizer step and the copies between
    phases)."""
    max_degree: Tuple[Tuple[str, int], ...] = ()
    """Axes it reads but builds only up to a degree ((axis, degree); `capabilities` says why); the layout search
    stays inside."""

    def degree_limit(self, axis: str) -> Optional[int]:
        """The largest degree of `axis` it builds (`max_degree`), or None where it has no such limit."""
        return dict(self.max_degree).get(axis)

    @property
    def layout_axes(self) -> Tuple[str, ...]:
        """Every `parallelism.*` key it reads; another engine's keep their defaults."""
        return self.layout_keys + self.pipeline_keys

    def uses(self, package: str) -> bool:
        return package in self.packages


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
    """Importable packages it needs beyond torch. With `vllm` the vLLM facts apply: its version, platform quirks,
    GDN prefill kernel and engine arguments."""
    expert_parallel: bool
    """One engine spreads an MoE model's experts over `parallelism.rollout.ep` devices."""
    compiles_decode: bool
    """rollout.compile_decode compiles its decode step; otherwise it compiles by its own settings (or not)."""
    declared_version: Optional[Tuple[str, str]]
    """(distribution, config key) of the package release the config declares (see TrainEngineSpec)."""
    decode_floor_s: Tuple[float, float, float]
    """Seconds per decode step (low, typical, high) however small the model and the batch: the step-time estimate's
    floor, to which `decode_per_sequence_s` adds each sequence decoded in the step."""
    decode_per_sequence_s: Tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Seconds per decode step and sequence in the batch (low, typical, high) that the engine spends however small
    the model (scheduling, sampling, output handling), on top of `decode_floor_s`."""

    def uses(self, package: str) -> bool:
        return package in self.packages


TRAIN_ENGINES: Dict[str, TrainEngineSpec] = {s.name: s for s in (
    # A checkpoint of the fp32 parameters and Adam's two fp32 moments (4 + 2 * 4 bytes).
    TrainEngineSpec("fsdp", "qwen35rl.engines.fsdp_engine:FsdpTrainEngine", ("fsdp_size", "sp"),
                    model_parallel=False, reshardable_checkpoints=True, expert_parallel_rollout=False, packages=(),
                    pipeline_keys=(), checkpoint_bytes_per_param=12, offloads_between_phases=False,
                    compiles_layers=True, declared_version=None,
                    offload_keys=("backend.param_offload", "backend.optimizer_offload", "backend.offload_policy")),
    # A checkpoint of the bf16 model weights, the distributed optimizer's fp32 main copy and the two moments
    # (2 + 4 + 2 * 4 bytes).
    TrainEngineSpec("megatron", "qwen35rl.engines.megatron.engine:MegatronTrainEngine", ("tp", "pp", "cp", "ep", "etp"),
                    model_parallel=True, reshardable_checkpoints=False, expert_parallel_rollout=True,
                    packages=("megatron",), pipeline_keys=("vpp", "pipeline_layout"), checkpoint_bytes_per_param=14,
                    offloads_between_phases=True, compiles_layers=False,
                    declared_version=("megatron-core", "backend.megatron_core_version"),
                    offload_keys=("backend.optimizer_cpu_offload", "backend.param_offload", "backend.grad_offload",
                                  "backend.optimizer_offload"),
                    max_degree=(("cp", 1),)),
)}

# Decode floors: the transformers rollout 8.0 ms a step with its CUDA graph and 40-47 ms eager
# (bench/results/h200.md). vLLM 0.26 in the trainer's process (bench/results/vllm_gpu.md; generations of 128 steps,
# prefill, wake and sleep included): the 4B 11.9 ms a step at 64 sequences (H100) and 33.7 ms at 256 (H200), so
# 4.6 ms plus 0.11 ms a sequence; the 0.8B 8.7-12.3 ms at 64. At 256 sequences the per-sequence part outweighs
# reading the 4B's weights 3x over: the engine's work per sequence, not the model, sets the pace. The low ends halve
# the typical value (a faster GPU, another release), the high ends double it.
ROLLOUT_ENGINES: Dict[str, RolloutEngineSpec] = {s.name: s for s in (
    RolloutEngineSpec("hf", "qwen35rl.engines.hf_rollout:HfRolloutEngine", own_weights=False, kv_pool=False,
                      tensor_parallel=False, split_pool=True, packages=(), expert_parallel=False,
                      compiles_decode=True, declared_version=None, decode_floor_s=(0.008, 0.010, 0.045)),
    RolloutEngineSpec("vllm", "qwen35rl.engines.vllm_rollout:VllmRolloutEngine", own_weights=True, kv_pool=True,
                      tensor_parallel=True, split_pool=False, packages=("vllm",), expert_parallel=True,
                      compiles_decode=False, declared_version=("vllm", "rollout.vllm_version"),
                      decode_floor_s=(0.0023, 0.0046, 0.0092), decode_per_sequence_s=(5.7e-5, 1.13e-4, 2.27e-4)),
)}


def _named(table: Dict[str, Any], name: str, key: str) -> Any:
    try:
        return table[name]
    except KeyError:
        hint = did_you_mean(name, table)
        raise ValueError(f"{key}={name!r}: expected one of {', '.join(table)}" + (f"; {hint}" if hint else "")) from None


def _name(cfg_or_name: Any, group: str, key: str) -> str:
    return cfg_or_name if isinstance(cfg_or_name, str) else str(cfg_or_name[group][key])


def train_engine(cfg_or_name: Any) -> TrainEngineSpec:
    """The spec of `backend.name` (a config tree, DictConfig or dict, or the name itself)."""
    return _named(TRAIN_ENGINES, _name(cfg_or_name, "backend", "name"), "backend.name")


def rollout_engine(cfg_or_name: Any) -> RolloutEngineSpec:
    """The spec of `rollout.engine` (a config tree, or the name itself)."""
    return _named(ROLLOUT_ENGINES, _name(cfg_or_name, "rollout", "engine"), "rollout.engine")


def declared(table: Dict[str, Any], name: Any) -> Optional[Any]:
    """The spec of an engine name that may be unknown (None): for the callers that run before `engine_known`
    reports it (a refused plan, the run name, the stack check)."""
    return table.get(str(name))


def train_uses(cfg_or_name: Any, package: str) -> bool:
    """The training engine (a config tree or its name) builds on `package`, whose facts then apply; False for a
    name no spec declares."""
    spec = declared(TRAIN_ENGINES, _name(cfg_or_name, "backend", "name"))
    return spec is not None and spec.uses(package)


def rollout_uses(cfg_or_name: Any, package: str) -> bool:
    """The rollout engine (a config tree or its name) runs on `package` (`vllm`: the vLLM facts apply); False for
    a name no spec declares."""
    spec = declared(ROLLOUT_ENGINES, _name(cfg_or_name, "rollout", "engine"))
    return spec is not None and spec.uses(package)


def load(builder: str) -> Any:
    """The class a `module:Class` builder names (imports the module: workers only)."""
    module, _, attr = builder.partition(":")
    return getattr(importlib.import_module(module), attr)
